"""examples/mixer_lm.py through the recipe trainer (``model.target``): at pp=2 × tp=2 through
``python -m recipes.gpt_tiny`` it trains like one process, and a run resumed from its checkpoint in
another layout (dp=2) continues the same curve. mode=plan counts its pieces; bad targets are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.testing import run_ranks
from recipes.config import ConfigError, RecipeConfig
from recipes.training.target_model import load_target
from recipes.validation import validate

ROOT = Path(__file__).resolve().parents[2]
TARGET = "examples.mixer_lm:build"
SMALL = dict(model__seq_len=32, model__d_model=64, model__d_ff=128)
OVERRIDES = [f"{k.replace('__', '.')}={v}" for k, v in SMALL.items()] + [
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.threads=1",
    "train.ckpt_every=3",
    "train.ckpt_async=false",
    "optim.warmup_steps=2",
    "logger.progress=false",
    "data.embedded_mb=0.25",
]


def recipe(max_steps: int, dp: int = 1, **keys) -> RecipeConfig:
    """The config the command line of :data:`OVERRIDES` gives (recipes/conf/gpt_tiny.yaml + them)."""
    rc = RecipeConfig()
    rc.model.target = TARGET
    rc.parallel.dp = dp
    settings = {
        **SMALL,
        "train__global_batch": 8,
        "train__micro_batch": 2,
        "train__log_every": 1,
        "train__eval_every": 0,
        "train__threads": 1,
        "train__ckpt_every": 3,
        "train__ckpt_async": False,
        "train__max_steps": max_steps,
        "optim__lr": 2e-3,
        "optim__min_lr": 2e-4,
        "optim__warmup_steps": 2,
        "logger__progress": False,
        "data__embedded_mb": 0.25,
        **keys,
    }
    for k, v in settings.items():
        section, key = k.split("__")
        setattr(getattr(rc, section), key, v)
    return rc


def _train(rc, run_dir):
    from recipes.training.trainer import train

    return train(rc, run_dir)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]


def test_target_model_trains_through_the_recipe_like_one_process_and_resumes(tmp_path):
    grid = tmp_path / "grid"
    cmd = [sys.executable, "-m", "recipes.gpt_tiny", f"model.target={TARGET}", "parallel.pp=2", "parallel.tp=2"]
    cmd += [*OVERRIDES, "train.max_steps=3", f"hydra.run.dir={grid}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (grid / "checkpoints" / "step_00000003").is_dir()
    # resumed in another layout (dp=2, no pipeline, no TP): the pieces' names are layout-independent
    run_ranks(_train, 2, recipe(6, dp=2, train__resume="auto"), str(grid), timeout=300)
    single = tmp_path / "single"
    run_ranks(_train, 1, recipe(6), str(single), timeout=300)
    reference = losses(single)
    assert losses(grid) == pytest.approx(reference, abs=1e-4)
    assert reference[-1] < reference[0] - 0.05  # it learns


def test_plan_counts_the_pieces_on_meta(tmp_path):
    from recipes.tools.plan_target import target_plan

    plan = target_plan(recipe(1, parallel__pp=2, parallel__tp=2))
    d, f, s, v, n = 64, 128, 32, 256, 4  # d_model, d_ff, seq_len, vocab, blocks
    block = 2 * 2 * d + s * s + (d * f + f) + (f * d + d)  # two norms, the mix, the MLP
    assert plan["params"] == v * d + n * block + 2 * d + d * v
    assert sum(st["params_per_rank"] for st in plan["stages"]) < plan["params"]  # tp=2 halves the sharded ones
    assert [st["pieces"][0] for st in plan["stages"]] == ["first", "blocks.2"]
    matmuls = n * 2 * d * f + d * v  # the MLPs and the head: 6 FLOPs per weight per token trained
    assert plan["flops_per_token"] == pytest.approx(6 * matmuls + n * 3 * 2 * s * d)  # + the causal mix (s·s·d)


@pytest.mark.parametrize(
    "target,message",
    [
        ("examples.no_such_module:build", "cannot import 'examples.no_such_module'"),
        ("examples.mixer_lm:nothing", "examples.mixer_lm.nothing is nothing, not a function"),
        ("builtins:repr", "returned str; expected parallel.pieces.ModelPieces"),
        ("examples.mixer_lm", "must name a function as <module>:<function>"),
    ],
)
def test_a_bad_target_is_refused_naming_the_path(target, message):
    rc = recipe(1, model__target=target)
    with pytest.raises(ConfigError, match=f"model.target={target}") as e:
        validate(rc, world_size=1)
    assert message in str(e.value)


def three_blocks(request):
    """A builder that ignores model.n_layers."""
    from examples.mixer_lm import build

    pieces = build(request)
    pieces.blocks = pieces.blocks[:3]
    return pieces


def test_the_block_count_and_unavailable_features_are_refused():
    with pytest.raises(ConfigError, match=r"returned 3 blocks but model.n_layers=4"):
        validate(recipe(1, model__target="tests.examples.test_mixer_lm:three_blocks"), world_size=1)
    with pytest.raises(ConfigError, match=r"with train.compile=true: not available"):
        validate(recipe(1, train__compile=True), world_size=1)
    assert callable(load_target("examples.mixer_lm.build"))  # the dotted form
