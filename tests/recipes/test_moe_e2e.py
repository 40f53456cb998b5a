"""End to end: an MoE model (mixtral_tiny) trains identically under ep with dp, tp, pp, cp and ZeRO."""

import json

import pytest

from parallel.testing import run_ranks

from .test_train_e2e import _train, losses, tiny_recipe

STEPS = 6


def _moe(**layout):
    return tiny_recipe(**{"model__preset": "mixtral_tiny", "model__n_layers": 2, "train__max_steps": STEPS, **layout})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_ref")
    run_ranks(_train, 1, _moe(), str(d), timeout=300)
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    # every logged step: 8 sequences × 32 tokens × top-2 × 2 MoE layers routed, none dropped (dropless)
    assert all(sum(r["moe_tokens_per_expert"]) == 8 * 32 * 2 * 2 and r["moe_dropped"] == 0 for r in rows)
    assert all(r["moe_aux_loss"] > 0 for r in rows)
    return losses(d)


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=4, parallel__ep=2, zero=1),
        dict(dp=2, tp=2, parallel__ep=2, zero=0),
        dict(dp=2, pp=2, parallel__ep=2, zero=2),
        dict(dp=2, cp=2, parallel__ep=2, zero=1),  # the router statistics summed over cp
    ],
    ids=lambda d: ",".join(f"{k.split('__')[-1]}={v}" for k, v in d.items()),
)
def test_moe_layouts_match_one_process(reference, tmp_path, layout):
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1) * layout.get("cp", 1)
    rc = _moe(**{k: v for k, v in layout.items() if k != "cp"})
    rc.parallel.cp = layout.get("cp", 1)
    run_ranks(_train, world, rc, str(tmp_path), timeout=300)
    (ref_loss, ref_norm), (loss, norm) = reference, losses(tmp_path)
    assert len(loss) == STEPS
    assert loss == pytest.approx(ref_loss, abs=1e-4)
    assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert loss[-1] < loss[0] - 0.2  # and it learns


def test_moe_checkpoint_at_ep2_resumes_in_one_process(tmp_path):
    """Experts saved from two ep ranks (each its half of [E, ...]) load whole into one process."""
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    run_ranks(_train, 4, _moe(dp=4, parallel__ep=2, zero=1, train__ckpt_every=4), str(saved), timeout=300)
    full = losses(saved)[0]
    rc = _moe(train__max_steps=5, train__resume=str(saved / "checkpoints" / "step_00000004"))
    run_ranks(_train, 1, rc, str(resumed), timeout=300)
    got = losses(resumed)[0]
    assert len(got) == 1 and got[0] == pytest.approx(full[4], abs=1e-4)
