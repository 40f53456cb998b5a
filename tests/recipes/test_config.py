"""Recipe config: every relation between keys checked up front, with numbers."""

import dataclasses

import pytest

from models.config import ModelConfig
from recipes.config import NOT_MODEL_FIELDS, ConfigError, ModelSection, RecipeConfig, model_config, validate


def make(**sections):
    rc = RecipeConfig()
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        setattr(getattr(rc, section), key, value)
    return rc


def test_default_is_valid_and_resolves_batch_arithmetic():
    lay = validate(make(train__global_batch=32, train__micro_batch=4), world_size=None)
    assert (lay.dp, lay.pp, lay.tp, lay.grad_accum) == (1, 1, 1, 8)
    lay = validate(make(parallel__pp=2, parallel__tp=2, train__global_batch=32, train__micro_batch=4), world_size=8)
    assert (lay.dp, lay.grad_accum, lay.world_size) == (2, 4, 8)


def test_model_section_mirrors_every_model_config_field():
    section = {f.name for f in dataclasses.fields(ModelSection)} - set(NOT_MODEL_FIELDS)
    assert section == {f.name for f in dataclasses.fields(ModelConfig)}
    mc = model_config(ModelSection(preset="gpt_tiny", n_layers=6))
    assert mc.n_layers == 6 and mc.d_model == 128


@pytest.mark.parametrize(
    "changes,world,needle",
    [
        (dict(parallel__pp=35, parallel__tp=8, parallel__dp=64), 8, "world size 8 ≠ dp 64 × pp 35 × tp 8 = 17920"),
        (dict(parallel__pp=3, parallel__tp=1), 8, "mode=plan"),
        (
            dict(train__global_batch=30, train__micro_batch=4, parallel__dp=2),
            2,
            "train.global_batch 30 is not a multiple of micro_batch 4 × dp 2 = 8",
        ),
        (dict(parallel__tp=3), None, "n_heads 4 is not divisible by tp 3"),
        (dict(parallel__pp=5), None, "5 stages but the model has 4 layers; use pp·vpp ≤ 4"),
        (dict(parallel__pp_schedule="zigzag"), None, "parallel.pp_schedule='zigzag' is not one of"),
        (dict(train__precision="fp4"), None, "train.precision='fp4'"),
        (dict(train__fp8_recipe="blockwise"), None, "train.fp8_recipe='blockwise' is not one of"),
        (dict(train__precision="fp8", parallel__cp=2), None, "fp8 scales are taken per rank's sequence chunk"),
        (dict(parallel__pp_layers=[1, 2], parallel__pp=2), None, "summing to model.n_layers 4"),
        (
            dict(parallel__sequence_parallel=True),
            None,
            "parallel.sequence_parallel=true, parallel.tp=1: sequence parallelism needs tp > 1",
        ),
        (dict(parallel__vpp=2), None, "needs parallel.pp_schedule=interleaved"),
        (dict(data__source="memmap"), None, "needs data.path"),
        (
            dict(comm__compression="topk", parallel__zero=1),
            None,
            "comm.compression=topk, parallel.zero=1: Top-K compression needs ZeRO stage 0",
        ),
        (dict(train__micro_batch=0), None, "train.micro_batch must be a positive integer"),
        (dict(parallel__dp="two"), None, "parallel.dp must be a positive integer or 'auto'"),
        (dict(parallel__pp_schedule="interleaved", parallel__vpp=2), None, "needs parallel.pp ≥ 2"),
        (
            dict(
                parallel__pp=2,
                parallel__pp_schedule="interleaved",
                parallel__vpp=2,
                train__global_batch=12,
                train__micro_batch=4,
            ),
            None,
            "(micro_batch 4 × dp 1) = 3) to be a multiple of pp 2",
        ),
        (dict(train__eval_every=10, train__eval_batches=0), None, "train.eval_batches must be ≥ 1"),
    ],
)
def test_bad_configs_are_refused_with_numbers(changes, world, needle):
    with pytest.raises(ConfigError) as e:
        validate(make(**changes), world_size=world)
    assert needle in str(e.value)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="model.preset='gpt5'"):
        model_config(ModelSection(preset="gpt5"))


def test_mp_is_an_alias_of_tp():
    rc = make(parallel__mp=2)
    assert validate(rc, world_size=2).tp == 2 and rc.parallel.tp == 2
    with pytest.raises(ConfigError, match="parallel.mp=2 and parallel.tp=4 disagree"):
        validate(make(parallel__mp=2, parallel__tp=4), world_size=None)


def test_more_torchrun_ranks_than_gpus_is_one_config_error_before_any_worker_code(monkeypatch):
    """Under torchrun with NCCL (the default on a CUDA machine), a node with fewer GPUs than local
    ranks is refused in preflight with the numbers, not inside init_distributed with a traceback."""
    import torch
    import torch.distributed as dist

    from recipes.config import ConfigError
    from recipes.training.preflight import check_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"parallel.backend=nccl: this node runs 4 ranks .* sees 2 GPU"):
        check_backend(None)
    check_backend("gloo")  # the CPU backend needs no GPU per rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_backend(None)
