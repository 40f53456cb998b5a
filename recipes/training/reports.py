"""The trainer's collective reports: the first step's memory table and a step's pipeline timeline.

Each is collective (every rank calls it, in the same order); rank 0 gets the result.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from parallel import comm
from parallel.memory import peak_memory_bytes
from parallel.pipeline import Span
from parallel.pipeline.schedules import Backward, Forward
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
        from ..tools.plan import plan_from_config

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


def timeline_step(trainer, step: int, path: str | Path, read: bool = True) -> dict:
    """Train ``step`` while recording every stage's actions; rank 0 draws ``path`` (PNG).
    ``read``: as :meth:`Trainer.train_step`'s (the loop's decision for this step, so that the
    step and :func:`time_report` agree on its kind).

    Collective. Stages start together (a host-synchronising barrier), so the per-rank
    clocks are aligned to within its skew. Returns the step's record with ``bubble``
    (measured, from the recorded timeline) added."""
    comm.barrier()  # host-synchronising: a queued all-reduce would not align the clocks on NCCL
    with trainer.engine.recording_timeline():
        rec = trainer.train_step(step, read=read)
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


def time_report(trainer, measured_s: float, read: bool = True) -> str | None:
    """Rank 0: the planner's step time for this layout beside the measured one, and its parts.

    ``measured_s``: this rank's wall time of one steady step (the device synchronised); ``read``:
    whether the trainer read that step (a logged step: the loss and norm scalars), so that it is
    compared with the planner's step of the same kind. Not collective.
    The parts say where a difference can come from: compute (matmuls, attention, elementwise work),
    the pipeline bubble, tensor-parallel collectives on the critical path, data-parallel traffic
    backward cannot hide, the optimizer step."""
    if trainer.rank != 0:
        return None
    if (gpu := gpu_profile_on_cpu(trainer.rc, trainer.device)) is not None:
        return (
            f"step time: measured {measured_s:.3f} s (no prediction: plan.hardware={gpu} is a GPU's profile and "
            f"this run is on the CPU; run mode=calibrate for a prediction, then plan.hardware=<its file>)"
        )
    try:
        from ..tools.plan import plan_from_config

        plan = plan_from_config(trainer.rc)
    except (ValueError, KeyError) as e:
        return f"step time: measured {measured_s:.3f} s (no prediction: {e})"
    return format_time_comparison(plan, measured_s, read)


def gpu_profile_on_cpu(rc, device: torch.device) -> str | None:
    """The stock GPU profile ``plan.hardware`` names when the run is on the CPU (None otherwise):
    a prediction for an A100 says nothing about this machine. A calibrated file, a profile of the
    user's own (``plan.profiles``) or the stock ``cpu`` profile is taken as meant."""
    from parallel.plan.hardware import ALIASES, PROFILES

    name = str(rc.plan.hardware).lower()
    name = ALIASES.get(name, name)
    if device.type != "cpu" or name in {k.lower() for k in (rc.plan.profiles or {})}:
        return None
    return rc.plan.hardware if name in PROFILES and PROFILES[name].name != "cpu" else None


def format_time_comparison(plan, measured_s: float, read: bool = True) -> str:
    """Predicted vs measured step time, the predicted parts and the part the gap is largest against.

    ``read``: the measured step was read (logged): compare with the planner's logged step
    (``step_time_s``), else with its unread step (``unread_step_time_s``, without the loss scalars
    and, unless clipping or fp16 computes it anyway, the gradient norm's)."""
    s = plan.step
    worst = max(plan.ranks, key=lambda r: r.compute_s)
    parts = {
        "compute": worst.compute_s,
        "pipeline bubble": s["pipeline_s"] * s["bubble_fraction"],
        "tp collectives": worst.traffic["tp"]["time_s"],
        "dp exposed": s["dp_exposed_s"],
        "optimizer": s.get("optimizer_s", 0.0),
        "step overhead": s.get("step_overhead_s", 0.0),
        "step scalars": s.get("scalars_s", 0.0),
    }
    predicted = s["step_time_s"] if read else s.get("unread_step_time_s", s["step_time_s"])
    kind = "logged step" if read else "unread step"
    gap = measured_s - predicted
    main = max(parts, key=parts.get)
    lines = [
        f"step time ({kind}): predicted {predicted:.3f} s, measured {measured_s:.3f} s "
        f"({measured_s / predicted - 1:+.0%}; hardware profile {plan.hardware['name']}; reading a step adds "
        f"{s.get('read_extra_s', 0.0) * 1e3:.2f} ms)",
        "  predicted parts: " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()),
    ]
    if abs(gap) > 0.2 * predicted:
        need = (parts[main] + gap) / parts[main] if parts[main] else float("inf")
        lines.append(
            f"  the gap is {gap:+.3f} s: {main} (the largest part) would have to be ×{need:.2f}; "
            f"mode=calibrate measures this machine (plan.hardware=<file>)"
        )
    return "\n".join(lines)


