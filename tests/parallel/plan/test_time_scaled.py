"""A profile rescaled to a machine ``f`` times slower (``Hardware.time_scaled``, what
``benchmarks/plan.py`` does with its speed probe) makes every planned time exactly ``f`` times longer:
every field is a rate, a fixed time or scale-free, and the planner's times are homogeneous in them."""

import dataclasses
import json

import pytest

from parallel.plan import PlanError, hardware_profile
from parallel.plan.hardware import HOST_FIELDS, RATE_FIELDS, SCALE_FREE_FIELDS, TIME_FIELDS, Hardware
from recipes.tools.plan import plan_from_config
from recipes.tools.plan_scenarios import scenario_config

TINY = ["model.preset=gpt_tiny", "model.d_model=64", "model.seq_len=32", "train.precision=fp32"]
# a calibrated-like CPU profile: every host term non-zero, so each one's scaling is exercised
HOST = dict(
    block_overhead_us=900.0,
    microbatch_overhead_us=300.0,
    step_overhead_us=400.0,
    collective_overhead_us=1200.0,
    colocated_slowdown=0.1,
    overlap_fraction=0.3,
    ahead_call_us=700.0,
    tp_call_us=150.0,
    gpus_per_node=4,
)


def test_every_field_is_a_rate_a_time_or_scale_free():
    fields = ({f.name for f in dataclasses.fields(Hardware)} | set(HOST_FIELDS)) - {"name", "host"}
    sets = [set(RATE_FIELDS), set(TIME_FIELDS), set(SCALE_FREE_FIELDS)]
    assert sum(len(s) for s in sets) == len(fields) and set().union(*sets) == fields
    for bad in (0.0, True, float("nan")):
        with pytest.raises(PlanError, match="factor"):
            hardware_profile("cpu").time_scaled(bad)


@pytest.mark.parametrize(
    "layout",
    [
        ["train.global_batch=8", "train.micro_batch=2"],
        ["parallel.dp=2", "parallel.zero=3", "train.global_batch=8", "train.micro_batch=4"],
        ["parallel.dp=2", "parallel.zero=1", "train.global_batch=8", "train.micro_batch=2"],
        ["parallel.tp=2", "train.global_batch=8", "train.micro_batch=4"],
        ["parallel.pp=2", "train.global_batch=8", "train.micro_batch=2"],
        ["parallel.dp=2", "parallel.zero=0", "train.global_batch=8", "train.micro_batch=4"],
        [
            "parallel.dp=2",
            "parallel.zero=1",
            "parallel.offload=optimizer",
            "train.global_batch=8",
            "train.micro_batch=4",
        ],
    ],
)
def test_a_rescaled_profile_scales_every_planned_time(tmp_path, layout):
    base = hardware_profile("cpu").replace(**HOST)
    plans = {}
    for name, hw in (("base", base), ("slow", base.time_scaled(1.37))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({k: v for k, v in dataclasses.asdict(hw).items() if k != "name"}))
        plans[name] = plan_from_config(scenario_config(TINY + layout + [f"plan.hardware={path}"]))
    for key in ("step_time_s", "unread_step_time_s"):
        assert plans["slow"].step[key] == pytest.approx(1.37 * plans["base"].step[key], rel=1e-9), key
    assert plans["slow"].step["step_time_s"] > 0
