import itertools

import pytest

from parallel.pipeline.schedules import (
    Backward,
    Forward,
    RecvActivation,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)
from parallel.pipeline.simulator import simulate

GRID = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 5, 8, 12)]


def _computes(actions):
    return [a for a in actions if isinstance(a, (Forward, Backward))]


@pytest.mark.parametrize("p, m", GRID)
def test_1f1b_bubble_and_memory_formulas(p, m):
    for fwd, bwd in ((1.0, 1.0), (1.0, 2.0)):
        r = simulate(one_f_one_b(p, m), forward=fwd, backward=bwd)
        assert r.makespan == pytest.approx((m + p - 1) * (fwd + bwd))
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.peak_activations == [min(p - s, m) for s in range(p)]
    for s, actions in enumerate(one_f_one_b(p, m)):  # warm-up: pp − stage − 1 forwards
        order = _computes(actions)
        leading = min(p - s - 1, m) + (p - s - 1 < m)  # warm-up, plus the first steady forward
        assert all(isinstance(a, Forward) for a in order[:leading])
        assert isinstance(order[leading], Backward)


@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_holds_every_micro_batch_with_the_same_bubble(p, m):
    r = simulate(gpipe(p, m))
    assert r.peak_activations == [m] * p
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, vpp, groups", itertools.product((2, 3, 4), (2, 3, 4), (1, 2, 3)))
def test_interleaving_shrinks_the_bubble_vpp_fold(p, vpp, groups):
    m = p * groups
    r = simulate(interleaved_1f1b(p, m, vpp), forward=1.0 / vpp, backward=2.0 / vpp)
    plain = simulate(one_f_one_b(p, m))
    assert r.bubble_fraction == pytest.approx((p - 1) / (vpp * m + p - 1))
    assert r.bubble_fraction < plain.bubble_fraction
    assert r.busy == pytest.approx(plain.busy)
    # more in flight than 1F1B: the price of the smaller bubble (Megatron's warm-up)
    assert all(pk == min(2 * (p - s - 1) + (vpp - 1) * p + 1, m * vpp) for s, pk in enumerate(r.peak_activations))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_latency_lengthens_the_makespan_by_the_critical_path(p):
    lat = 0.25
    # one micro-batch crosses p − 1 links forward and p − 1 back
    assert simulate(one_f_one_b(p, 1), p2p_latency=lat).makespan == pytest.approx(3.0 * p + 2 * (p - 1) * lat)
    # with more, at least that (the blocking transfers of the steady state add more)
    m = 6
    assert simulate(one_f_one_b(p, m), p2p_latency=lat).makespan >= (m + p - 1) * 3.0 + 2 * (p - 1) * lat


def test_interleaved_needs_m_a_multiple_of_pp():
    with pytest.raises(ScheduleError, match=r"m=6, pp=4 \(use m=4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match="interleaved needs vpp ≥ 2"):  # as the config refuses it
        build_schedule("interleaved", 4, 8, vpp=1)
    with pytest.raises(ScheduleError, match="pp_schedule='zb' is not one of"):
        build_schedule("zb", 2, 2)
    with pytest.raises(ScheduleError, match="vpp=2"):
        build_schedule("1f1b", 2, 2, vpp=2)
    with pytest.raises(ScheduleError, match="micro-batches m must be a positive integer"):
        one_f_one_b(2, 0)


def test_simulator_finds_deadlocks_mismatches_and_missing_work():
    good = one_f_one_b(2, 2)
    # stage 1 waits for micro-batch 1 before 0: the first message is paired wrongly
    swapped = [good[0], [RecvActivation(1, 0, 0), *good[1][1:]]]
    with pytest.raises(ScheduleError, match="sent .*'activation', 0.* but the receiver expects .*'activation', 1"):
        simulate(swapped)
    # a receive with no send: both stages stuck, named
    stuck = [[a for a in good[0] if not isinstance(a, SendActivation)], good[1]]
    with pytest.raises(ScheduleError, match=r"deadlocks:\n  stage 0 .*\n  stage 1 .*RecvActivation"):
        simulate(stuck)
    missing = [good[0], [a for a in good[1] if a != Backward(1, 0) and a != SendGrad(1, 0, 0)]]
    with pytest.raises(ScheduleError, match=r"stage 1: \(micro-batch 1, chunk 0\) needs exactly one Backward"):
        simulate(missing)
    early = [good[0], [Forward(0), *good[1]]]
    with pytest.raises(ScheduleError, match="Forward"):
        simulate(early)