def cpu_wait_clock(rc):
    """:func:`runqueue_seconds` where the run plans with a calibrated CPU profile (one with host
    costs: the first-step report and ``benchmarks/plan.py`` compare the plan with a step less that
    wait), else None: a GPU run, or one planned on a stock profile, reads nothing from ``/proc``."""
    from parallel.plan import PlanError, hardware_profile

    try:
        profile = hardware_profile(rc.plan.hardware, dict(rc.plan.profiles or {}))
    except (PlanError, AttributeError):
        return None
    return runqueue_seconds if profile.host is not None else None


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


def _comm_seconds(summary: dict) -> dict[str, dict[str, float]]:
    """``{"<group> <op>": {"calls", "wait_s"}}`` of a :meth:`parallel.comm.CommCounter.summary`."""
    return {
        f"{g} {o}": {"calls": float(s["calls"]), "wait_s": float(s["wait_s"])}
        for g, ops in summary.items()
        for o, s in ops.items()
    }


def measured_parts(samples: list[dict]) -> dict:
    """The medians over timed steps of one rank's step parts (``benchmarks/plan.py --breakdown``).

    Each sample holds host seconds ``step_s`` (the trainer's step), ``runqueue_s`` (this thread's wait
    for a CPU meanwhile), ``run_s`` (the executor: forwards, backwards, transfers), ``optimizer_step_s``
    (ZeRO's step) and the counter summaries ``comm`` (the whole step) and ``comm_in_optimizer_step``.
    Returns ``step_s``, ``runqueue_s``, ``forward_backward_s`` (the executor), ``compute_s`` (the
    executor less the collectives blocked in it), ``optimizer_step_s``, ``optimizer_s`` (ZeRO's step
    less its collectives), ``rest_s`` (the step less the executor and ZeRO's step: the loss's
    broadcast and all-reduce, the loop) and ``comm``: per ``"<group> <op>"`` the calls issued and the seconds blocked
    per step, and of those the seconds blocked inside ZeRO's step (an asynchronous reduction launched
    in backward is waited for there). ``p2p`` (batched pipeline transfers) has blocked time only: its
    calls count as ``send`` and ``recv``."""
    if not samples:
        return {}
    med = statistics.median
    comm_all = [_comm_seconds(s["comm"]) for s in samples]
    comm_opt = [_comm_seconds(s["comm_in_optimizer_step"]) for s in samples]
    keys = sorted({k for c in comm_all for k in c})
    comm: dict[str, dict] = {}
    for k in keys:  # calls count where issued, blocked time where waited (an async handle's wait())
        calls = med(a.get(k, {}).get("calls", 0.0) for a in comm_all)
        wait = med(a.get(k, {}).get("wait_s", 0.0) for a in comm_all)
        in_opt = med(o.get(k, {}).get("wait_s", 0.0) for o in comm_opt)
        comm[k] = {"calls": calls, "wait_s": wait, "wait_in_optimizer_step_s": in_opt}
    in_run = [  # the executor's own waits when counted apart (the loss's reduction runs after it)
        sum(v["wait_s"] for v in _comm_seconds(s["comm_in_run"]).values())
        if "comm_in_run" in s
        else sum(v["wait_s"] for v in a.values()) - sum(v["wait_s"] for v in o.values())
        for s, a, o in zip(samples, comm_all, comm_opt)
    ]
    in_opt = [sum(v["wait_s"] for v in o.values()) for o in comm_opt]
    return {
        "step_s": med(s["step_s"] for s in samples),
        "runqueue_s": med(s["runqueue_s"] for s in samples),
        "forward_backward_s": med(s["run_s"] for s in samples),
        "compute_s": med(s["run_s"] - c for s, c in zip(samples, in_run)),
        "optimizer_step_s": med(s["optimizer_step_s"] for s in samples),
        "optimizer_s": med(s["optimizer_step_s"] - c for s, c in zip(samples, in_opt)),
        "rest_s": med(s["step_s"] - s["run_s"] - s["optimizer_step_s"] for s in samples),
        "comm": comm,
    }


