"""train.precision=fp8 (emulated) trains the same model at every layout, and its checkpoints are a
bf16 run's: one taken at fp8 resumes at bf16, and one taken at bf16 resumes at fp8."""

import pytest

from parallel.testing import run_ranks

from .test_train_e2e import _train, losses, tiny_recipe

FP8 = dict(train__precision="fp8", train__fp8_emulate=True)
STEPS = 4
PARITY = 1e-3  # relative, per step: bf16 parameters and the layouts' accumulation order


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(1,1,1) at fp8 for STEPS steps, saving every 2nd."""
    d = tmp_path_factory.mktemp("fp8-ref")
    run_ranks(_train, 1, tiny_recipe(**FP8, train__max_steps=STEPS, train__ckpt_every=2), str(d), timeout=300)
    return d, losses(d)[0]


@pytest.mark.parametrize(
    "layout",
    [dict(dp=2, pp=2, tp=2, zero=1, parallel__sequence_parallel=True), dict(dp=2, pp=1, tp=1, zero=3)],
    ids=["dp2-pp2-tp2-sp-zero1", "dp2-zero3"],
)
def test_layout_matches_one_process(reference, tmp_path, layout):
    _, ref = reference
    world = layout["dp"] * layout["pp"] * layout["tp"]
    run_ranks(_train, world, tiny_recipe(**layout, **FP8, train__max_steps=STEPS), str(tmp_path), timeout=300)
    got = losses(tmp_path)[0]
    assert len(got) == STEPS
    assert max(abs(a - b) / b for a, b in zip(got, ref)) < PARITY, (got, ref)


def test_fp8_checkpoint_resumes_at_bf16_and_back(reference, tmp_path):
    """fp8 step 2 → bf16 step 3 → fp8 step 4: the same parameters and optimizer state, so each
    precision's losses stay within fp8's rounding (2 %) of the uninterrupted fp8 run; the bf16 steps
    are bf16's (not bit-equal to fp8's)."""
    run_dir, ref = reference
    bf16_dir, fp8_dir = tmp_path / "bf16", tmp_path / "fp8"
    ckpt = run_dir / "checkpoints" / "step_00000002"
    rc = tiny_recipe(train__precision="bf16", train__max_steps=3, train__ckpt_at_end=True, train__resume=str(ckpt))
    run_ranks(_train, 1, rc, str(bf16_dir), timeout=300)
    rc = tiny_recipe(**FP8, train__max_steps=4, train__resume=str(bf16_dir / "checkpoints" / "step_00000003"))
    run_ranks(_train, 1, rc, str(fp8_dir), timeout=300)
    bf16, fp8 = losses(bf16_dir)[0], losses(fp8_dir)[0]
    assert len(bf16) == 1 and len(fp8) == 1
    assert bf16 != ref[2:3]
    assert bf16 == pytest.approx(ref[2:3], rel=0.02) and fp8 == pytest.approx(ref[3:4], rel=0.02)
