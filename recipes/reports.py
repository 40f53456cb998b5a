"""The trainer's collective reports: the first step's memory table and a step's pipeline timeline.

Each is collective (every rank calls it, in the same order); rank 0 gets the result.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from parallel import comm
from parallel.memory import peak_memory_bytes
from parallel.pipeline.schedules import Backward, Forward
from parallel.pipeline.simulator import Span
from parallel.pipeline.timeline import bubble_fraction, draw_timeline


def memory_report(trainer) -> str | None:
    """Rank 0: a table of what each rank class (pipeline stage) holds after the first step.

    Collective: one all-gather of five numbers per rank."""
    engine, topo = trainer.engine, trainer.topology
    ms = engine.model_state_bytes
    mine = torch.tensor(
        [ms["params"], ms["grads"], ms["optimizer"], engine.activation_bytes, peak_memory_bytes(trainer.device)],
        dtype=torch.float64,
        device=trainer.device,
    )
    world = topo.world_size
    every = torch.empty(world * 5, dtype=torch.float64, device=trainer.device)
    comm.all_gather(every, mine)
    if trainer.rank != 0:
        return None
    every = every.view(world, 5).cpu()
    try:  # the planner's figures for this very layout, beside the measured ones
        from .plan import plan_from_config

        plan = plan_from_config(trainer.rc)
        predicted = [r.memory["model_states"] + r.memory["activations"] for r in plan.ranks]
    except (ValueError, KeyError):
        predicted = None
    mb = 2**20
    lines = [
        "memory per rank after the first step (MiB; max over each stage's ranks)",
        f"{'stage':>5} {'ranks':>6} {'params':>9} {'grads':>9} {'optimizer':>9} "
        f"{'activations':>11} {'model+act':>9} {'predicted':>9} {'peak (process)':>14}",
    ]
    for stage in range(topo.pp):
        ranks = [r for r in range(world) if topo.coords(r).pp == stage]
        top = every[ranks].max(dim=0).values / mb
        pred = f"{predicted[stage] / mb:>9.1f}" if predicted else f"{'-':>9}"
        lines.append(
            f"{stage:>5} {len(ranks):>6} {top[0]:>9.1f} {top[1]:>9.1f} {top[2]:>9.1f} "
            f"{top[3]:>11.1f} {top[:4].sum():>9.1f} {pred} {top[4]:>14.1f}"
        )
    return "\n".join(lines)


def gather_timeline(spans: list[Span], topology, device: torch.device) -> list[list[Span]]:
    """Every pipeline stage's recorded spans (DP 0, TP 0 of each stage), on every rank.

    Collective over the world: one all-reduce (the widest list) and one all-gather."""
    kinds = {Forward: 0, Backward: 1}
    rows = [
        [sp.start, sp.end, kinds.get(type(sp.action), 2), getattr(sp.action, "mb", -1), getattr(sp.action, "chunk", -1)]
        for sp in spans
    ]
    n = torch.tensor([len(rows)], dtype=torch.float64, device=device)
    comm.all_reduce(n, op=comm.ReduceOp.MAX)
    width = int(n.item())
    mine = torch.full((width, 5), -1.0, dtype=torch.float64, device=device)
    if rows:
        mine[: len(rows)] = torch.tensor(rows, dtype=torch.float64)
    every = torch.empty(topology.world_size * width * 5, dtype=torch.float64, device=device)
    comm.all_gather(every, mine.view(-1))
    every = every.view(topology.world_size, width, 5).cpu()
    timeline = []
    for stage in range(topology.pp):
        stage_spans = []
        for start, end, kind, mb, chunk in every[topology.rank(dp=0, pp=stage, tp=0)].tolist():
            if kind < 0:
                continue
            action = (Forward, Backward)[int(kind)](int(mb), int(chunk)) if kind < 2 else ()
            stage_spans.append(Span(action, start, end))
        timeline.append(stage_spans)
    return timeline


def timeline_step(trainer, step: int, path: str | Path) -> dict:
    """Train ``step`` while recording every stage's actions; rank 0 draws ``path`` (PNG).

    Collective. Stages start together (a host-synchronising barrier), so the per-rank
    clocks are aligned to within its skew. Returns the step's record with ``bubble``
    (measured, from the recorded timeline) added."""
    comm.barrier()  # host-synchronising: a queued all-reduce would not align the clocks on NCCL
    with trainer.engine.recording_timeline():
        rec = trainer.train_step(step)
    timeline = gather_timeline(trainer.engine.timeline, trainer.topology, trainer.device)
    rec["bubble"] = bubble_fraction(timeline)
    if trainer.rank == 0:
        p = trainer.rc.parallel
        draw_timeline(
            timeline,
            path,
            title=f"step {step + 1}: {p.pp_schedule}, pp={p.pp}, m={trainer.layout.grad_accum}, vpp={p.vpp}",
        )
    return rec


def time_report(trainer, measured_s: float) -> str | None:
    """Rank 0: the planner's step time for this layout beside the measured one, and its parts.

    ``measured_s``: this rank's wall time of one steady step (the device synchronised). Not collective.
    The parts say where a difference can come from: compute (matmuls, attention, elementwise work),
    the pipeline bubble, tensor-parallel collectives on the critical path, data-parallel traffic
    backward cannot hide, the optimizer step."""
    if trainer.rank != 0:
        return None
    try:
        from .plan import plan_from_config

        plan = plan_from_config(trainer.rc)
    except (ValueError, KeyError) as e:
        return f"step time: measured {measured_s:.3f} s (no prediction: {e})"
    return format_time_comparison(plan, measured_s)


def format_time_comparison(plan, measured_s: float) -> str:
    """Predicted vs measured step time, the predicted parts and the part the gap is largest against."""
    s = plan.step
    worst = max(plan.ranks, key=lambda r: r.compute_s)
    parts = {
        "compute": worst.compute_s,
        "pipeline bubble": s["pipeline_s"] * s["bubble_fraction"],
        "tp collectives": worst.traffic["tp"]["time_s"],
        "dp exposed": s["dp_exposed_s"],
        "optimizer": s.get("optimizer_s", 0.0),
        "step overhead": s.get("step_overhead_s", 0.0),
    }
    predicted = s["step_time_s"]
    gap = measured_s - predicted
    main = max(parts, key=parts.get)
    lines = [
        f"step time: predicted {predicted:.3f} s, measured {measured_s:.3f} s ({measured_s / predicted - 1:+.0%}; "
        f"hardware profile {plan.hardware['name']})",
        "  predicted parts: " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()),
    ]
    if abs(gap) > 0.2 * predicted:
        need = (parts[main] + gap) / parts[main] if parts[main] else float("inf")
        lines.append(
            f"  the gap is {gap:+.3f} s: {main} (the largest part) would have to be ×{need:.2f}; "
            f"mode=calibrate measures this machine (plan.hardware=<file>)"
        )
    return "\n".join(lines)


def runqueue_seconds() -> float:
    """Seconds this process's main thread has waited, runnable, for a CPU (Linux's
    ``/proc/<pid>/task/<pid>/schedstat``, second field); 0.0 where the kernel does not say.

    On a machine shared with other work, a step's wall time minus the growth of this is the time
    the step would have taken with a core to itself (``benchmarks/plan.py`` compares that with the
    planner); waits for other ranks stay in it, and so do waits of gloo's worker threads, which run
    the collectives (summing those too subtracts reductions that overlap compute: measured, ZeRO
    steps came out negative)."""
    pid = os.getpid()
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0
