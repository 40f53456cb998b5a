"""Forward+backward of one MoE layer: gridtrain's MoELayer vs plain PyTorch, tokens/s per rank at ep=1,2,4;
and (``--grouped``) the experts' grouped matmuls: one kernel, padded bmm and the loop, at E=8 and E=64.

    python -m benchmarks.moe [--tokens 1024] [--d-model 128] [--d-ff 256] [--experts 8] [--iters 10]
    python -m benchmarks.moe --grouped [--iters 10]

Contenders, same weights and tokens (SwiGLU experts, top-2, dropless):

* ``ours``: :class:`parallel.layers.moe.MoELayer` on the ep group (sort by expert, uneven
  all-to-all through ``parallel.comm``, one matmul per weight per local expert segment);
* ``loop`` (ep=1): the plain per-expert loop of ``transformers``' Mixtral (a boolean mask and
  ``torch.where`` per expert, ``index_add_`` back);
* ``torch_a2a`` (ep>1): the same dispatch written with torch's own autograd collective
  ``torch.distributed.nn.functional.all_to_all_single`` and a mask per local expert.

``--grouped`` times :class:`parallel.layers.moe.GroupedExperts` (SwiGLU, forward + backward, fp32, one
process) over the same uneven segments (a seeded multinomial routing of ``tokens × top_k`` rows) in each
of :data:`parallel.layers.grouped_mm.KINDS`: Mixtral-like E=8 top-2 (d 128, f 256), and fine-grained
E=64 top-8 (d 128, f 64, DeepSeek-like). Its answer is :data:`~parallel.layers.grouped_mm.CPU_KIND`.

Not a test: timings on a shared 2-core machine are noisy; medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F

from parallel.layers.grouped_mm import KINDS
from parallel.layers.moe import GroupedExperts, MoEConfig, MoELayer, route
from parallel.testing import run_ranks

from .common import time_alternating


def _expert(layer: MoELayer, i: int, x: torch.Tensor) -> torch.Tensor:
    e = layer.experts
    return (F.silu(x @ e.gate_proj[i]) * (x @ e.up_proj[i])) @ e.down_proj[i]


def plain_loop(layer: MoELayer, h: torch.Tensor) -> torch.Tensor:
    """Mixtral's reference loop (one process, all experts local)."""
    r = route(layer.router(h), layer.cfg)
    out = torch.zeros_like(h)
    for e in range(layer.cfg.num_experts):
        tok, slot = torch.where(r.experts == e)
        if tok.numel():
            out.index_add_(0, tok, _expert(layer, e, h[tok]) * r.weights[tok, slot, None])
    return out


