"""Context parallelism: gridtrain's ring attention against torch, and tokens/s as the sequence grows.

    python -m benchmarks.cp [--cp 2] [--seq 4096] [--iters 6] [--lengths 1024,2048,4096] [--json out.json]

1. **Attention, side by side** (one attention core, fp32, gloo, one thread per rank):
   ``parallel.layers.ring_attention`` against (a) torch's own
   ``torch.distributed.tensor.experimental.context_parallel`` if it runs here — on
   CPU it does not (torch 2.13: ``aten._scaled_dot_product_flash_attention_for_cpu``
   has no sharding strategy; the refusal is printed) — and (b) the contender the
   issue names for that case: K and V all-gathered with torch's collectives
   (``all_gather_single`` forward, ``reduce_scatter_single`` backward), then SDPA of
   the local queries against the whole sequence under the load-balanced causal mask.
   Reported: step (forward + backward) time ratio ours/theirs (median of alternating
   rounds, slowest rank), bytes each rank sends (both counted by
   :class:`parallel.comm.CommCounter`), saved activation bytes
   (:class:`parallel.memory.SavedActivationMeter`).
2. **Sequence sweep**: a small Llama (forward + backward, no optimizer) at each length
   with cp = 1, 2, 4: tokens/s and saved activation bytes per rank (which fall as 1/cp),
   beside the planner's prediction for the same model.

Not a test: timings on a shared 2-core machine are noisy and cp = 4 oversubscribes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import compare, counting_torch, slowest_rank, time_alternating
from models import ModelConfig, build_model
from parallel import comm
from parallel.layers import cp_positions, cp_slice, ring_attention
from parallel.memory import SavedActivationMeter
from parallel.testing import run_ranks


def _torch_op(new: str, old: str):
    """torch's tensor collective by its 2.13 name (looked up at call time: the byte counter wraps it)."""
    return getattr(dist, new, None) or getattr(dist, old)


