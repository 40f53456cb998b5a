"""Theory the suite compares against: pure formulas, checked by hand and against the ZeRO module."""

import pytest

from benchmarks import theory
from benchmarks.common import compare, quantile, slowest_rank
from parallel.zero.theory import step_sent_bytes


def test_bubble():
    assert theory.bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert theory.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert theory.bubble_fraction(2, 8, vpp=2) == pytest.approx(1 / 17)
    assert theory.bubble_fraction(1, 5) == 0
    with pytest.raises(ValueError, match="m=0"):
        theory.bubble_fraction(2, 0)


def test_dp_bytes_per_stage():
    psi, n = 1000, 4
    assert theory.dp_bytes(psi, 0, n, m=8) == step_sent_bytes(psi, 0, n) == 2 * 0.75 * 4000
    assert theory.dp_bytes(psi, 1, n, m=8) == 2 * 0.75 * 4000  # reduce-scatter + all-gather, once
    assert theory.dp_bytes(psi, 2, n, m=3) == 3 * 3000 + 3000  # a reduce-scatter per micro-batch
    # per micro-batch: reduce-scatter of all + the blocks gathered for forward and for backward;
    # the other 400 parameters gathered once per step
    assert theory.dp_bytes(psi, 3, n, m=2, regathered_psi=600) == 2 * (3000 + 2 * 0.75 * 2400) + 0.75 * 1600


def test_tp_and_pp_bytes():
    a = 2 * 16 * 64 * 4  # one fp32 activation [2, 16, 64]
    # one stage with embedding, 3 blocks and head, tp=2 (ρ = 1/2), 4 micro-batches
    assert theory.tp_bytes(2, 4, 2, 16, 64, 3, True, True) == 4 * (0.5 * a * (2 + 24 + 2) + 0.5 * 24 * 32)
    assert theory.tp_bytes(2, 1, 2, 16, 64, 2, False, False) == 0.5 * a * 16
    assert theory.pp_bytes(2, 8, 2, 16, 64) == 8 * a  # each rank sends m activations or m gradients
    assert theory.pp_bytes(2, 8, 2, 16, 64, vpp=2) == 3 * 8 * a  # 3 boundaries each way over 2 ranks


def test_compare_takes_ratios_round_by_round():
    ours, theirs = [2.0, 4.0, 6.0, 100.0], [1.0, 4.0, 3.0, 50.0]
    r = compare(ours, theirs)
    assert r["ratio"] == pytest.approx(2.0)  # per-round ratios 2, 1, 2, 2
    assert r["ours_ms"] == pytest.approx(5000.0) and r["theirs_ms"] == pytest.approx(3500.0)
    assert (r["ratio_lo"], r["ratio_hi"]) == (pytest.approx(1.75), pytest.approx(2.0))
    assert slowest_rank([[1, 5], [3, 2]]) == [3, 5]
    assert quantile([1, 2, 3, 4, 5], 0.5) == 3
    with pytest.raises(ValueError, match="same non-zero number"):
        compare([1.0], [])


@pytest.mark.parametrize("size", ["small", "large"])
def test_planned_dp_bytes_are_theory_for_both_accumulations(size):
    """Each ZeRO-2/3 row of the suite, accumulating sharded and unsharded: the planner's DP bytes per rank
    per step equal the row's theory (tests/benchmarks/test_run.py pins the counted bytes to the same
    theory; tests/recipes/test_plan_zero3_accumulate.py the planned to the counted), plus the loss and
    norm scalars (two 4-byte all-reduces at dp=2)."""
    from benchmarks.gpt import suite_recipe
    from models.transformer import build_model
    from recipes.config import model_config
    from recipes.tools.plan import plan_from_config

    for zero, accumulate in ((2, "sharded"), (2, "unsharded"), (3, "sharded"), (3, "unsharded")):
        rc = suite_recipe(dp=2, zero=zero, size=size, zero_accumulate=accumulate)
        plan = plan_from_config(rc)
        model = build_model(model_config(rc.model), device="meta")
        psi, in_units = (sum(q.numel() for q in ps) for ps in (model.parameters(), model.blocks.parameters()))
        expected = theory.dp_bytes(psi, zero, 2, plan.grad_accum, regathered_psi=in_units, accumulate=accumulate)
        assert plan.grad_accum > 1 and plan.ranks[0].traffic["dp"]["bytes"] == expected + 2 * 4, (zero, accumulate)
        assert (
            f"parallel.zero_accumulate={'sharded' if accumulate == 'unsharded' else 'unsharded'} (" in plan.advice[-1]
        )
