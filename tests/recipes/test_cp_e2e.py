"""Context parallelism end to end through the recipe: every cp layout trains as one process does
(the mean over all tokens of the global batch, gradients summed over cp through ZeRO's dp×cp group)."""

import pytest

from parallel.testing import run_ranks
from recipes.config import ConfigError, validate

from .test_train_e2e import STEPS, _train, losses, references, tiny_recipe  # noqa: F401 - fixture

LAYOUTS = [  # and (cp=2, ZeRO-1, GPT): the `cp_run` fixture below
    dict(dp=2, cp=2, zero=1, model__preset="llama_tiny"),
    dict(cp=2, tp=2, zero=1, parallel__sequence_parallel=True, model__preset="llama_tiny"),
    dict(cp=2, pp=2, zero=3),
    dict(cp=2, zero=2, parallel__cp_impl="alltoall", model__activation_checkpointing="full"),
]


def cp_recipe(cp=1, **layout):
    rc = tiny_recipe(**layout)
    rc.parallel.cp = cp
    return rc


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ",".join(f"{k.split('__')[-1]}={v}" for k, v in d.items()))
def test_cp_layouts_match_one_process(references, tmp_path, layout):  # noqa: F811 - the fixture
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1) * layout["cp"]
    run_ranks(_train, world, cp_recipe(**layout), str(tmp_path), timeout=300)
    ref_loss, ref_norm = references(layout.get("model__preset", "gpt_tiny"))
    loss, norm = losses(tmp_path)
    assert len(loss) == STEPS
    assert loss == pytest.approx(ref_loss, abs=1e-4)
    assert norm == pytest.approx(ref_norm, rel=1e-4)


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (dict(cp=2, model__seq_len=30), 2, r"parallel.cp=2: seq_len 30 is not divisible by 2·cp = 4"),
        (dict(cp=3), 4, r"world size 4 ≠ dp 1 × pp 1 × tp 1 × cp 3"),
        (dict(cp=2, tp=2, parallel__cp_impl="alltoall", model__n_heads=2), 4, r"n_heads 2 divisible by cp·tp"),
        (dict(cp=0), 2, r"parallel.cp must be a positive integer"),
        (dict(cp=2, parallel__cp_impl="ulysses"), 2, r"parallel.cp_impl='ulysses' is not one of"),
    ],
)
def test_bad_cp_refused_before_any_collective(layout, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(cp_recipe(**layout), world_size=world)


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    """(cp=2, ZeRO-1, GPT) for 10 steps, saving a checkpoint at step 4 (saving changes no loss)."""
    d = tmp_path_factory.mktemp("cp2")
    run_ranks(_train, 2, cp_recipe(cp=2, zero=1, train__ckpt_every=4), str(d), timeout=300)
    return d


def test_cp2_matches_one_process(references, cp_run):  # noqa: F811 - the fixture
    loss, norm = losses(cp_run)
    ref_loss, ref_norm = references("gpt_tiny")
    assert loss == pytest.approx(ref_loss, abs=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4)
    assert loss[-1] < loss[0] - 0.3  # and it learns


def test_cp_checkpoint_resumes_in_another_layout(cp_run, tmp_path):
    """The (cp=2) checkpoint of step 4 continues at (dp=2, ZeRO-1): step 5's loss within 1e-4."""
    ckpt = str(cp_run / "checkpoints" / "step_00000004")
    run_ranks(_train, 2, cp_recipe(dp=2, zero=1, train__max_steps=5, train__resume=ckpt), str(tmp_path), timeout=300)
    got = losses(tmp_path)[0]
    assert len(got) == 1 and got[0] == pytest.approx(losses(cp_run)[0][4], abs=1e-4)
