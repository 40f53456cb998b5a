"""DeepSpeed-style JSON → recipe keys, with every unsupported key reported."""

import json

import pytest

from recipes.config import ConfigError, RecipeConfig, validate
from recipes.tools.deepspeed import apply_deepspeed, deepspeed_overrides, load_deepspeed_json

DS = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8},
    "communication_data_type": "bf16",
    "bf16": {"enabled": True},
    "fp16": {"enabled": False},
}


def test_maps_every_supported_key():
    out = deepspeed_overrides(DS, dp=2)
    assert out == {
        "train.global_batch": 64,
        "train.micro_batch": 4,
        "train.grad_clip": 1.0,
        "optim.name": "adamw",
        "optim.lr": 3e-4,
        "optim.betas": [0.9, 0.95],
        "optim.eps": 1e-8,
        "optim.weight_decay": 0.1,
        "parallel.zero": 2,
        "comm.overlap": True,
        "comm.bucket_mb": pytest.approx(5e8 * 4 / 2**20),
        "comm.dtype": "bf16",
        "train.precision": "bf16",
    }


def test_batch_identity_is_checked_with_numbers():
    with pytest.raises(ConfigError, match=r"train_batch_size 64 ≠ .* 4 × gradient_accumulation_steps 8 × dp 4 = 128"):
        deepspeed_overrides(DS, dp=4)
    derived = deepspeed_overrides({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, dp=4)
    assert derived["train.global_batch"] == 24
    derived = deepspeed_overrides({"train_batch_size": 24, "gradient_accumulation_steps": 3}, dp=4)
    assert derived["train.micro_batch"] == 2


def test_unsupported_keys_are_listed_not_ignored():
    bad = dict(DS, activation_checkpointing={"cpu_checkpointing": True}, optimizer={"type": "Lamb", "params": {}})
    with pytest.raises(ConfigError) as e:
        deepspeed_overrides(bad, dp=2)
    msg = str(e.value)
    assert "activation_checkpointing.cpu_checkpointing=True" in msg
    assert "optimizer.type='Lamb'" in msg


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_deepspeed_json(tmp_path / "none.json", dp=1)
    p = tmp_path / "ds.json"
    p.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_deepspeed_json(p, dp=1)
    p.write_text(json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="both fp16 and bf16"):
        load_deepspeed_json(p, dp=1)


def test_applied_onto_a_recipe_config(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(
        json.dumps(
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 4,
                "zero_optimization": {"stage": 3},
                "fp16": {"enabled": True},
            }
        )
    )
    rc = RecipeConfig()
    apply_deepspeed(rc, p, dp=2)
    assert (rc.train.global_batch, rc.train.micro_batch, rc.parallel.zero, rc.train.precision) == (16, 2, 3, "fp16")
    assert validate(rc, world_size=2).grad_accum == 4


def test_auto_values_are_refused_by_name():
    with pytest.raises(ConfigError, match="'auto'.*train_batch_size, train_micro_batch_size_per_gpu"):
        deepspeed_overrides({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, dp=1)


def test_the_readme_example_file_maps_and_validates():
    from pathlib import Path

    rc = RecipeConfig()
    apply_deepspeed(rc, Path(__file__).parents[2] / "examples" / "ds_config.json", dp=1)
    assert (rc.train.global_batch, rc.train.micro_batch, rc.parallel.zero, rc.optim.warmup_steps) == (16, 4, 1, 20)
    assert validate(rc, world_size=1).grad_accum == 4


@pytest.mark.parametrize(
    "optimizer,param,mode",
    [("cpu", None, "optimizer"), ("cpu", "cpu", "optimizer+params"), ("none", "none", "none")],
)
def test_offload_devices_map_onto_parallel_offload(optimizer, param, mode):
    zo = {"stage": 3, "offload_optimizer": {"device": optimizer, "pin_memory": True}}
    if param is not None:
        zo["offload_param"] = {"device": param, "pin_memory": True}
    out = deepspeed_overrides({"zero_optimization": zo}, dp=1)
    assert out == {"parallel.zero": 3, "parallel.offload": mode}
    rc = RecipeConfig()
    rc.parallel.zero, rc.parallel.offload = 3, mode
    validate(rc)


@pytest.mark.parametrize(
    "zo,named",
    [
        ({"offload_optimizer": {"device": "nvme"}}, "NVMe offload is not implemented"),
        ({"offload_param": {"device": "cpu"}}, "set both"),
    ],
)
def test_offload_settings_gridtrain_cannot_honour_are_refused(zo, named):
    with pytest.raises(ConfigError, match=named):
        deepspeed_overrides({"zero_optimization": {"stage": 3, **zo}}, dp=1)


@pytest.mark.parametrize("zero,mode,fix", [(0, "optimizer", "parallel.zero=1"), (2, "optimizer+params", "zero=3")])
def test_offload_needs_a_zero_stage_that_shards_what_it_moves(zero, mode, fix):
    rc = RecipeConfig()
    rc.parallel.zero, rc.parallel.offload = zero, mode
    with pytest.raises(ConfigError, match=fix):
        validate(rc)
