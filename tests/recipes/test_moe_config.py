"""MoE recipe keys: bad expert-parallel settings are refused by validate(), naming the numbers."""

import pytest

from recipes.config import ConfigError, RecipeConfig
from recipes.validation import validate


def _rc(preset="mixtral_tiny", dp=4, ep=2, **model):
    rc = RecipeConfig()
    rc.model.preset = preset
    rc.parallel.dp, rc.parallel.ep = dp, ep
    rc.train.global_batch, rc.train.micro_batch = 8, 2
    for k, v in model.items():
        setattr(rc.model, k, v)
    return rc


def test_valid_moe_layout():
    layout = validate(_rc(), world_size=4)
    assert layout.model.moe_experts == 4 and layout.dp == 4


@pytest.mark.parametrize(
    "rc,match",
    [
        (_rc(dp=4, ep=3), r"parallel.ep=3: ep 3 does not divide dp 4.*divisors of dp 4: \[1, 2, 4\]"),
        (_rc(preset="llama_tiny", dp=2, ep=2), r"parallel.ep=2: ep=2 needs an MoE model \(moe_experts > 0\); use ep=1"),
        (_rc(dp=4, ep=4, moe_experts=6), r"num_experts=6 is not divisible by ep=4"),
        (_rc(moe_top_k=5), r"top_k=5 must be between 1 and num_experts=4"),
    ],
)
def test_bad_moe_settings_are_refused(rc, match):
    with pytest.raises(ConfigError, match=match):
        validate(rc, world_size=rc.parallel.dp)


def test_fp16_with_moe_is_refused():
    rc = _rc()
    rc.train.precision = "fp16"
    with pytest.raises(ConfigError, match="fp16 with an MoE model"):
        validate(rc, world_size=4)


@pytest.mark.parametrize(
    "key,value,what",
    [
        ("offload", "optimizer", "offload=optimizer"),
        ("pp_schedule", "zb-h1", "pp_schedule=zb-h1"),
    ],
)
def test_unverified_moe_combinations_are_refused(key, value, what):
    rc = _rc(dp=2, ep=2)
    rc.parallel.tp, rc.parallel.pp, rc.parallel.zero = 2, 2, 1
    setattr(rc.parallel, key, value)
    with pytest.raises(ConfigError, match=f"MoE model.*{what}.*not implemented/verified"):
        validate(rc, world_size=8 * rc.parallel.cp)


def test_moe_with_context_parallelism_and_a_capacity_factor_is_refused():
    """cp routes dropless only (which assignments an expert drops depends on every token of the micro-batch);
    dropless MoE with cp trains as one process (test_moe_e2e) and is planned like any cp layout."""
    from parallel.layers.moe import CONTEXT_PARALLEL_CAPACITY_REFUSED
    from parallel.plan.moe import check_ep, moe_shape
    from recipes.config import model_config

    rc = _rc(dp=2, ep=2)
    rc.parallel.cp = 2
    validate(rc, world_size=4)  # dropless: accepted
    check_ep(moe_shape(model_config(rc.model)), 2, 2)
    rc.model.moe_capacity_factor = 1.25
    with pytest.raises(ConfigError) as e:
        validate(rc, world_size=4)
    assert str(e.value).endswith(CONTEXT_PARALLEL_CAPACITY_REFUSED)
    assert "parallel.cp=2, model.moe_capacity_factor=1.25" in str(e.value)
    # the planner refuses what training refuses, and recommend does not offer it
    from parallel.plan import PlanError

    shape = moe_shape(model_config(rc.model))
    with pytest.raises(PlanError) as e:
        check_ep(shape, 2, 2, cp=2)
    assert str(e.value) == CONTEXT_PARALLEL_CAPACITY_REFUSED
    check_ep(shape, 2, 2, cp=1)


def test_moe_with_sequence_parallelism_routes_dropless_only():
    """SP: a tp rank routes s/tp tokens of each sequence (test_moe_sp, test_moe_e2e): dropless is accepted
    and planned; a capacity factor is refused by the recipe and the planner in the layer's words."""
    from parallel.layers.moe import SEQUENCE_PARALLEL_CAPACITY_REFUSED
    from parallel.plan import PlanError
    from parallel.plan.moe import check_ep, moe_shape
    from recipes.config import model_config

    rc = _rc(dp=2, ep=2)
    rc.parallel.tp, rc.parallel.sequence_parallel = 2, True
    validate(rc, world_size=4)  # dropless: accepted
    check_ep(moe_shape(model_config(rc.model)), 2, 2, sequence_parallel=True)
    rc.model.moe_capacity_factor = 1.25
    with pytest.raises(ConfigError) as e:
        validate(rc, world_size=4)
    assert str(e.value).endswith(SEQUENCE_PARALLEL_CAPACITY_REFUSED)
    assert "parallel.sequence_parallel=true, model.moe_capacity_factor=1.25" in str(e.value)
    with pytest.raises(PlanError) as e:
        check_ep(moe_shape(model_config(rc.model)), 2, 2, sequence_parallel=True)
    assert str(e.value) == SEQUENCE_PARALLEL_CAPACITY_REFUSED
