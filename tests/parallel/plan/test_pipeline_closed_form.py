"""The planner's closed forms for every schedule equal the simulator (many small cases)."""

import itertools

import pytest

from parallel.pipeline.schedules import build_schedule
from parallel.pipeline.simulator import simulate
from parallel.plan import pipeline_time
from parallel.plan.pipeline import closed_form

# (forward, backward, p2p): backward ≥ forward as in every plan, p2p from nothing to above a forward
COSTS = [(1.0, 2.0, 0.0), (1.0, 2.0, 0.01), (1.0, 1.0, 0.7), (0.5, 2.0, 1.5), (0.3, 0.9, 0.0001)]


def _cases():
    for schedule, pp, m in itertools.product(("gpipe", "1f1b", "zb-h1"), range(1, 8), range(1, 14)):
        yield schedule, pp, m, 1
    for vpp, pp in itertools.product((2, 3, 4), range(2, 6)):
        for m in range(pp, 4 * pp + 1, pp):
            yield "interleaved", pp, m, vpp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_closed_form_equals_the_simulator(schedule):
    n = 0
    for name, pp, m, vpp in _cases():
        if name != schedule:
            continue
        sched = build_schedule(name, pp, m, vpp)
        for f, b, p in COSTS:
            sim = simulate(sched, forward=f, backward=b, p2p_latency=p)
            span, bubble, peaks = pipeline_time(name, pp, m, vpp, f, b, p)
            assert span == pytest.approx(sim.makespan, rel=1e-12), (name, pp, m, vpp, f, b, p)
            assert bubble == pytest.approx(sim.bubble_fraction, abs=1e-12)
            assert list(peaks) == sim.peak_activations
            n += 1
    assert n > 100


def test_zb_h1_closed_form_equals_the_simulator_at_random_costs():
    """ZB-H1's critical paths (:func:`zb_h1_paths`) switch with the costs: random forward, backward and
    transfer costs (transfers from none to three forwards) over pp ≤ 10, m ≤ 24, each against the simulator."""
    import random

    rng = random.Random(7)
    for pp, m in itertools.product(range(2, 11), (1, 2, 3, 4, 5, 6, 9, 10, 11, 17, 24)):
        f, b = rng.uniform(0.2, 2.0), rng.uniform(0.1, 6.0)
        p = rng.choice((0.0, rng.uniform(0, 0.05), rng.uniform(0, 3.0)))
        sim = simulate(build_schedule("zb-h1", pp, m), forward=f, backward=b, p2p_latency=p)
        assert closed_form("zb-h1", pp, m, 1, f, b, p)[0] == pytest.approx(sim.makespan, rel=1e-12), (pp, m, f, b, p)
    assert closed_form("no-such", 4, 8, 1, 1.0, 2.0, 0.0) is None


def test_zb_h1_without_transfers_is_the_papers_third_of_1f1b():
    """Qi et al. §2.1 (F = B = W): bubble (pp − 1)·F, a third of 1F1B's (pp − 1)·(F + B + W), at 1F1B's peak;
    128 stages × 4,096 micro-batches in closed form (the simulator took 34.5 s there)."""
    span, bubble, peaks = pipeline_time("zb-h1", 128, 4096, 1, 1.0, 2.0, 0.0)
    one = pipeline_time("1f1b", 128, 4096, 1, 1.0, 2.0, 0.0)
    assert span == 4096 * 3.0 + 127 and one[0] - 4096 * 3.0 == pytest.approx(3 * 127)
    assert bubble == pytest.approx(127 / (3 * 4096 + 127)) and max(peaks) == max(one[2]) == 128


def test_the_largest_pipeline_is_planned_in_closed_form():
    """512 stages × 4,096 micro-batches: no simulation (its 4 M actions took minutes)."""
    span, bubble, peaks = pipeline_time("1f1b", 512, 4096, 1, 1.0, 2.0, 0.0)
    assert span == (4096 + 511) * 3.0 and bubble == pytest.approx(511 / 4607)
    assert peaks[0] == 512 and peaks[-1] == 1


