"""A diverging run says so and stops: a warning per skipped step, more than train.max_skipped_steps in a
row (or NaN with skipping off) is one error line and exit 3, the last good checkpoint stays the newest,
metrics.jsonl is strict JSON (recipes/training/divergence.py, runlog.py)."""

import json
import math
import sys

import pytest
import torch

from parallel.checkpoint import latest_checkpoint
from parallel.testing import run_ranks
from recipes.training.divergence import SkipWatch
from recipes.training.exits import EXIT_DIVERGED
from recipes.training.runlog import json_line

from .test_faults import cli_overrides, launch, small_recipe
from .test_train_e2e import _train

# the cheapest run that diverges: optim.lr=1e3 from step 1 (no warm-up); its gradient norm is inf/NaN from step 3
DIVERGE = ["optim.lr=1e3", "optim.warmup_steps=0"]


def strict_rows(run_dir):
    """metrics.jsonl parsed as strict JSON (Python's parser would take a bare NaN)."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return [json.loads(line, parse_constant=refuse) for line in open(run_dir / "metrics.jsonl")]


def test_json_lines_are_strict_with_the_non_finite_keys_named():
    line = json_line({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    assert json.loads(line) == {
        "step": 3,
        "loss": None,
        "grad_norm": None,
        "lr": 1e-3,
        "nonfinite": ["loss", "grad_norm"],
    }
    assert json.loads(json_line({"step": 1, "loss": 2.5})) == {"step": 1, "loss": 2.5}  # no flag when all finite


def _watch(limit=3):
    return SkipWatch(limit, torch.device("cpu"), lr=1e3, grad_clip=1.0, precision="fp32")


def test_skip_watch_counts_unread_steps_on_the_device_and_stops_past_the_limit():
    w = _watch()
    nan = {"loss": 7e4, "grad_norm": float("nan"), "skipped": True}
    w.after_step({"skipped": torch.tensor(False)})  # step 1, unread
    assert w.check(1, {"loss": 5.0, "grad_norm": 2.0, "skipped": False}).warnings == []
    for _ in range(2):  # steps 2, 3: skipped, unread (device flags)
        w.after_step({"skipped": torch.tensor(True)})
    w.after_step(nan)  # step 4: skipped, read
    v = w.check(4, nan)
    assert v.warnings == [
        "3 of the steps 2–4 skipped: the gradient norm is nan, the loss 7e+04 is finite; 3 skipped so far, "
        "3 in a row (train.max_skipped_steps=3)"
    ]
    assert v.stop is None and w.holds_save  # 3 in a row is the limit, not past it; no save of these weights
    w.after_step(nan)
    v = w.check(5, nan)
    assert v.warnings[0].startswith("step 5 skipped:") and "4 skipped so far, 4 in a row" in v.warnings[0]
    assert v.stop.startswith(
        "training diverged: 4 steps in a row skipped by step 5, more than train.max_skipped_steps=3"
    )
    assert "lower optim.lr (now 1000)" in v.stop


def test_a_streak_that_ended_between_reads_still_counts():
    w = _watch(limit=2)
    for s in (True, True, True, False):
        w.after_step({"skipped": torch.tensor(s)})
    v = w.check(4, {"loss": 5.0, "grad_norm": 2.0, "skipped": False})
    assert v.stop and "3 steps in a row skipped by step 4" in v.stop and not w.holds_save


def test_zero_means_no_limit():
    w = _watch(limit=0)
    nan = {"loss": 7e4, "grad_norm": float("nan"), "skipped": True}
    for step in range(1, 30):
        w.after_step(nan)
        assert w.check(step, nan).stop is None


def test_a_nan_loss_with_skipping_off_stops_at_the_next_logged_step(tmp_path):
    """fp32 without clipping: an unlogged step computes no norm, so NaN gradients are applied; the next
    logged step reads a NaN loss and the run stops there (a real run, in process, one rank)."""
    rc = small_recipe(
        train__grad_clip=0.0, train__log_every=4, train__max_steps=12, optim__lr=1e3, optim__warmup_steps=0
    )
    rc.parallel.dp = 1
    (summary,) = run_ranks(_train, 1, rc, str(tmp_path), timeout=120)
    rows = strict_rows(tmp_path)
    assert rows[-1]["loss"] is None and "loss" in rows[-1]["nonfinite"]  # the first NaN read ends it
    assert all(r["loss"] is not None for r in rows[:-1]) and [r["step"] % 4 for r in rows[1:]] == [0] * len(rows[1:])
    assert summary["steps"] == rows[-1]["step"] < 12 and summary["exit_code"] == EXIT_DIVERGED
    assert (
        summary["stopped"].startswith("training diverged: the loss is nan") and "were not checked" in summary["stopped"]
    )
    assert "set train.grad_clip=1.0" in summary["stopped"] and "no checkpoint was saved" in summary["stopped"]


def test_diverging_job_warns_stops_keeps_the_last_good_checkpoint_and_exits_3(tmp_path):
    """As a user runs it: `python -m recipes.gpt_tiny optim.lr=1e3 ...` on two ranks, a checkpoint every step."""
    args = [
        sys.executable,
        "-m",
        "recipes.gpt_tiny",
        *cli_overrides(tmp_path, max_steps=20, ckpt_every=1, ckpt_async="false", max_skipped_steps=3),
        *DIVERGE,
    ]
    done, _ = launch(args, timeout=180)
    assert done.returncode == EXIT_DIVERGED, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    rows = strict_rows(tmp_path)
    skipped = [r["step"] for r in rows if r["skipped"]]
    assert len(skipped) == 4 and skipped == list(range(skipped[0], skipped[0] + 4))  # 4 in a row: one past 3
    good = skipped[0] - 1
    assert [r["step"] for r in rows] == list(range(1, good + 5))  # every rank stopped on the same step
    warnings = [x for x in lines if x.startswith("warning: step ")]
    assert [w.split()[2] for w in warnings] == [str(s) for s in skipped]
    assert all("in a row (train.max_skipped_steps=3)" in w for w in warnings)
    held = [x for x in lines if "is not written: the last" in x]
    assert len(held) == 3  # the skipped steps' due checkpoints (the 4th stops before saving)
    assert lines[-1].startswith(f"error: training diverged: 4 steps in a row skipped by step {good + 4}")
    newest = tmp_path / "checkpoints" / f"step_{good:08d}"
    assert f"the last good checkpoint is {newest}; resume from it with train.resume={newest}" in lines[-1]
    assert latest_checkpoint(tmp_path / "checkpoints") == newest
    assert "Traceback" not in done.stderr and "done:" not in done.stdout
    assert all(r["grad_norm"] is None and r["nonfinite"] == ["grad_norm"] for r in rows if r["skipped"])
    assert all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("value, says", [("-1", "must be ≥ 0"), ("1.5", "Integer")])
def test_the_limit_is_checked(value, says):
    from recipes.config import ConfigError, RecipeConfig
    from recipes.keys import check_overrides, check_values

    with pytest.raises(ConfigError, match=says):
        check_overrides([f"train.max_skipped_steps={value}"])
        rc = RecipeConfig()
        rc.train.max_skipped_steps = int(value)
        check_values(rc)