class _GatherKV(torch.autograd.Function):
    """All-gather along dim 0 with torch's collective (``[cp·n, ...]``); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _torch_op("all_gather_single", "all_gather_into_tensor")(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _torch_op("reduce_scatter_single", "reduce_scatter_tensor")(out, grad.contiguous(), group=ctx.group)
        return out, None


def allgather_kv_attention(q, k, v, group):
    """The contender: gather K/V (one collective for both), causal SDPA of local queries over all keys."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    s_local = q.shape[2]
    kv = _GatherKV.apply(torch.stack([k, v]), group).unflatten(0, (cp, 2))  # [cp, 2, b, h, s/cp, d], rank order
    k_all, v_all = (kv[:, i].permute(1, 2, 0, 3, 4).flatten(2, 3) for i in (0, 1))
    pos_k = torch.cat([cp_positions(s_local * cp, cp, j) for j in range(cp)])
    mask = cp_positions(s_local * cp, cp, r)[:, None] >= pos_k[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def torch_context_parallel_runs() -> str:
    """``"ok"`` if torch's context_parallel runs a causal SDPA forward + backward here, else its error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (torch.randn(1, 2, 8 * dist.get_world_size(), 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        while e.__context__ is not None:  # the first error, not the clean-up's
            e = e.__context__
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _attention_rank(seq: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> dict:
    cp, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)), group_desc="cp")
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, seq, head_dim, generator=g) for n in (heads, kv_heads, kv_heads)]
    local = [cp_slice(t, cp, r, dim=2).requires_grad_() for t in full]
    fns = {"ours": lambda: ring_attention(*local, group), "theirs": lambda: allgather_kv_attention(*local, group)}
    out = {"torch_context_parallel": torch_context_parallel_runs()}
    for name, fn in fns.items():  # bytes and saved activations of one step each
        counter, meter = comm.CommCounter(), SavedActivationMeter([])
        with counting_torch(counter):
            with meter:
                y = fn()
            y.sum().backward()
        out[f"{name}_sent"], out[f"{name}_saved"] = counter.sent_bytes("cp"), meter.bytes
    ref = allgather_kv_attention(*local, group).detach()
    out["max_diff"] = (ring_attention(*local, group).detach() - ref).abs().max().item()
    steps = {name: (lambda fn=fn: fn().sum().backward()) for name, fn in fns.items()}
    out["times"] = time_alternating(steps, iters, warmup=1)
    return out


def attention_side_by_side(cp: int, seq: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> dict:
    per_rank = run_ranks(_attention_rank, cp, seq, heads, kv_heads, head_dim, iters, timeout=900)
    times = {n: slowest_rank([r["times"][n] for r in per_rank]) for n in ("ours", "theirs")}
    r0 = per_rank[0]
    return {
        "cp": cp,
        "seq": seq,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "torch_context_parallel": r0["torch_context_parallel"],
        "max_abs_diff": max(r["max_diff"] for r in per_rank),
        **compare(times["ours"], times["theirs"]),
        "ours_sent_bytes": r0["ours_sent"],
        "theirs_sent_bytes": r0["theirs_sent"],
        "ours_saved_bytes": r0["ours_saved"],
        "theirs_saved_bytes": r0["theirs_saved"],
    }


def sweep_model(seq: int) -> ModelConfig:
    """The small Llama of the sweep (2 layers, d 64, GQA 4/2, byte vocabulary)."""
    return ModelConfig(
        arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=172, vocab_size=256, seq_len=seq
    )


def _sweep_rank(seq: int, iters: int) -> dict:
    cp, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)), group_desc="cp") if cp > 1 else None
    model = build_model(sweep_model(seq), cp_group=group, seed=0)
    ids = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = cp_slice(ids[:, :-1], cp, r), cp_slice(ids[:, 1:], cp, r)
    meter = SavedActivationMeter(model.parameters())
    with meter:
        loss = model.loss(model(x), y)
    loss.backward()
    times = []
    for _ in range(iters):
        if cp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        model.loss(model(x), y).backward()
        times.append(time.perf_counter() - t0)
    return {"saved": meter.bytes, "times": times}


def sequence_sweep(lengths: list[int], cps: list[int], iters: int) -> list[dict]:
    from parallel.plan.cp import local_shape
    from parallel.plan.memory import stage_activation_bytes
    from parallel.plan.shape import ModelShape

    rows = []
    for seq in lengths:
        for cp in cps:
            per_rank = run_ranks(_sweep_rank, cp, seq, iters, timeout=900)
            step = statistics.median(slowest_rank([r["times"] for r in per_rank]))
            shape = local_shape(ModelShape.of(sweep_model(seq)), cp)
            planned = stage_activation_bytes(shape, 1, 2, has_embedding=True, has_head=True, precision="fp32")
            rows.append(
                {
                    "seq": seq,
                    "cp": cp,
                    "step_s": step,
                    "tokens_per_s": seq / step,
                    "saved_bytes_per_rank": per_rank[0]["saved"],
                    "planned_bytes_per_rank": planned,
                }
            )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    side = attention_side_by_side(a.cp, a.seq, a.heads, a.kv_heads, a.head_dim, a.iters)
    print(f"torch context_parallel on this machine: {side['torch_context_parallel']}")
    print(
        f"attention cp={a.cp} seq={a.seq} heads={a.heads}/{a.kv_heads} hd={a.head_dim}: ring {side['ours_ms']:.1f} ms, "
        f"all-gather K/V {side['theirs_ms']:.1f} ms, ratio {side['ratio']:.2f} "
        f"[{side['ratio_lo']:.2f}, {side['ratio_hi']:.2f}]; sent/rank {side['ours_sent_bytes'] / 2**20:.2f} vs "
        f"{side['theirs_sent_bytes'] / 2**20:.2f} MiB; saved {side['ours_saved_bytes'] / 2**20:.2f} vs "
        f"{side['theirs_saved_bytes'] / 2**20:.2f} MiB; max |diff| {side['max_abs_diff']:.1e}"
    )
    rows = sequence_sweep([int(s) for s in a.lengths.split(",")], [int(c) for c in a.cps.split(",")], a.iters)
    print(f"{'seq':>6} {'cp':>3} {'step s':>8} {'tokens/s':>9} {'saved MiB/rank':>15} {'planned':>9}")
    for row in rows:
        print(
            f"{row['seq']:>6} {row['cp']:>3} {row['step_s']:>8.3f} {row['tokens_per_s']:>9.0f} "
            f"{row['saved_bytes_per_rank'] / 2**20:>15.2f} {row['planned_bytes_per_rank'] / 2**20:>9.2f}"
        )
    result = {"attention": side, "sweep": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
