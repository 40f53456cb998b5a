"""The breakdown's arithmetic (``benchmarks/plan.py --breakdown``): a step's measured parts from the
timing hooks and ``parallel.comm``'s counter summaries, and the planner's parts of the same layout in
the same categories. Pure: no process is started."""

import statistics

import pytest

from recipes.tools.plan import plan_from_config
from recipes.tools.plan_scenarios import scenario_config
from recipes.training.reports import format_breakdown, measured_parts, predicted_parts


def _sample(step, run, opt, rq, ag_calls, ag_wait, ar_wait_opt):
    whole = {"dp": {"all_gather": {"calls": ag_calls, "wait_s": ag_wait}, "all_reduce": {"calls": 1, "wait_s": 0.5}}}
    in_opt = {"dp": {"all_reduce": {"calls": 0, "wait_s": ar_wait_opt}}}  # waited in ZeRO's step, issued before
    return dict(step_s=step, runqueue_s=rq, run_s=run, optimizer_step_s=opt, comm=whole, comm_in_optimizer_step=in_opt)


def test_measured_parts_are_medians_of_each_steps_own_split():
    samples = [_sample(10.0, 7.0, 2.0, 0.1, 18, 3.0, 0.4), _sample(12.0, 8.0, 3.0, 0.3, 18, 1.0, 0.2)]
    samples.append(_sample(11.0, 7.5, 2.5, 0.2, 18, 2.0, 0.3))
    m = measured_parts(samples)
    assert (m["step_s"], m["forward_backward_s"], m["optimizer_step_s"], m["runqueue_s"]) == (11.0, 7.5, 2.5, 0.2)
    # the executor less what was blocked in it: 7 − (3 + 0.5 − 0.4), 8 − (1 + 0.5 − 0.2), 7.5 − (2 + 0.5 − 0.3)
    assert m["compute_s"] == pytest.approx(statistics.median([3.9, 6.7, 5.3]))
    assert m["optimizer_s"] == pytest.approx(2.2) and m["rest_s"] == pytest.approx(1.0)
    ag = m["comm"]["dp all_gather"]
    assert (ag["calls"], ag["wait_s"], ag["wait_in_optimizer_step_s"]) == (18, 2.0, 0.0)
    assert m["comm"]["dp all_reduce"]["wait_in_optimizer_step_s"] == pytest.approx(0.3)
    assert measured_parts([]) == {}


def test_predicted_parts_count_the_engines_calls_and_print_beside_the_measured():
    rc = scenario_config(
        ["model.preset=gpt_tiny", "model.d_model=64", "model.seq_len=32", "parallel.dp=2", "parallel.zero=3"]
        + ["train.global_batch=8", "train.micro_batch=4", "plan.hardware=cpu"]
    )
    p = predicted_parts(plan_from_config(rc))
    blocks = 4  # gpt_tiny: each block and the rest are two buckets (weights; biases and norms)
    assert p["comm"]["dp all_gather"]["calls"] == 2 * 2 * blocks + 2
    assert p["comm"]["dp reduce_scatter"]["calls"] == 2 * blocks + 2
    assert p["step_s"] >= p["pipeline_s"] >= p["compute_s"] > 0
    samples = [_sample(0.05, 0.04, 0.005, 0.001, 18, 0.003, 0.001)]
    text = format_breakdown("dp=2 ZeRO-3", measured_parts(samples), p)
    assert "dp all_gather" in text and "predicted" in text and "µs/call" in text


def test_the_executors_own_waits_when_counted_apart():
    """The loss's all-reduce (0.5 s here) is issued after the executor's run: with the run's waits
    counted apart, compute is the run less only those (7 − 3), not less the loss's wait too."""
    s = _sample(10.0, 7.0, 2.0, 0.1, 18, 3.0, 0.4)
    s["comm_in_run"] = {"dp": {"all_gather": {"calls": 18, "wait_s": 3.0}}}
    assert measured_parts([s])["compute_s"] == pytest.approx(4.0)
