"""A step's makespan, bubble and in-flight activations from one chunk's costs: every schedule's
closed form (equal to :mod:`parallel.pipeline.simulator`, which stays their test oracle); the p2p messages' cost."""

from __future__ import annotations

from functools import lru_cache

from ..overlap import PIPELINE_P2P
from ..pipeline.schedules import BackwardInput, BackwardWeight, Forward, schedule_problem, zb_h1
from .hardware import PlanError, host_costs


def zb_h1_paths(pp: int, m: int) -> list[tuple[int, int, int]]:
    """The critical paths of ZB-H1 (:func:`parallel.pipeline.schedules.zb_h1`) under the simulator, as
    (forwards, half-backwards, transfers) on the path; the makespan is the longest, ``max(a·F + b·B + c·p)``
    with B = W = half a backward (the simulator's default split) and ``p`` one transfer, pp ≥ 2.

    With m ≥ pp: the first stage's (its first B waits for the round trip, then it never idles), the last
    stage's (it starts after pp − 1 forwards and transfers, then never idles) and one between; with no
    transfer cost that is ``m·(F + B + W) + (pp − 1)·max(F, B)``: Qi et al.'s ``(pp − 1)(F + B − W)``
    bubble while F ≥ B. Fewer micro-batches: the fill-and-drain path, and two more once 2m > pp.
    Found by timing the simulator over costs carried symbolically; held against it in
    ``tests/parallel/plan/test_pipeline_closed_form.py``."""
    if m >= pp:
        hops = m + 1 if pp == 2 else 2 * m + 2 * pp - 5
        first = m + 1 if pp == 2 else 2 * m + pp - 3
        return [(m, 2 * m + pp - 1, first), (m + pp - 2, 2 * m + 1, hops), (m + pp - 1, 2 * m, hops)]
    out = [(m + pp - 1, min(2 * m + pp - 1, 2 * pp - 1), max(2 * m + 2 * pp - 5, 2 * pp - 2))]
    if 2 * m > pp:
        out += [(2 * pp - m - 1, 2 * m + pp - 1, 3 * pp - 4), (m + pp - 2, 2 * pp, 2 * m + 2 * pp - 5)]
    return out


def closed_form(schedule: str, pp: int, m: int, vpp: int, fwd: float, bwd: float, p2p: float):
    """The simulator's (makespan, peak in-flight per stage) of a schedule of
    :data:`parallel.pipeline.schedules.SCHEDULES` in closed form, or None for another name. ``fwd``/``bwd`` are
    one chunk's costs, ``p2p`` one rendezvous transfer (it delays both ends); ZB-H1 splits ``bwd`` in halves
    (:func:`zb_h1_paths`). ``tests/parallel/plan/test_pipeline_closed_form.py`` holds each against the simulator."""
    if pp == 1:
        return m * vpp * (fwd + bwd), (m * vpp if schedule == "gpipe" else 1,)
    if schedule == "gpipe":
        return (m + pp - 1) * (fwd + bwd) + 2 * (m + pp - 2) * p2p, (m,) * pp
    if schedule == "1f1b":
        hops = m + 1 if pp == 2 else 2 * (pp - 1) + max(0, 2 * m - 3)
        return (m + pp - 1) * (fwd + bwd) + hops * p2p, tuple(min(pp - s, m) for s in range(pp))
    if schedule == "interleaved":
        total = m * vpp
        span = (total + pp - 1) * (fwd + bwd) + ((vpp + 1) * pp + vpp * m - 3) * p2p
        peaks = tuple(min(min(2 * (pp - s - 1) + (vpp - 1) * pp, total) + 1, total) for s in range(pp))
        return span, peaks
    if schedule == "zb-h1":  # every stage stores min(pp, m): the postponed W passes keep the first stage's peak
        span = max(a * fwd + b * bwd / 2 + c * p2p for a, b, c in zb_h1_paths(pp, m))
        return span, (min(pp, m),) * pp
    return None


