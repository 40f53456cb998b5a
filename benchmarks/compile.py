"""``train.compile``: our step compiled vs eager, and vs plain PyTorch's GPT under ``torch.compile``.

    python -m benchmarks.compile [--sizes small medium large] [--steps 6] [--backend inductor] [--dp]

Single process, per suite size (:data:`benchmarks.gpt.SIZES`): four contenders alternating step by
step (:func:`benchmarks.common.time_alternating`): ours eager, ours with ``train.compile=true``
(each block and the loss compiled), plain PyTorch's same GPT eager and under ``torch.compile`` (the
whole model), all with the same fused AdamW and the same tokens. ``--dp``: also dp=2 ZeRO-1
compiled vs DDP over the compiled plain model. Compilation happens in the warm-up rounds; the
medians are of the steps after it, wall and CPU seconds (CPU time is what other processes on a
shared machine do not inflate). Not a test: the numbers go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics

from parallel.testing import run_ranks

from .common import time_alternating
from .contenders import Ours, Theirs
from .gpt import SIZES, suite_recipe


def _rank(size: str, steps: int, warmup: int, backend: str, dp: int) -> dict:
    eager = suite_recipe(dp=dp, zero=1 if dp > 1 else 0, size=size)
    compiled = suite_recipe(dp=dp, zero=1 if dp > 1 else 0, size=size)
    compiled.train.compile, compiled.train.compile_backend = True, backend
    ours, ours_c = Ours(eager), Ours(compiled)
    kinds = ("ddp", "ddp_compiled") if dp > 1 else ("plain", "plain_compiled")
    theirs, theirs_c = Theirs(kinds[0], ours), Theirs(kinds[1], ours)
    contenders = {"ours eager": ours, "ours compiled": ours_c, "torch eager": theirs, "torch compiled": theirs_c}
    cpu: dict[str, list[float]] = {}
    wall = time_alternating({k: c.step for k, c in contenders.items()}, steps, warmup, cpu=cpu)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in contenders}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dp", action="store_true", help="also dp=2 ZeRO-1 compiled vs DDP + compile")
    a = ap.parse_args(argv)
    rows = {}
    for size in a.sizes:
        for dp in (1, 2) if a.dp else (1,):
            per_rank = run_ranks(_rank, dp, size, a.steps, a.warmup, a.backend, dp, timeout=3600)
            r = {k: max(rank[k][0] for rank in per_rank) for k in per_rank[0]}  # the slowest rank's wall
            c = {k: max(rank[k][1] for rank in per_rank) for k in per_rank[0]}
            name = f"{size} dp={dp}"
            rows[name] = r
            print(
                f"{name}: wall s/step "
                + ", ".join(f"{k} {v:.3f}" for k, v in r.items())
                + f" | compiled/eager ours {r['ours compiled'] / r['ours eager']:.3f} (cpu "
                f"{c['ours compiled'] / c['ours eager']:.3f}), torch {r['torch compiled'] / r['torch eager']:.3f}"
                f" | ours compiled/torch compiled {r['ours compiled'] / r['torch compiled']:.3f} "
                f"(cpu {c['ours compiled'] / c['torch compiled']:.3f})",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
