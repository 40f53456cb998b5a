"""The DDP → gridtrain migration (issue 13, level 1): ZeRO 0–3 gives DDP's losses, in a diff of ≤ 20 lines."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest

from parallel.testing import run_ranks
from recipes.tools.deepspeed import load_deepspeed_json

EXAMPLES = Path(__file__).parents[2] / "examples"
STEPS = 3


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect.getsource finds the file through it
    spec.loader.exec_module(module)
    return module


plain, grid = load("ddp_plain"), load("ddp_to_gridtrain")


def ds_json(tmp_path: Path, stage: int, precision: str = "fp32") -> str:
    """The plain script's settings as a DeepSpeed JSON, with a ZeRO stage and a precision."""
    c = plain.CONFIG
    ds = {
        "train_batch_size": c["global_batch"],
        "train_micro_batch_size_per_gpu": c["micro_batch"],
        "gradient_accumulation_steps": c["global_batch"] // (c["micro_batch"] * 2),
        "gradient_clipping": c["grad_clip"],
        "optimizer": {"type": "AdamW", "params": {k: c[k] for k in ("lr", "betas", "eps", "weight_decay")}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": c["warmup_steps"]}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},  # several buckets
        "bf16": {"enabled": precision == "bf16"},
    }
    path = tmp_path / f"ds_{stage}_{precision}.json"
    path.write_text(json.dumps(ds))
    return str(path)


def all_losses(jsons: dict[str, str]) -> dict[str, list[float]]:
    """On one rank: the plain script's losses ("ddp") and gridtrain's for each DeepSpeed JSON (one group for all)."""
    out = {"ddp": plain.main(-1, -1, argparse.Namespace(steps=STEPS))}
    for key, path in jsons.items():
        out[key] = grid.main(-1, -1, argparse.Namespace(steps=STEPS, deepspeed=path))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("ds")
    jsons = {f"zero{s}": ds_json(tmp, s) for s in range(4)} | {"zero3_bf16": ds_json(tmp, 3, "bf16")}
    out = run_ranks(all_losses, 2, jsons, timeout=90)
    assert out[0] == out[1]  # every rank reports the global mean
    return out[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gridtrain_losses_equal_ddp(runs, stage):
    assert runs[f"zero{stage}"] == pytest.approx(runs["ddp"], abs=1e-5, rel=0)
    assert len(set(runs["ddp"])) == STEPS  # the model trains: the losses move


def test_bf16_from_the_json_is_applied(runs):
    assert runs["zero3_bf16"] != pytest.approx(runs["ddp"], abs=1e-6, rel=0)  # bf16 rounding shows
    assert runs["zero3_bf16"] == pytest.approx(runs["ddp"], abs=5e-2, rel=0)


def test_diff_is_at_most_20_lines_and_the_model_code_is_identical():
    a, b = ((EXAMPLES / f"{n}.py").read_text().splitlines() for n in ("ddp_plain", "ddp_to_gridtrain"))
    changed = [line for line in difflib.unified_diff(a, b, lineterm="") if line[:1] in "+-" and line[1:2] not in "+-"]
    assert 0 < len(changed) <= 20, "\n".join(changed)
    for name in ("Net", "batch", "CONFIG"):
        if name == "CONFIG":  # gridtrain adds keys; the plain ones keep their values
            assert grid.CONFIG.items() >= plain.CONFIG.items()
        else:
            assert inspect.getsource(getattr(plain, name)) == inspect.getsource(getattr(grid, name))


def test_every_deepspeed_key_lands_on_a_setting_the_script_reads():
    """The shipped JSON's recipe keys, by their last part, are all keys of the script's CONFIG (none dropped)."""
    for path in (EXAMPLES / "ds_ddp_migration.json", EXAMPLES / "ds_config.json"):
        keys = {k.split(".")[1] for k in load_deepspeed_json(path, dp=2 if "migration" in path.name else 1)}
        assert keys <= set(grid.CONFIG), keys - set(grid.CONFIG)
