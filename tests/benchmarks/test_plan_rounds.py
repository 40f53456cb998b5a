"""``benchmarks/plan.py``'s arithmetic: rounds alternate the layout order, a layout's row is its
rounds' mean predicted over their mean measured, raw and rescaled. Pure."""

import pytest

from benchmarks.plan import combine, markdown, round_orders, step_seconds
from recipes.tools.calibrate_timing import probe_factor


def test_rounds_alternate_the_order():
    assert round_orders(3, 3) == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]


def test_a_row_combines_its_rounds_and_keeps_the_raw_ratio():
    rounds = [
        dict(predicted_s=0.06, raw_predicted_s=0.05, measured_s=0.05, wall_s=0.055, less_all_cpu_wait_s=0.04, speed_factor=1.2, load=1.0,
             other_cores=0.1),
        dict(predicted_s=0.05, raw_predicted_s=0.05, measured_s=0.06, wall_s=0.065, less_all_cpu_wait_s=0.05, speed_factor=1.0, load=2.0,
             other_cores=0.0),
    ]  # fmt: skip
    row = combine("x", rounds)
    assert row["ratio"] == pytest.approx(0.055 / 0.055) and row["raw_ratio"] == pytest.approx(0.05 / 0.055)
    assert row["speed_factor"] == pytest.approx(1.1) and row["other_cores"] == 0.1 and row["load"] == 2.0
    table = markdown([row])
    assert "| 1.20 / 0.83 |" in table and "| 0.91 | 1.10 |" in table
    assert probe_factor({"block_s": 2.0}, {"block_s": 2.5}) == 1.25


def test_a_steps_cpu_wait_is_subtracted_only_as_far_as_other_jobs_account_for_it():
    assert step_seconds(0.055, 0.011, 0.02) == pytest.approx(0.055 - 0.02 * 0.055)  # the rest: the layout's own
    assert step_seconds(0.055, 0.0005, 0.5) == pytest.approx(0.0545)  # a busy machine: all of a small wait
    assert step_seconds(0.055, 0.011, 0.0) == 0.055


def test_a_disturbed_measurement_is_retaken_and_the_least_disturbed_kept():
    from benchmarks.plan import ATTEMPTS, QUIET_CORES, least_disturbed

    def fake(others):
        seq = iter(others)
        calls = []

        def disturbance(fn):
            calls.append(1)
            return fn(), next(seq)

        return disturbance, calls

    d, calls = fake([QUIET_CORES + 1, QUIET_CORES / 2, 0.0])
    assert least_disturbed(lambda: len(calls), disturbance=d) == (2, QUIET_CORES / 2) and len(calls) == 2
    d, calls = fake([2.0, 1.0, 1.5, 0.0])
    assert least_disturbed(lambda: len(calls), disturbance=d) == (2, 1.0) and len(calls) == ATTEMPTS
