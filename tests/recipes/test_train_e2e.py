"""End to end: every layout trains the same model as one process (docs/architecture.md invariant 1)."""

import json

import pytest

from parallel.testing import run_ranks
from recipes.config import RecipeConfig

STEPS = 10


def tiny_recipe(dp=1, pp=1, tp=1, zero=1, **train) -> RecipeConfig:
    rc = RecipeConfig()
    rc.model.preset = "gpt_tiny"
    rc.model.n_layers, rc.model.d_model, rc.model.n_heads, rc.model.seq_len = 4, 64, 4, 32
    rc.parallel.dp, rc.parallel.pp, rc.parallel.tp, rc.parallel.zero = dp, pp, tp, zero
    rc.train.global_batch, rc.train.micro_batch, rc.train.max_steps = 8, 2, STEPS
    rc.train.log_every, rc.train.eval_every, rc.train.threads = 1, 0, 1
    rc.optim.warmup_steps = 2
    rc.logger.progress = False
    rc.data.embedded_mb = 0.25
    for k, v in train.items():
        section, key = k.split("__")
        setattr(getattr(rc, section), key, v)
    return rc


def _train(rc, run_dir):
    from recipes.training.trainer import train

    return train(rc, run_dir)


def losses(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(preset):
        if preset not in cache:
            d = tmp_path_factory.mktemp("ref")
            run_ranks(_train, 1, tiny_recipe(model__preset=preset), str(d), timeout=300)
            cache[preset] = losses(d)
        return cache[preset]

    return get


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, pp=2, tp=2, zero=1),
        dict(dp=2, pp=1, tp=2, zero=3),
        dict(dp=1, pp=4, tp=1, zero=2),
        dict(dp=2, pp=2, tp=1, zero=0, parallel__pp_schedule="gpipe"),
        dict(dp=1, pp=2, tp=2, zero=2, parallel__sequence_parallel=True),
        dict(dp=1, pp=2, tp=1, zero=1, parallel__pp_schedule="interleaved", parallel__vpp=2),
        dict(dp=2, pp=2, tp=1, zero=3, model__preset="llama_tiny"),
        dict(dp=1, pp=1, tp=2, zero=0, model__preset="llama_tiny", parallel__sequence_parallel=True),
        # Qwen3's QK-norm: one weight over every head, its gradient summed over TP (each rank has some heads)
        dict(dp=1, pp=2, tp=2, zero=1, model__preset="qwen3_tiny"),
        # ZeRO-3 with recomputation, with GPipe (several backwards before the root is freed), interleaved
        dict(dp=2, pp=1, tp=1, zero=3, model__activation_checkpointing="full"),
        dict(dp=1, pp=2, tp=1, zero=3, parallel__pp_schedule="gpipe"),
        dict(dp=2, pp=2, tp=1, zero=3, parallel__pp_schedule="interleaved", parallel__vpp=2),
        # zero bubble (B and W apart) with ZeRO-2; with TP, sequence parallelism, Llama
        dict(dp=2, pp=2, tp=1, zero=2, parallel__pp_schedule="zb-h1"),
        dict(
            dp=1,
            pp=2,
            tp=2,
            zero=1,
            parallel__pp_schedule="zb-h1",
            parallel__sequence_parallel=True,
            model__preset="llama_tiny",
        ),
    ],
    ids=lambda d: ",".join(f"{k.split('__')[-1]}={v}" for k, v in d.items()),
)
def test_layouts_match_one_process(references, tmp_path, layout):
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    run_ranks(_train, world, tiny_recipe(**layout), str(tmp_path), timeout=300)
    ref_loss, ref_norm = references(layout.get("model__preset", "gpt_tiny"))
    loss, norm = losses(tmp_path)
    assert len(loss) == STEPS
    assert loss == pytest.approx(ref_loss, abs=1e-4)
    assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert loss[-1] < loss[0] - 0.3  # and it learns


def test_timeline_of_a_real_step_is_drawn_and_its_bubble_logged(tmp_path):
    rc = tiny_recipe(pp=2, parallel__pp_schedule="1f1b", logger__timeline=True, train__max_steps=2)
    run_ranks(_train, 2, rc, str(tmp_path), timeout=300)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert "bubble" not in rows[0] and 0.0 < rows[1]["bubble"] < 1.0
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