def torch_a2a(layer: MoELayer, h: torch.Tensor, group) -> torch.Tensor:
    """The same dispatch with torch's collectives: sort, exchange counts, all_to_all_single, mask per expert."""
    E, k, P = layer.cfg.num_experts, layer.cfg.top_k, dist.get_world_size(group)
    L = E // P
    r = route(layer.router(h), layer.cfg)
    flat = r.experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    send_sizes = counts.view(P, L).sum(1).tolist()
    recv_sizes = recv.view(P, L).sum(1).tolist()
    rows = dnn.all_to_all_single(
        h.new_empty(sum(recv_sizes), h.shape[1]), h[order // k], recv_sizes, send_sizes, group=group
    )
    expert_of = torch.repeat_interleave(torch.arange(L).repeat(P), recv)  # [source][local expert] blocks
    y = torch.zeros_like(rows)
    for i in range(L):
        idx = torch.where(expert_of == i)[0]
        y = y.index_add(0, idx, _expert(layer, i, rows[idx]))
    back = dnn.all_to_all_single(h.new_empty(len(order), h.shape[1]), y, send_sizes, recv_sizes, group=group)
    w = r.weights.reshape(-1)[order, None]
    return torch.zeros_like(h).index_add(0, order // k, back * w)


def _rank(args) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn's deprecation note
    ep = dist.get_world_size()
    group = dist.group.WORLD if ep > 1 else None
    torch.manual_seed(0)
    layer = MoELayer(args.d_model, MoEConfig(args.experts, args.d_ff, top_k=2), ep_group=group)
    h = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(dist.get_rank()))
    h.requires_grad_()
    theirs = (lambda: plain_loop(layer, h)) if ep == 1 else (lambda: torch_a2a(layer, h, group))
    assert torch.allclose(layer(h), theirs(), atol=1e-5)  # same numbers first
    steps = {"ours": lambda: layer(h).sum().backward(), "theirs": lambda: theirs().sum().backward()}
    times = time_alternating(steps, args.iters)
    return {name: statistics.median(t) for name, t in times.items()}


#: the expert shapes ``--grouped`` times: (name, experts, top_k, d_model, d_ff)
GROUPED_SHAPES = (("E=8 top-2", 8, 2, 128, 256), ("E=64 top-8 fine-grained", 64, 8, 128, 64))


def grouped_side_by_side(experts: int, top_k: int, d: int, f: int, tokens: int, iters: int) -> dict:
    """Seconds (median) of forward + backward of ``experts`` SwiGLU experts in each way of
    :data:`~parallel.layers.grouped_mm.KINDS` over one uneven routing, and the largest difference of
    output and gradients from the loop's (``max_abs_diff``)."""
    torch.manual_seed(0)
    layer = GroupedExperts(experts, d, f, activation="swiglu", bias=False)
    probs = torch.rand(experts, generator=torch.Generator().manual_seed(1)) + 0.2
    choice = torch.multinomial(probs, tokens * top_k, replacement=True, generator=torch.Generator().manual_seed(2))
    sizes = torch.bincount(choice, minlength=experts).tolist()
    x = torch.randn(tokens * top_k, d, requires_grad=True)
    g = torch.randn(tokens * top_k, d)

    def step(kind):
        x.grad = None
        layer.zero_grad()
        layer(x, sizes, kind).backward(g)
        return [t.clone() for t in (x.grad, *(p.grad for p in layer.parameters()))]

    want = step("loop")
    diff = max((a - b).abs().max().item() for kind in KINDS for a, b in zip(step(kind), want))
    times = time_alternating({kind: (lambda k=kind: step(k)) for kind in KINDS}, iters, barrier=False)
    return {"max_abs_diff": diff, "sizes": sizes, **{k: statistics.median(t) for k, t in times.items()}}


def main_grouped(args) -> None:
    torch.set_num_threads(1)
    print(f"GroupedExperts (SwiGLU) forward+backward, fp32, one thread, {args.tokens} tokens, median of {args.iters}")
    for name, E, k, d, f in GROUPED_SHAPES:
        r = grouped_side_by_side(E, k, d, f, args.tokens, args.iters)
        ways = "   ".join(f"{kind} {1e3 * r[kind]:7.1f} ms" for kind in KINDS)
        print(f"{name:24s} d {d} f {f}: {ways}   (segments {min(r['sizes'])}..{max(r['sizes'])}, "
              f"max |Δ| vs loop {r['max_abs_diff']:.1e})")  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--grouped", action="store_true", help="time the experts' grouped matmuls instead")
    args = p.parse_args(argv)
    if args.grouped:
        return main_grouped(args)
    print(f"tokens/rank {args.tokens}, d {args.d_model}, f {args.d_ff}, E {args.experts}, top-2, fwd+bwd")
    for ep in (1, 2, 4):
        per_rank = run_ranks(_rank, ep, args, timeout=600)
        ours = max(r["ours"] for r in per_rank)
        theirs = max(r["theirs"] for r in per_rank)
        name = "loop" if ep == 1 else "torch_a2a"
        print(
            f"ep={ep}: ours {1e3 * ours:7.1f} ms ({args.tokens / ours:8.0f} tok/s/rank)   "
            f"{name} {1e3 * theirs:7.1f} ms ({args.tokens / theirs:8.0f} tok/s/rank)   ratio {ours / theirs:.2f}"
        )


if __name__ == "__main__":
    main()
