"""``recommend`` searches the schedule (1F1B, ZB-H1, interleaved × vpp) with the rest, ranks by predicted
step time within the memory limit, never pairs zb-h1 with what the recipe refuses, and its first answer
carries no advice of the planner's own about what the search tunes."""

import dataclasses

import pytest

from parallel.pipeline.schedules import zero_bubble_problem
from parallel.plan import Layout, ModelShape, Training, hardware_profile, plan_layout, recommend
from parallel.plan.memory import StageParams
from parallel.plan.search import schedules

SHAPE = ModelShape(
    arch="gpt", n_layers=24, d_model=1024, n_heads=16, n_kv_heads=16, d_ff=4096, vocab_size=32000, seq_len=1024
)
HW = dataclasses.replace(hardware_profile("a100_80gb"), memory_bytes=2e9)  # too small for one replica per device


def count(layers, has_embedding, has_head, tp):
    """12·d² per block, V·d for the embedding and for the head (tp-sharded)."""
    d, v = SHAPE.d_model, SHAPE.padded_vocab(tp)
    p = StageParams(numel=len(layers) * 12 * d * d // tp, full=len(layers) * 12 * d * d)
    for present in (has_embedding, has_head):
        if present:
            p = p + StageParams(v * d // tp, full=v * d)
    return p


@pytest.fixture(scope="module")
def plans():
    return recommend(SHAPE, 8, Training(32, 1), HW, count, top=40, micro_batches=(1, 2), zeros=(0, 1))


def test_the_fastest_fitting_schedule_comes_first(plans):
    top = plans[0]
    # pp = 4: at pp = 2, micro-batches of 2 no longer fit 2 GB once the last stage's deferred micro-batch
    # holds what W reads (plan/deferred.py: deferred_stage_bytes), and pp = 2's micro-batches of 1 are slower
    assert (top.layout["schedule"], top.layout["pp"]) == ("zb-h1", 4)
    times = [p.step["step_time_s"] for p in plans]
    assert times == sorted(times) and all(p.peak_memory <= HW.memory_bytes for p in plans)
    same = {k: top.layout[k] for k in ("dp", "pp", "tp", "cp", "ep", "zero", "sequence_parallel")}
    one_f = plan_layout(SHAPE, Layout(**same, schedule="1f1b"), Training(32, top.training["micro_batch"]), HW, count)
    assert one_f.step["bubble_fraction"] > top.step["bubble_fraction"]
    assert one_f.step["step_time_s"] > top.step["step_time_s"]
    assert top.advice == []  # nothing the planner would tell it to change


def test_zb_h1_only_where_the_recipe_runs_it(plans):
    seen = {(p.layout["schedule"], p.training["checkpointing"], p.layout["zero"]) for p in plans}
    assert ("zb-h1", "none", 1) in seen and ("1f1b", "selective", 1) in seen
    for schedule, ckpt, zero in seen:
        assert not zero_bubble_problem(schedule, ckpt, zero)
    assert schedules(1, 24, False) == [("1f1b", 1)]
    assert schedules(4, 24, False) == [("1f1b", 1), ("zb-h1", 1)] + [("interleaved", v) for v in range(2, 7)]
    assert schedules(4, 24, True)[1] == ("interleaved", 2)  # MoE: no zb-h1


def test_bubble_advice_names_only_fixes_the_recipe_can_run():
    """6 micro-batches over pp=4 cannot interleave (4 can); zb-h1 is named only without recomputation;
    a micro-batch of 1 cannot be lowered."""

    def advice(m, ckpt, schedule="1f1b", mb=1):
        p = plan_layout(SHAPE, Layout(pp=4, schedule=schedule), Training(m * mb, mb, checkpointing=ckpt), HW, count)
        assert p.step["bubble_fraction"] > 0.2
        return " ".join(p.advice)

    assert "interleaved" not in advice(6, "none") and "zb-h1" in advice(6, "none")
    assert "interleaved" in advice(4, "selective") and "zb-h1" not in advice(4, "selective")
    assert "lower the micro-batch" not in advice(6, "none")
    assert "lower the micro-batch below 2" in advice(4, "none", mb=2)
    assert "zb-h1" not in advice(4, "none", "zb-h1")
