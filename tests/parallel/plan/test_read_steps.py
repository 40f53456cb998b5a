"""A logged step against an unread one (issue 16 §3): an unread step issues no loss scalar
(``parallel.engine.PendingLoss``) and, without clipping, fp16 or offload, no gradient norm
(``ZeroDataParallel.step(norm=False)``); the planner prices both steps and the first-step report
compares like with like."""

import pytest

from parallel.plan.exposure import norm_every_step
from recipes.tools.plan import plan_from_config
from recipes.tools.plan_scenarios import scenario_config
from recipes.training.reports import format_time_comparison

TINY = ["model.preset=gpt_tiny", "model.d_model=64", "model.seq_len=32", "train.precision=fp32", "plan.hardware=cpu"]


def _plan(*overrides):
    return plan_from_config(scenario_config(TINY + ["train.global_batch=8", "train.micro_batch=2", *overrides]))


def _one_scalar(plan) -> float:
    """One blocking 4-byte all-reduce over dp=2 on the profile: the ring's two latency steps and the
    host's fixed cost (its 4 bytes take nanoseconds)."""
    hw = plan.hardware
    return 2 * hw["latency_us"] * 1e-6 + (hw["host"] or {"collective_overhead_us": 0})["collective_overhead_us"] * 1e-6


@pytest.mark.parametrize("zero", [0, 1])
def test_a_logged_step_adds_the_loss_and_unless_clipping_the_norm(zero):
    clip, no_clip = (
        _plan("parallel.dp=2", f"parallel.zero={zero}"),
        _plan("parallel.dp=2", f"parallel.zero={zero}", "train.grad_clip=0"),
    )
    one = _one_scalar(clip)
    for p in (clip, no_clip):
        s = p.step
        assert s["read_extra_s"] == pytest.approx(s["step_time_s"] - s["unread_step_time_s"])
    # clipping computes the norm every step: reading adds the loss's all-reduce only
    assert clip.step["read_extra_s"] == pytest.approx(one, rel=1e-3)
    # without clipping the norm is a logged step's too: over DP only when the optimizer is sharded
    assert no_clip.step["read_extra_s"] == pytest.approx(one * (1 + zero), rel=1e-3)
    assert no_clip.step["step_time_s"] == pytest.approx(clip.step["step_time_s"])  # the logged step is the same


def test_pipeline_reading_adds_the_loss_broadcast_and_the_norm():
    clip, no_clip = _plan("parallel.pp=2"), _plan("parallel.pp=2", "train.grad_clip=0")
    hw = clip.hardware
    assert hw["host"] is None  # the stock profile: a scalar costs its ring's latency steps
    step = hw["latency_us"] * 1e-6
    # the last stage's loss, broadcast over pp=2 (one step); without clipping + the norm's all-reduce (two)
    assert clip.step["read_extra_s"] == pytest.approx(step, rel=1e-3)
    assert no_clip.step["read_extra_s"] == pytest.approx(3 * step, rel=1e-3)


def test_when_the_engine_computes_the_norm_unread():
    assert norm_every_step(1.0, "fp32", "none") and norm_every_step(0.0, "fp16", "none")
    assert norm_every_step(0.0, "bf16", "optimizer") and not norm_every_step(0.0, "bf16", "none")


def test_the_first_step_report_compares_like_with_like():
    plan = _plan("parallel.dp=2", "parallel.zero=1", "train.grad_clip=0")
    logged, unread = plan.step["step_time_s"], plan.step["unread_step_time_s"]
    assert unread < logged
    assert f"(logged step): predicted {logged:.3f} s" in format_time_comparison(plan, logged)
    text = format_time_comparison(plan, unread, read=False)
    assert f"(unread step): predicted {unread:.3f} s" in text and "+0%" in text
    assert "step scalars" in text  # the step's tp/pp scalars are a part too


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_a_bad_grad_clip_is_refused(bad):
    import dataclasses

    from parallel.plan import PlanError, hardware_profile, plan_layout
    from parallel.plan.inputs import Layout
    from recipes.config import model_config
    from recipes.tools.plan import _training, meta_param_counter

    rc = scenario_config(TINY + ["train.global_batch=8", "train.micro_batch=2"])
    mc = model_config(rc.model)
    training = dataclasses.replace(_training(rc, mc), grad_clip=bad)
    with pytest.raises(PlanError, match="grad_clip must be a finite number"):
        plan_layout(mc, Layout(), training, hardware_profile("cpu"), meta_param_counter(mc))


def test_a_middle_zero3_stage_blocks_on_no_phantom_reduction():
    """A pipeline stage holding blocks only has no rest unit: the reductions that block when its
    backward ends are its first unit's buckets (weights; biases and norms), not one more."""

    from parallel.plan import hardware_profile, plan_layout
    from parallel.plan.inputs import Layout
    from recipes.config import model_config
    from recipes.tools.plan import _training, meta_param_counter

    rc = scenario_config(TINY + ["model.n_layers=8", "train.global_batch=8", "train.micro_batch=2"])
    mc = model_config(rc.model)  # pp=4: two blocks per stage, four buckets
    # only the fixed cost of a blocking call is priced: 1 ms each, nothing else
    hw = hardware_profile("cpu").replace(
        latency_us=0.0,
        collective_overhead_us=1000.0,
        ahead_call_us=0.0,
        intra_node_gbps=1e9,
        inter_node_gbps=1e9,
        colocated_slowdown=0.0,
    )
    plan = plan_layout(mc, Layout(dp=2, pp=4, zero=3), _training(rc, mc), hw, meta_param_counter(mc))
    m = plan.grad_accum
    middle = plan.ranks[1].traffic["dp"]["by_kind"]["reduce_scatter"]
    assert middle["calls"] == m * 4
    assert middle["seconds"] == pytest.approx(m * 2 * 1e-3, rel=1e-3)  # its first unit's two buckets block


def test_tp_call_cost_enters_each_tp_collective_of_the_model():
    """``tp_call_us`` (the in-situ cost of TP's collectives, ``mode=calibrate``): every TP collective
    the model issues adds it to the step, the step's norm scalar does not (it is not inside the model),
    and nothing at tp = 1; the collectives' own seconds (what the breakdown times) are unchanged."""

    from parallel.plan import hardware_profile, plan_layout
    from parallel.plan.inputs import Layout
    from recipes.config import model_config
    from recipes.tools.plan import _training, meta_param_counter

    rc = scenario_config(TINY + ["train.global_batch=8", "train.micro_batch=2"])
    mc = model_config(rc.model)
    base = hardware_profile("cpu")
    costly = base.replace(tp_call_us=250.0)

    def plan(hw, tp):
        return plan_layout(mc, Layout(tp=tp), _training(rc, mc), hw, meta_param_counter(mc))

    a, b = plan(base, 2), plan(costly, 2)
    model_calls = a.ranks[0].traffic["tp"]["by_kind"]["all_reduce"]["calls"] - 1  # less the norm's scalar
    assert model_calls == a.grad_accum * (4 * mc.n_layers + 4)  # blocks, embedding, head, cross-entropy ×2
    assert b.step["step_time_s"] - a.step["step_time_s"] == pytest.approx(model_calls * 250e-6, rel=1e-9)
    assert b.ranks[0].traffic["tp"]["time_s"] == a.ranks[0].traffic["tp"]["time_s"]
    assert plan(costly, 1).step["step_time_s"] == plan(base, 1).step["step_time_s"]
