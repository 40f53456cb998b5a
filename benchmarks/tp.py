"""Forward+backward time of a GPT block: gridtrain's TP vs PyTorch's own tensor parallelism.

    python -m benchmarks.tp [--d-model 256] [--seq 128] [--batch 4] [--iters 20]

Prints, on the same CPU run (gloo, one thread per rank):

* TP=2: ``models.TransformerBlock`` on a TP group vs the same plain PyTorch block
  parallelised with ``torch.distributed.tensor.parallel`` (q/k/v/fc_in
  ``ColwiseParallel``, o/fc_out ``RowwiseParallel``): times and their ratio;
* TP=1: ``models.TransformerBlock`` without a group vs the plain block (our overhead).

Not a test: timings on a shared 2-core machine are noisy; the median of ``iters``
timed steps after ``warmup`` is reported, the two contenders alternating step by step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models import ModelConfig
from models.transformer import TransformerBlock
from parallel.params import tp_shard_dim
from parallel.testing import run_ranks


class PlainBlock(nn.Module):
    """A GPT-2 block in plain PyTorch (the reference and the DTensor-parallelised model)."""

    def __init__(self, d: int, n_heads: int, d_ff: int):
        super().__init__()
        self.head_dim = d // n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc_in, self.fc_out = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (t(h).view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(a)
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x)), approximate="tanh"))


NAMES = {
    "attn_norm": "ln_1",
    "mlp_norm": "ln_2",
    "attn.q_proj": "q",
    "attn.k_proj": "k",
    "attn.v_proj": "v",
    "attn.o_proj": "o",
    "mlp.fc_in": "fc_in",
    "mlp.fc_out": "fc_out",
}


def copy_weights(ours: TransformerBlock, plain: PlainBlock, group=None) -> None:
    """Give ``ours`` (possibly TP-sharded) the plain block's weights, so both compute the same."""
    from parallel import comm

    theirs = dict(plain.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            prefix, leaf = name.rsplit(".", 1)
            full = theirs[f"{NAMES[prefix]}.{leaf}"]
            dim = tp_shard_dim(p)
            p.copy_(full if dim is None else comm.split_along(full, dim, group))


def _time_pair(a, b, x, warmup, iters):
    """Median fwd+bwd seconds of blocks ``a`` and ``b``, alternating step by step so that
    the (shared, noisy) machine's load falls on both alike."""
    times = ([], [])
    for i in range(warmup + iters):
        for block, out in zip((a, b), times):
            t0 = time.perf_counter()
            block(x).sum().backward()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def _tp2(cfg, batch, warmup, iters):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, requires_grad=True)
    group = dist.new_group([0, 1], group_desc="tp")
    ours, plain = TransformerBlock(cfg, tp_group=group), PlainBlock(cfg.d_model, cfg.n_heads, cfg.d_ff)
    copy_weights(ours, plain, group)
    mesh = init_device_mesh("cpu", (2,))
    plan = {n: ColwiseParallel() for n in ("q", "k", "v", "fc_in")}
    plan.update({n: RowwiseParallel() for n in ("o", "fc_out")})
    theirs = parallelize_module(plain, mesh, plan)
    t_ours, t_theirs = _time_pair(ours, theirs, x, warmup, iters)
    return {"ours": t_ours, "dtensor": t_theirs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args(argv)
    cfg = ModelConfig(arch="gpt", n_layers=1, d_model=a.d_model, n_heads=a.heads, seq_len=a.seq)
    tp2 = run_ranks(_tp2, 2, cfg, a.batch, a.warmup, a.iters, timeout=600)[0]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(a.batch, a.seq, a.d_model, requires_grad=True)
    ours1, plain1 = TransformerBlock(cfg), PlainBlock(cfg.d_model, cfg.n_heads, cfg.d_ff)
    copy_weights(ours1, plain1)
    t_ours1, t_plain1 = _time_pair(ours1, plain1, x, a.warmup, a.iters)
    print(f"GPT block d_model={a.d_model} heads={a.heads} seq={a.seq} batch={a.batch}, fwd+bwd, median ms")
    print(
        f"TP=2  gridtrain {tp2['ours'] * 1e3:8.2f}   torch tensor.parallel {tp2['dtensor'] * 1e3:8.2f}"
        f"   ratio ours/torch {tp2['ours'] / tp2['dtensor']:.2f}"
    )
    print(
        f"TP=1  gridtrain {t_ours1 * 1e3:8.2f}   plain PyTorch block   {t_plain1 * 1e3:8.2f}"
        f"   ratio ours/plain {t_ours1 / t_plain1:.2f}"
    )


if __name__ == "__main__":
    main()
