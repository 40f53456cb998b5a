"""``train.compile`` reaches the planner from the recipe (``mode=plan``, the trainer's memory report), and
``mode=dryrun`` refuses it by name (its ranks run under a dispatch mode torch.compile cannot trace)."""

import pytest
import torch

from parallel.plan.memory import layer_activation_bytes, stage_activation_bytes
from recipes.config import ConfigError, model_config
from recipes.tools import dryrun
from recipes.tools.plan import compile_priced, plan_footer, plan_from_config
from recipes.tools.plan_scenarios import scenario_config

LLAMA = ["model.preset=llama_tiny", "train.precision=bf16", "train.micro_batch=2", "train.global_batch=2"]


def _activations(plan) -> float:
    return plan.ranks[0].memory["activations"]


@pytest.mark.parametrize("ckpt", ["none", "selective"])
def test_plan_prices_train_compile(ckpt):
    overrides = [*LLAMA, f"model.activation_checkpointing={ckpt}"]
    eager, compiled, traced = (
        plan_from_config(scenario_config([*overrides, *extra]))
        for extra in ([], ["train.compile=true"], ["train.compile=true", "train.compile_backend=eager"])
    )
    assert compiled.training["compiled"] and not eager.training["compiled"]
    assert not traced.training["compiled"]  # dynamo alone saves what eager saves
    assert _activations(traced) == _activations(eager)
    rc = scenario_config(overrides)
    shape, n = model_config(rc.model), model_config(rc.model).n_layers
    kw = dict(checkpointing=ckpt, precision="bf16")
    per_layer = layer_activation_bytes(shape, 2, **kw) - layer_activation_bytes(shape, 2, compiled=True, **kw)
    head = stage_activation_bytes(shape, 2, 0, has_embedding=False, has_head=True, precision="bf16")
    head -= stage_activation_bytes(shape, 2, 0, has_embedding=False, has_head=True, precision="bf16", compiled=True)
    assert _activations(eager) - _activations(compiled) == pytest.approx(n * per_layer + head)
    assert "train.compile priced" in plan_footer(compiled)[0] and "compile" not in plan_footer(eager)[0]


def test_compile_priced_follows_the_backend():
    assert compile_priced(scenario_config(["train.compile=true"]))
    assert compile_priced(scenario_config(["train.compile=true", "train.compile_backend=aot_eager"]))
    assert not compile_priced(scenario_config(["train.compile=true", "train.compile_backend=eager"]))
    assert not compile_priced(scenario_config([]))


def test_dry_run_refuses_train_compile_by_name(tmp_path):
    rc = scenario_config(["mode=dryrun", "train.compile=true"])
    with pytest.raises(ConfigError, match=r"train.compile=true: .*meta tensors.*mode=plan prices train.compile"):
        dryrun.run_dryrun(rc, str(tmp_path))


def _compiled_run_saves(rc) -> int:
    """Bytes a compiled model (blocks and loss, inductor) saves over one micro-batch, storages once."""
    from models.compiled import compile_stage
    from models.transformer import build_model
    from parallel.memory import SavedActivationMeter

    cfg = model_config(rc.model)
    model = build_model(cfg, seed=0, dtype=torch.bfloat16)
    compile_stage(model, "inductor")
    ids = torch.randint(
        0, cfg.vocab_size, (rc.train.micro_batch, cfg.seq_len), generator=torch.Generator().manual_seed(0)
    )
    model.loss(model(ids), ids).backward()  # compiles
    meter = SavedActivationMeter(model.parameters())
    with meter:
        loss = model.loss(model(ids), ids)
    loss.backward()
    return meter.bytes


def test_a_compiled_run_matches_its_plan():
    """What the trainer's first-step report sets side by side (recipes/training/reports.py): a compiled
    run's activations against the plan with train.compile priced; the eager plan misses them by more."""
    from parallel.plan import predicted_vs_measured
    from parallel.testing import run_ranks

    overrides = [*LLAMA, "model.d_model=64", "model.seq_len=32", "model.activation_checkpointing=selective"]
    rc = scenario_config([*overrides, "train.compile=true"])
    measured = run_ranks(_compiled_run_saves, 1, rc, timeout=300)[0]
    plan = plan_from_config(rc)
    # what one micro-batch stores, to the byte, but the CPU generator's state each checkpointed core saves
    # (a compiled region's saved tensor; host memory on a GPU)
    rng_states = model_config(rc.model).n_layers * torch.get_rng_state().numel()
    assert measured - rng_states == plan.ranks[0].activation_per_microbatch
    compiled = predicted_vs_measured(plan, 0, {"activations": measured})["activations"]
    eager = predicted_vs_measured(plan_from_config(scenario_config(overrides)), 0, {"activations": measured})
    assert compiled["ok"], compiled
    assert abs(compiled["error"]) < abs(eager["activations"]["error"]) - 0.1, (compiled, eager)


def test_advice_offers_compile_where_it_holds_less():
    big = ["model.preset=llama_7b", "train.precision=bf16", "parallel.dp=8", "parallel.zero=1"]
    big += ["train.micro_batch=1", "train.global_batch=8", "plan.hardware=h100_80gb"]
    offered = [a for a in plan_from_config(scenario_config(big)).advice if a.startswith("train.compile=true")]
    compiled = plan_from_config(scenario_config([*big, "train.compile=true"]))
    assert len(offered) == 1 and "less per rank" in offered[0], offered
    assert f"peak {compiled.peak_memory / 1e9:.2f} GB" in offered[0]
    assert not any("train.compile" in a for a in compiled.advice)  # asked for already
    gpt = plan_from_config(scenario_config(["model.preset=gpt_tiny"]))  # LayerNorm, GELU: the same bytes
    assert not any("train.compile" in a for a in gpt.advice)
