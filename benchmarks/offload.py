"""The cost of ZeRO-Offload's machinery on this CPU, and the host AdamW rate the planner uses.

    python -m benchmarks.offload [--ranks 2] [--d 384] [--blocks 4] [--steps 20] [--precision bf16]

Same model (pre-norm residual MLP blocks), data and optimizer (torch's fused AdamW on both
sides, so only the offload path differs), CPU ranks over gloo, one thread each. On a CPU
"device" and "host" are the same memory, so the ratio measures the overhead of the path
itself: the separate host master and gradient buffers, the per-bucket copies out, the copy
of the updated parameters back, stage 3's paging of parameter shards — not PCIe time.

Also measures ``AdamW(fused=True)`` on one core over 8 M fp32 elements: the per-core rate
quoted in ``docs/performance.md`` ("The host AdamW rate").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel

CASES = [(1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"),
         (3, "optimizer+params")]  # fmt: skip


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _rank(args) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    engines, times = {}, {}
    for stage, offload in CASES:
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(args.d) for _ in range(args.blocks)])
        engines[f"zero{stage} {offload}"] = ZeroDataParallel(
            model,
            ZeroConfig(stage=stage, precision=args.precision, offload=offload, bucket_mb=4),
            dp_group=dist.group.WORLD,
            units=list(model),
            optimizer_factory=lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True),
        )
    x = torch.randn(args.batch, args.d)
    for i in range(args.steps):  # interleaved: a shared machine's load falls on every case alike
        for key, zdp in engines.items():
            dist.barrier()
            t = time.perf_counter()
            zdp.backward(zdp(x).float().pow(2).mean())
            zdp.step()
            if i >= 2:
                times.setdefault(key, []).append(time.perf_counter() - t)
    return {key: statistics.median(ts) * 1e3 for key, ts in times.items()}


def fused_adamw_rate(n: int = 8_000_000, repeats: int = 5) -> float:
    """Elements per second of ``AdamW(fused=True)`` on one core."""
    torch.set_num_threads(1)
    p = nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], fused=True)
    opt.step()
    t = time.perf_counter()
    for _ in range(repeats):
        opt.step()
    return n * repeats / (time.perf_counter() - t)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args(argv)
    per_rank = run_ranks(_rank, args.ranks, args, timeout=600)
    params = args.blocks * (8 * args.d * args.d + 7 * args.d)
    print(f"{params / 1e6:.1f} M parameters, {args.ranks} ranks, {args.precision}; median step ms (max over ranks)")
    base = {}
    for key in per_rank[0]:
        ms = max(r[key] for r in per_rank)
        stage, offload = key.split(" ")
        base.setdefault(stage, ms) if offload == "none" else None
        print(f"  {key:<26} {ms:8.1f} ms   × {ms / base[stage]:.2f} of {stage} none")
    print(f"fused CPU AdamW, one core: {fused_adamw_rate() / 1e9:.2f} G elements/s")


if __name__ == "__main__":
    main()
