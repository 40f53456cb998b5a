"""The grouped-matmul benchmark's contenders compute the same experts (outputs and gradients)."""

from benchmarks.moe import grouped_side_by_side
from parallel.layers.grouped_mm import KINDS


def test_grouped_contenders_agree_and_are_timed():
    r = grouped_side_by_side(experts=6, top_k=2, d=16, f=24, tokens=20, iters=1)
    assert r["max_abs_diff"] < 1e-4 and sum(r["sizes"]) == 40
    assert all(r[kind] > 0 for kind in KINDS)