def _event_makespan(schedule: str, pp: int, m: int, f: list[float], b: list[float]) -> float:
    """The schedule's compute actions timed with per-stage costs and no transfer time: each starts
    when its stage is free and its input exists (the previous stage's forward, the next one's backward)."""
    from parallel.pipeline.schedules import Backward, Forward

    acts = [[a for a in st if isinstance(a, (Forward, Backward))] for st in build_schedule(schedule, pp, m, 1)]
    done, ptr, clock, moved = {}, [0] * pp, [0.0] * pp, True
    while moved:
        moved = False
        for s in range(pp):
            while ptr[s] < len(acts[s]):
                a = acts[s][ptr[s]]
                fwd = isinstance(a, Forward)
                dep = (("F", s - 1, a.mb) if s else None) if fwd else (("B", s + 1, a.mb) if s < pp - 1 else None)
                if dep is not None and dep not in done:
                    break
                clock[s] = max(clock[s], done.get(dep, 0.0)) + (f[s] if fwd else b[s])
                done[("F" if fwd else "B", s, a.mb)] = clock[s]
                ptr[s] += 1
                moved = True
    return max(clock)


def test_uneven_stages_fill_and_drain_faster():
    """Stages of different cost (the head's stage does more): the planner's ``m·c_slowest + Σ others``
    (:func:`uneven_stages_saving` off the closed form at the slowest stage) against the schedule timed
    stage by stage: within −5 % … +20 % over random costs (the closed form at the slowest stage on
    every stage: up to +70 %), exact when the last stage is the slowest; equal costs change nothing."""
    import random

    from parallel.plan.pipeline import uneven_stages_saving

    rng = random.Random(0)
    assert uneven_stages_saving([3.0, 3.0, 3.0]) == 0.0
    for _ in range(120):
        schedule, pp, m = rng.choice(("gpipe", "1f1b")), rng.choice((2, 3, 4)), rng.choice((1, 2, 4, 8))
        f = [rng.uniform(1, 3) for _ in range(pp)]
        b = [2 * x * rng.uniform(0.8, 1.2) for x in f]
        k = max(range(pp), key=lambda s: f[s] + b[s])
        uniform = closed_form(schedule, pp, m, 1, f[k], b[k], 0.0)[0]
        ours = uniform - uneven_stages_saving([x + y for x, y in zip(f, b)])
        timed = _event_makespan(schedule, pp, m, f, b)
        assert -0.05 <= ours / timed - 1 <= 0.2 and ours <= uniform
        if k == pp - 1 and schedule == "1f1b" and pp == 2:
            assert ours == pytest.approx(timed, rel=1e-9)


@pytest.mark.parametrize("pp", range(2, 8))
def test_zb_h1_holds_at_most_pp_micro_batches_and_s_deferred_ones_at_a_b(pp):
    """With m ≥ pp, stage s holds pp − s stored and s deferred micro-batches when a B starts, one
    fewer stored and one more deferred when a W starts (:func:`parallel.plan.pipeline.zb_h1_holds`);
    with fewer, never more than m in all, as the simulator's in-flight count says."""
    from parallel.pipeline.schedules import zb_h1
    from parallel.plan.pipeline import zb_h1_holds

    for m in (pp, pp + 1, 2 * pp + 3):
        assert zb_h1_holds(pp, m) == tuple(((pp - s - 1, s + 1, False), (pp - s, s, True)) for s in range(pp))
    for m in range(1, pp):
        peaks = simulate(zb_h1(pp, m)).peak_activations
        for s, holds in enumerate(zb_h1_holds(pp, m)):
            assert max(stored + deferred for stored, deferred, _ in holds) <= m
            assert max(stored for stored, _, during_b in holds if during_b) <= peaks[s]
