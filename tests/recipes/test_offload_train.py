"""ZeRO-Offload through the trainer: with pipeline and tensor parallelism it trains as without
(fused CPU AdamW on the host vs foreach AdamW: within 1e-6), and its checkpoints reshard into
layouts without offload and back (docs/offload.md)."""

import pytest

from parallel.testing import run_ranks

from .test_train_e2e import STEPS, _train, losses, tiny_recipe

SAVE_AT = 5
LAYOUTS = {
    "dp2-pp2-zero3-optimizer+params": (dict(dp=2, pp=2, tp=1, zero=3), "optimizer+params"),
    "pp2-zero1-optimizer": (dict(dp=1, pp=2, tp=1, zero=1), "optimizer"),  # (dp × tp: tests/parallel/zero)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout with and without offload, 10 steps, saving at step 5."""
    out = {}
    for name, (layout, mode) in LAYOUTS.items():
        for offload in ("none", mode):
            d = tmp_path_factory.mktemp(f"{name}-{offload}".replace("+", "_"))
            rc = tiny_recipe(**layout, parallel__offload=offload, train__ckpt_every=SAVE_AT)
            run_ranks(_train, layout["dp"] * layout["pp"] * layout["tp"], rc, str(d), timeout=300)
            out[name, offload] = d
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offload_trains_as_without(runs, name):
    ref_loss, ref_norm = losses(runs[name, "none"])
    loss, norm = losses(runs[name, LAYOUTS[name][1]])
    assert len(loss) == STEPS and loss[-1] < loss[0] - 0.3
    assert loss == pytest.approx(ref_loss, abs=1e-6, rel=0)
    assert norm == pytest.approx(ref_norm, rel=1e-6)


@pytest.mark.parametrize(
    "saved,offload_now,layout",
    [
        # saved with the optimizer on the host, resumed on the device in another layout
        (("dp2-pp2-zero3-optimizer+params", "optimizer+params"), "none", dict(dp=2, pp=1, tp=1, zero=2)),
        # saved on the device, resumed with optimizer and parameters on the host
        (("pp2-zero1-optimizer", "none"), "optimizer+params", dict(dp=2, pp=1, tp=1, zero=3)),
    ],
    ids=["offload-to-none", "none-to-offload"],
)
def test_checkpoints_reshard_into_and_out_of_offload(runs, tmp_path, saved, offload_now, layout):
    """Every later loss equals the uninterrupted run's within 1e-4: weights, Adam's moments and
    step all came across (a lost moment changes the next update's size by orders of magnitude)."""
    src = runs[saved]
    rc = tiny_recipe(
        **layout,
        parallel__offload=offload_now,
        train__resume=str(src / "checkpoints" / f"step_{SAVE_AT:08d}"),
    )
    run_ranks(_train, layout["dp"] * layout["pp"] * layout["tp"], rc, str(tmp_path), timeout=300)
    got = losses(tmp_path)[0]
    full = losses(src)[0]
    assert got == pytest.approx(full[SAVE_AT:], abs=1e-4) and len(got) == STEPS - SAVE_AT