def predicted_parts(plan, stage: int = 0) -> dict:
    """The planner's parts of one step for the ranks of pipeline ``stage`` (rank 0's: stage 0), in the
    categories :func:`measured_parts` measures: ``step_s``, ``compute_s`` (matmuls, attention,
    elementwise and fixed host costs of all micro-batches, without communication), ``pipeline_s``
    (the schedule's makespan: compute, TP collectives, p2p, bubble), ``bubble_s``, ``dp_exposed_s``,
    ``optimizer_s`` and ``step_overhead_s``; and ``comm``: per ``"<axis> <kind>"`` the calls and
    seconds the planner gives every such collective of the step (exposed or not)."""
    s, r = plan.step, plan.ranks[stage]
    comm = {
        f"{axis} {kind}": {"calls": v["calls"], "seconds": v["seconds"]}
        for axis, t in r.traffic.items()
        for kind, v in t.get("by_kind", {}).items()
    }
    return {
        "step_s": s["step_time_s"],
        "compute_s": r.compute_s,
        "pipeline_s": s["pipeline_s"],
        "bubble_s": s["pipeline_s"] * s["bubble_fraction"],
        "dp_exposed_s": s["dp_exposed_s"],
        "optimizer_s": s.get("optimizer_s", 0.0),
        "step_overhead_s": s.get("step_overhead_s", 0.0),
        "scalars_s": s.get("scalars_s", 0.0),
        "comm": comm,
    }


def format_breakdown(name: str, measured: dict, predicted: dict) -> str:
    """A text table of one rank's measured parts (medians over steady steps) beside the planner's."""
    ms = lambda x: f"{x * 1e3:8.2f}"  # noqa: E731
    lines = [
        f"{name}: measured (median of steady steps) against predicted, ms",
        f"  step               {ms(measured['step_s'])} (cpu wait {ms(measured['runqueue_s'])})  "
        f"predicted {ms(predicted['step_s'])}",
        f"  forward+backward   {ms(measured['forward_backward_s'])}   predicted pipeline {ms(predicted['pipeline_s'])}"
        f" (bubble {ms(predicted['bubble_s'])})",
        f"    compute          {ms(measured['compute_s'])}   predicted {ms(predicted['compute_s'])}",
        f"  optimizer step     {ms(measured['optimizer_step_s'])}   predicted optimizer {ms(predicted['optimizer_s'])}"
        f" + overhead {ms(predicted['step_overhead_s'])} + dp exposed {ms(predicted['dp_exposed_s'])}"
        f" + tp/pp/embedding scalars {ms(predicted.get('scalars_s', 0.0))}",
        f"    without comm     {ms(measured['optimizer_s'])}",
        f"  rest               {ms(measured['rest_s'])}",
        "  collectives measured (blocked ms, calls):",
    ]
    for k, v in measured["comm"].items():
        per = f"{v['wait_s'] / v['calls'] * 1e6:7.0f} µs/call" if v["calls"] else " " * 15
        lines.append(
            f"    {k:<36} {ms(v['wait_s'])} {v['calls']:5.0f}  {per}  (in ZeRO's step {ms(v['wait_in_optimizer_step_s'])})"
        )
    lines.append("  collectives predicted (ms, calls):")
    for k, v in predicted["comm"].items():
        per = v["seconds"] / v["calls"] * 1e6 if v["calls"] else 0.0
        lines.append(f"    {k:<36} {ms(v['seconds'])} {v['calls']:5.0f}  {per:7.0f} µs/call")
    return "\n".join(lines)
