"""Our 1F1B executor against ``torch.distributed.pipelining.Schedule1F1B``, and the bubble.

    python -m benchmarks.pipeline --pp 2 --m 8
    python -m benchmarks.pipeline --pp 4 --m 8 --png 1f1b.png
    python -m benchmarks.pipeline --zb --pp 2 --m 8     # zero-bubble ZB-H1 vs our 1F1B, 25.6 M GPT

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
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel import comm
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


# ------------------------------------------------------------- zero bubble vs 1F1B
def zb_recipe(pp: int, m: int, *, d: int = 512, n_layers: int = 8, seq: int = 256, micro_batch: int = 1):
    """The GPT the zero-bubble row trains: d 512, 8 layers, seq 256, vocab 256, untied
    head (25.6 M parameters at the defaults), ``m`` micro-batches per step, fp32, AdamW."""
    from .gpt import suite_recipe

    rc = suite_recipe(dp=1, pp=pp)
    rc.model.d_model, rc.model.n_layers, rc.model.n_heads, rc.model.seq_len = d, n_layers, max(1, d // 64), seq
    rc.train.micro_batch, rc.train.global_batch = micro_batch, micro_batch * m
    return rc


def _zb_rank(pp: int, m: int, steps: int, kwargs: dict):
    from parallel.groups import build_groups
    from parallel.memory import PeakSavedMeter
    from parallel.topology import Topology
    from recipes.training.gpt_engine import build_gpt_engine
    from recipes.validation import validate

    torch.set_num_threads(1)
    g = build_groups(Topology(1, pp, 1))
    engines, data = {}, None
    for schedule in ("1f1b", "zb-h1"):
        rc = zb_recipe(pp, m, **kwargs)
        rc.parallel.pp_schedule = schedule
        layout = validate(rc, world_size=pp)
        _, engine = build_gpt_engine(rc, layout, g, torch.device("cpu"), torch.float32)
        engine.executor.record_timeline = True
        engines[schedule] = engine
        if data is None:
            gen = torch.Generator().manual_seed(0)
            shape = (layout.micro_batch, layout.model.seq_len)
            data = [torch.randint(0, layout.model.vocab_size, shape, generator=gen) for _ in range(2 * m)]
    xs, ys = data[:m], data[m:]
    first, last = g.pp_rank == 0, g.pp_rank == pp - 1
    wall: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    timelines: dict[str, list[Span]] = {}
    peaks: dict[str, tuple[int, int]] = {}
    order = list(engines)
    for i in range(steps + 2):  # two warm-up rounds; alternate who goes first
        for name in order if i % 2 == 0 else order[::-1]:
            engine = engines[name]
            meter = PeakSavedMeter(engine.model.parameters())
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            with meter:
                engine.step(xs if first else None, ys if last else None)
            if i >= 2:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            ex = engine.executor
            timelines[name] = [
                Span(s.action, s.start + ex.timeline_origin, s.end + ex.timeline_origin) for s in ex.timeline
            ]
            peaks[name] = (meter.peak, ex.peak_activations)
    return wall, cpu, timelines, peaks


def zero_bubble(pp: int = 2, m: int = 8, steps: int = 5, png: str | None = None, **kwargs) -> dict:
    """ZB-H1 against our 1F1B on the same GPT in the same processes, alternating step by step:
    step wall time (slowest rank) and per-rank CPU time, the bubble measured from the recorded
    timelines and simulated, and the measured peak of saved activations per stage."""
    from parallel.pipeline.schedules import build_schedule
    from parallel.pipeline.simulator import simulate

    from .common import compare

    results = run_ranks(_zb_rank, pp, pp, m, steps, kwargs, timeout=1800)
    out: dict = dict(pp=pp, m=m, **kwargs)
    for name in ("1f1b", "zb-h1"):
        walls = [max(r[0][name][i] for r in results) for i in range(steps)]
        cpus = [sum(r[1][name][i] for r in results) for i in range(steps)]
        t0 = min(r[2][name][0].start for r in results)
        timeline = [[Span(s.action, s.start - t0, s.end - t0) for s in r[2][name]] for r in results]
        out[name] = dict(
            wall_s=statistics.median(walls),
            cpu_s=statistics.median(cpus),
            bubble_measured=bubble_fraction(timeline),
            bubble_simulated=simulate(build_schedule(name, pp, m)).bubble_fraction,
            peak_saved_bytes=[r[3][name][0] for r in results],
            peak_microbatches=[r[3][name][1] for r in results],
        )
        if png:
            draw_timeline(timeline, f"{png}-{name}.png", title=f"gridtrain {name}, pp={pp}, m={m} (measured)")
    zb_wall = [max(r[0]["zb-h1"][i] for r in results) for i in range(steps)]
    one_wall = [max(r[0]["1f1b"][i] for r in results) for i in range(steps)]
    out["zb_vs_1f1b_wall"] = compare(zb_wall, one_wall)
    a, b = out["zb-h1"], out["1f1b"]
    print(
        f"pp={pp} m={m}: step wall 1F1B {b['wall_s'] * 1e3:.0f} ms, ZB-H1 {a['wall_s'] * 1e3:.0f} ms "
        f"(CPU {b['cpu_s']:.2f} vs {a['cpu_s']:.2f} s, all ranks); bubble measured {b['bubble_measured']:.1%} → "
        f"{a['bubble_measured']:.1%} (simulated {b['bubble_simulated']:.1%} → {a['bubble_simulated']:.1%}); "
        f"peak saved MB per stage {[round(x / 2**20, 1) for x in b['peak_saved_bytes']]} → "
        f"{[round(x / 2**20, 1) for x in a['peak_saved_bytes']]}"
    )
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
    ap.add_argument("--zb", action="store_true", help="ZB-H1 vs our 1F1B on the 25.6 M GPT (d 512, 8 layers, seq 256)")
    a = ap.parse_args()
    if a.zb:
        zero_bubble(a.pp, a.m, a.steps, a.png)
    else:
        main(a.pp, a.m, a.layers, a.d, a.micro_batch, a.seq, a.steps, a.png)
