"""Exact resume and resharding through the trainer (DESIGN.md invariant 1 across a restart)."""

import pytest

from parallel.checkpoint import latest_checkpoint, read_manifest
from parallel.testing import run_ranks

from .test_train_e2e import _train, losses, tiny_recipe

SAVED = dict(dp=2, pp=2, tp=2, zero=1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(2,2,2) ZeRO-1 for 6 steps, saving at step 4 (and every 4th): the reference and the checkpoint."""
    d = tmp_path_factory.mktemp("full")
    run_ranks(_train, 8, tiny_recipe(**SAVED, train__max_steps=6, train__ckpt_every=4), str(d), timeout=300)
    return d, losses(d)[0]


def test_checkpoint_records_step_layout_and_config(uninterrupted):
    run_dir, _ = uninterrupted
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    manifest = read_manifest(ckpt)
    assert ckpt.name == "step_00000004" and manifest["step"] == 4
    assert {k: manifest["meta"]["layout"][k] for k in SAVED} == SAVED
    assert manifest["meta"]["config"]["model"]["d_model"] == 64
    assert sorted(p.name for p in ckpt.glob("__*.distcp")) == [f"__{r}_0.distcp" for r in range(8)]


def test_same_layout_resume_is_bit_exact(uninterrupted, tmp_path):
    run_dir, full = uninterrupted
    rc = tiny_recipe(**SAVED, train__max_steps=6, train__resume=str(run_dir / "checkpoints"))
    summary = run_ranks(_train, 8, rc, str(tmp_path), timeout=300)[0]
    assert summary["steps"] == 6
    assert losses(tmp_path)[0] == full[4:6]  # steps 5 and 6, bit for bit


@pytest.mark.parametrize("layout", [
    dict(dp=4, pp=1, tp=2, zero=1),
    dict(dp=1, pp=2, tp=4, zero=1),
    dict(dp=2, pp=2, tp=2, zero=3),
], ids=lambda d: "dp{dp}-pp{pp}-tp{tp}-zero{zero}".format(**d))
def test_other_layout_resumes_within_1e4(uninterrupted, tmp_path, layout):
    """The next step's loss (step 5) is computed before step 5's update, so one step suffices
    (max_steps=5 changes only the learning rate of that update)."""
    run_dir, full = uninterrupted
    rc = tiny_recipe(**layout, train__max_steps=5, train__resume=str(run_dir / "checkpoints" / "step_00000004"))
    run_ranks(_train, 8, rc, str(tmp_path), timeout=300)
    got = losses(tmp_path)[0]
    assert len(got) == 1 and got[0] == pytest.approx(full[4], abs=1e-4)
