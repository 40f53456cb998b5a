"""Our 1F1B executor against ``torch.distributed.pipelining.Schedule1F1B``, and the bubble.

    python -m benchmarks.pipeline --pp 2 --m 8
    python -m benchmarks.pipeline --pp 4 --m 8 --png 1f1b.png

Both run the same model (input projection, ``--layers`` blocks of Linear + GELU
+ Linear, head, MSE loss), the same micro-batches, in the same gloo processes
(forked ranks, one thread each), alternating step by step; the step time is the
median over ``--steps`` steps (slowest rank) after two warm-up rounds. The measured bubble is
taken from our executor's recorded timeline (idle time between computations,
all stages on one clock) and compared with 1F1B's (p − 1)/(m + p − 1). On a
machine with fewer cores than ranks the stages share cores and both numbers
say more about the scheduler than the schedule.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.partition import partition_layers
from parallel.pipeline.schedules import one_f_one_b
from parallel.pipeline.simulator import Span
from parallel.pipeline.timeline import bubble_fraction, draw_timeline
from parallel.testing import run_ranks

from .common import time_alternating
from .theory import bubble_fraction as theory_bubble


def _stage(layers: range, n_layers: int, d: int, first: bool, last: bool) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n_layers)]
    mods = ([nn.Linear(d, d)] if first else []) + [blocks[i] for i in layers] + ([nn.Linear(d, d)] if last else [])
    return nn.Sequential(*mods)


def _rank(pp: int, m: int, n_layers: int, d: int, mbs: int, seq: int, steps: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = dist.get_rank()
    layers = partition_layers(n_layers, pp)[stage]
    first, last = stage == 0, stage == pp - 1
    torch.manual_seed(1)
    batch, target = torch.randn(m * mbs, seq, d), torch.randn(m * mbs, seq, d)
    group = dist.new_group(list(range(pp)), group_desc="pp")

    ours = _stage(layers, n_layers, d, first, last)
    ex = PipelineExecutor(
        [ours],
        one_f_one_b(pp, m)[stage],
        pp_group=group,
        activation_shape=(mbs, seq, d),
        dtype=torch.float32,
        loss_fn=F.mse_loss,
        record_timeline=True,
    )
    xs, ys = list(batch.chunk(m)), list(target.chunk(m))
    timelines = []

    def our_step():
        ours.zero_grad()
        ex.run(xs, ys)
        timelines.append(
            [Span(s.action, s.start + ex.timeline_origin, s.end + ex.timeline_origin) for s in ex.timeline]
        )

    theirs = _stage(layers, n_layers, d, first, last)
    pstage = PipelineStage(theirs, stage, pp, torch.device("cpu"), group=group)
    sched = Schedule1F1B(pstage, n_microbatches=m, loss_fn=F.mse_loss)

    def their_step():
        theirs.zero_grad()
        if first:
            sched.step(batch)
        elif last:
            sched.step(target=target, losses=[])
        else:
            sched.step()

    times = time_alternating({"ours": our_step, "torch": their_step}, steps)
    return times["ours"], times["torch"], timelines[-1]


def main(
    pp: int = 2,
    m: int = 8,
    n_layers: int = 8,
    d: int = 256,
    mbs: int = 4,
    seq: int = 64,
    steps: int = 10,
    png: str | None = None,
) -> dict:
    results = run_ranks(_rank, pp, pp, m, n_layers, d, mbs, seq, steps, timeout=600)
    ours = statistics.median(max(r[0][i] for r in results) for i in range(steps))
    theirs = statistics.median(max(r[1][i] for r in results) for i in range(steps))
    # per-round ratio (each round ran both back to back under the same load), then the median
    ratio = statistics.median(max(r[0][i] for r in results) / max(r[1][i] for r in results) for i in range(steps))
    t0 = min(r[2][0].start for r in results)
    timeline = [[Span(s.action, s.start - t0, s.end - t0) for s in r[2]] for r in results]
    measured = bubble_fraction(timeline)
    theory = theory_bubble(pp, m)  # one home: benchmarks.theory
    out = dict(pp=pp, m=m, ours_s=ours, torch_s=theirs, ratio=ratio, bubble_measured=measured, bubble_theory=theory)
    print(
        f"pp={pp} m={m} layers={n_layers} d={d} micro-batch={mbs}×{seq}: step ours {ours * 1e3:.0f} ms, "
        f"torch Schedule1F1B {theirs * 1e3:.0f} ms, median per-round ratio {ratio:.2f}; "
        f"bubble measured {measured:.1%} vs theory {theory:.1%}"
    )
    if png:
        draw_timeline(timeline, png, title=f"gridtrain 1F1B, pp={pp}, m={m} (measured)")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--png")
    a = ap.parse_args()
    main(a.pp, a.m, a.layers, a.d, a.micro_batch, a.seq, a.steps, a.png)