@lru_cache(maxsize=256)
def zb_h1_holds(pp: int, m: int) -> tuple[tuple[tuple[int, int, bool], ...], ...]:
    """Per stage of ZB-H1 (:func:`parallel.pipeline.schedules.zb_h1`), the micro-batches it holds when a
    B or a W starts, as ``(stored, deferred, in B)``: stored ones have run F (the one in B among them),
    deferred ones B but not W (the one in W among them); only the pairs no other of the same kind
    exceeds in both. Read off the schedule's own action list, so it holds for any ``pp`` and ``m``
    (with m ≥ pp: ``(pp − s, s)`` at a B and ``(pp − s − 1, s + 1)`` at a W)."""
    out = []
    for actions in zb_h1(pp, m):
        stored, deferred, seen = set(), set(), set()
        for a in actions:
            if isinstance(a, Forward):
                stored.add(a.mb)
            elif isinstance(a, (BackwardInput, BackwardWeight)):
                during_b = isinstance(a, BackwardInput)
                seen.add((len(stored), len(deferred), during_b))
                (stored if during_b else deferred).discard(a.mb)
                if during_b:
                    deferred.add(a.mb)
        out.append(
            tuple(
                sorted(
                    p for p in seen if not any(q != p and q[2] == p[2] and q[0] >= p[0] and q[1] >= p[1] for q in seen)
                )
            )
        )
    return tuple(out)


def uneven_stages_saving(stage_costs: list[float]) -> float:
    """Seconds a GPipe or 1F1B step (one chunk per stage) takes less than :func:`closed_form` prices
    it at the slowest stage's cost on every stage: ``Σ_s (c_max − c_s)`` (the others fill and drain faster)."""
    slowest = max(stage_costs, default=0.0)
    return sum(slowest - c for c in stage_costs)


def pipeline_time(
    schedule: str, pp: int, m: int, vpp: int, fwd: float, bwd: float, p2p: float
) -> tuple[float, float, tuple[int, ...]]:
    """(makespan seconds, bubble fraction, peak in-flight per stage) of a step of one chunk's ``fwd``/``bwd``
    (:func:`closed_form`)."""
    if not fwd > 0 or not bwd >= 0 or not p2p >= 0:
        raise PlanError(f"pipeline costs must be finite and positive, got forward {fwd}, backward {bwd}, p2p {p2p}")
    problem = schedule_problem(schedule, pp, vpp)
    if problem:
        raise PlanError(problem)
    span, peaks = closed_form(schedule, pp, m, vpp, fwd, bwd, p2p)
    return span, 1 - m * vpp * (fwd + bwd) / span, peaks


def p2p_message_seconds(hw, message_bytes: float, crosses_node: bool, pp: int, forward_s: float) -> float:
    """One activation (or its gradient) sent to the neighbour stage, as the step sees it
    (:data:`parallel.overlap.PIPELINE_P2P`); 0 without a pipeline."""
    if pp == 1:
        return 0.0
    fixed = (hw.latency_us + host_costs(hw).collective_overhead_us) * 1e-6  # per message
    return PIPELINE_P2P.exposed(message_bytes / hw.bandwidth(crosses_node) + fixed, forward_s)


def pipeline_step(
    schedule: str, pp: int, m: int, vpp: int, stage_costs: list[tuple[float, float]], p2p: float
) -> tuple[float, float, tuple[int, ...]]:
    """:func:`pipeline_time` paced by the slowest of ``stage_costs`` (forward and backward per stage),
    less :func:`uneven_stages_saving` where the schedule allows it."""
    slow_f = max(f for f, _ in stage_costs) / vpp
    slow_b = max(b for _, b in stage_costs) / vpp
    makespan, bubble, peaks = pipeline_time(schedule, pp, m, vpp, slow_f, slow_b, p2p)
    if vpp == 1 and schedule in ("gpipe", "1f1b"):
        makespan -= uneven_stages_saving([f + b for f, b in stage_costs])
        bubble = 1 - m * (slow_f + slow_b) / makespan
    return makespan, bubble, peaks
