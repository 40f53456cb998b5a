"""The stock h100_80gb profile against published H100 runs of two teams (recipes/tools/plan_published_h100.py)."""

from recipes.tools.plan_published_h100 import H100_RUNS, h100_rows


def test_every_published_h100_run_within_fifteen_percent():
    got = h100_rows()
    assert len(got) == len(H100_RUNS) == 2
    for r in got:
        assert abs(r["ours"] / r["published"] - 1) <= 0.15, (r["run"], r["published"], r["ours"])
        assert r["plan"].layout["tp"] == 8 and r["plan"].hardware["name"] == "h100_80gb"
