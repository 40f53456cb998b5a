"""The planner's closed forms for the standard schedules equal the simulator (many small cases)."""

import itertools

import pytest

from parallel.pipeline.schedules import build_schedule
from parallel.pipeline.simulator import simulate
from parallel.plan import pipeline_time
from parallel.plan.planner import closed_form

# (forward, backward, p2p): backward ≥ forward as in every plan, p2p from nothing to above a forward
COSTS = [(1.0, 2.0, 0.0), (1.0, 2.0, 0.01), (1.0, 1.0, 0.7), (0.5, 2.0, 1.5), (0.3, 0.9, 0.0001)]


def _cases():
    for schedule, pp, m in itertools.product(("gpipe", "1f1b"), range(1, 8), range(1, 14)):
        yield schedule, pp, m, 1
    for vpp, pp in itertools.product((2, 3, 4), range(2, 6)):
        for m in range(pp, 4 * pp + 1, pp):
            yield "interleaved", pp, m, vpp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
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


def test_other_schedules_fall_back_to_the_simulator():
    assert closed_form("zb-h1", 4, 8, 1, 1.0, 2.0, 0.0) is None


def test_the_largest_pipeline_is_planned_in_closed_form():
    """512 stages × 4,096 micro-batches: no simulation (its 4 M actions took minutes)."""
    span, bubble, peaks = pipeline_time("1f1b", 512, 4096, 1, 1.0, 2.0, 0.0)
    assert span == (4096 + 511) * 3.0 and bubble == pytest.approx(511 / 4607)
    assert peaks[0] == 512 and peaks[-1] == 1
