"""The planner on a small model: schedules, recomputation, overlap, accumulation, bad input."""

import dataclasses

import pytest

from parallel.plan import (
    Layout,
    ModelShape,
    PlanError,
    StageParams,
    Training,
    check,
    hardware_profile,
    layer_activation_bytes,
    plan_layout,
    predicted_vs_measured,
    recommend,
    resolve,
)
from parallel.plan.report import format_comparison

SHAPE = ModelShape(arch="gpt", n_layers=8, d_model=64, n_heads=4, n_kv_heads=4, d_ff=256, vocab_size=256, seq_len=16)
HW = hardware_profile("a100_80gb")


def count(layers, has_embedding, has_head, tp):
    """A stand-in for the meta-model counter: 12·d² per block, V·d for embedding and head."""
    d, v = SHAPE.d_model, SHAPE.padded_vocab(tp)
    p = StageParams(numel=len(layers) * 12 * d * d // tp, full=len(layers) * 12 * d * d)
    if has_embedding:
        p = p + StageParams(v * d // tp, full=v * d)
    if has_head:
        p = p + StageParams(v * d // tp, full=v * d)
    return p


def plan(layout=Layout(), **training):
    tr = dict(global_batch=16, micro_batch=2, precision="bf16")
    return plan_layout(SHAPE, layout, Training(**{**tr, **training}), HW, count)


def test_1f1b_first_stage_holds_pp_micro_batches_gpipe_all():
    p = plan(Layout(dp=1, pp=4))  # 8 micro-batches
    assert [r.in_flight for r in p.ranks] == [4, 3, 2, 1]
    g = plan(Layout(dp=1, pp=4, schedule="gpipe"))
    assert [r.in_flight for r in g.ranks] == [8, 8, 8, 8]
    # the stored micro-batches double; a block's backward workspace (the transient) is the same
    transient = [r.memory["activations"] - r.in_flight * r.activation_per_microbatch for r in (g.ranks[0], p.ranks[0])]
    assert transient[0] == transient[1] > 0
    assert g.ranks[0].activation_per_microbatch == p.ranks[0].activation_per_microbatch


def test_recomputation_lowers_activations_and_raises_compute():
    runs = {c: plan(Layout(pp=2), checkpointing=c) for c in ("none", "selective", "full")}
    act = {c: p.ranks[0].memory["activations"] for c, p in runs.items()}
    comp = {c: p.step["compute_s"] for c, p in runs.items()}
    assert act["none"] > act["selective"] > act["full"]
    assert comp["none"] < comp["selective"] < comp["full"]
    for tp in (1, 2, 4):
        per = [layer_activation_bytes(SHAPE, 2, tp=tp, checkpointing=c) for c in ("none", "selective", "full")]
        assert per == sorted(per, reverse=True)


def test_sequence_parallel_and_tp_lower_activations():
    base = layer_activation_bytes(SHAPE, 4)
    tp = layer_activation_bytes(SHAPE, 4, tp=4)
    sp = layer_activation_bytes(SHAPE, 4, tp=4, sequence_parallel=True)
    assert base > tp > sp


def test_gradient_accumulation_communicates_once_per_step():
    """ZeRO-0/1: the DP bytes of a step do not grow with micro-batches; ZeRO-2 reduces every one."""
    for zero, grows in ((0, False), (1, False), (2, True)):
        one = plan(Layout(dp=4, zero=zero), global_batch=8).ranks[0].traffic["dp"]["bytes"]
        four = plan(Layout(dp=4, zero=zero), global_batch=32).ranks[0].traffic["dp"]["bytes"]
        assert (four > one) == grows, zero


def test_overlap_hides_dp_behind_backward():
    slow = dataclasses.replace(HW, intra_node_gbps=0.01, inter_node_gbps=0.01)
    small = 0.01  # MB: many buckets, each reduced as soon as its gradients are ready
    on = plan_layout(SHAPE, Layout(dp=8), Training(16, 2, overlap=True, bucket_mb=small), slow, count)
    off = plan_layout(SHAPE, Layout(dp=8), Training(16, 2, overlap=False, bucket_mb=small), slow, count)
    assert on.step["dp_exposed_s"] < off.step["dp_exposed_s"]
    one = plan_layout(SHAPE, Layout(dp=8), Training(16, 2, overlap=True, bucket_mb=1e3), slow, count)
    assert one.step["dp_exposed_s"] == pytest.approx(one.ranks[0].traffic["dp"]["time_s"])  # one bucket: after backward
    assert off.step["dp_exposed_s"] == pytest.approx(on.ranks[0].traffic["dp"]["time_s"])


def test_tp_across_nodes_is_priced_and_flagged():
    small_nodes = dataclasses.replace(HW, gpus_per_node=2)
    inside = plan(Layout(tp=2))
    across = plan_layout(SHAPE, Layout(tp=4), Training(16, 2), small_nodes, count)
    assert not inside.ranks[0].traffic["tp"]["crosses_node"]
    assert across.ranks[0].traffic["tp"]["crosses_node"]
    assert any("spans nodes" in a for a in across.advice)


def test_bad_input_names_the_numbers():
    tr = Training(16, 2)
    with pytest.raises(
        PlanError, match=r"n_heads 4 is not divisible by tp 3; choose tp among the divisors of 4: \[1, 2, 4\]"
    ):
        check(SHAPE, Layout(tp=3), tr)
    with pytest.raises(PlanError, match="pp 16 × vpp 1 = 16 stages but the model has 8 layers"):
        check(SHAPE, Layout(pp=16), tr)
    with pytest.raises(PlanError, match="world size 16 ≠ dp 2 × pp 2 × tp 2 = 8"):
        check(SHAPE, Layout(dp=2, pp=2, tp=2), tr, world_size=16)
    with pytest.raises(PlanError, match="global_batch 16 is not a multiple of micro_batch 2 × dp 3 = 6"):
        check(SHAPE, Layout(dp=3), tr)
    with pytest.raises(PlanError, match="zero=5"):
        check(SHAPE, Layout(zero=5), tr)
    with pytest.raises(PlanError, match="vpp=2 needs pp_schedule=interleaved"):
        check(SHAPE, resolve(SHAPE, pp=2, vpp=2), tr)
    with pytest.raises(
        PlanError,
        match=r"micro-batches per step \(global_batch 16 / \(micro_batch 2 × dp 1\) = 8\) to be a multiple of pp 3",
    ):
        check(SHAPE, Layout(pp=3, vpp=2, schedule="interleaved"), tr)
    with pytest.raises(PlanError, match=r"Top-K compression needs ZeRO stage 0 .*got stage 2"):
        check(SHAPE, resolve(SHAPE, dp=2, zero=2, compression="topk"), tr)


def test_interleaving_shrinks_the_bubble():
    slow = dataclasses.replace(HW, peak_tflops_16=1e-3)  # compute-bound, not p2p-latency-bound
    plain = plan_layout(SHAPE, Layout(pp=2), Training(16, 2), slow, count)
    inter = plan_layout(SHAPE, Layout(pp=2, vpp=2, schedule="interleaved"), Training(16, 2), slow, count)
    # (pp-1)/(m+pp-1) with equal stages; the head's stage is slower, so the other fills and drains faster
    assert 0.09 < plain.step["bubble_fraction"] < 1 / 9
    assert inter.step["bubble_fraction"] < plain.step["bubble_fraction"]
    assert [len(r.layers) for r in inter.ranks] == [2, 2]


def test_advice_when_activations_dominate():
    tiny = dataclasses.replace(HW, memory_bytes=2e6)
    p = plan_layout(SHAPE, Layout(), Training(16, 16), tiny, count)
    assert not p.fits
    assert any("activation checkpointing" in a for a in p.advice)


def test_recommend_returns_fitting_layouts_fastest_first():
    plans = recommend(SHAPE, 8, Training(32, 1), HW, count, top=4, micro_batches=(1, 2))
    assert 1 <= len(plans) <= 4 and all(p.fits for p in plans)
    speeds = [p.step["tokens_per_s"] for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.layout["dp"] * p.layout["pp"] * p.layout["tp"] == 8 for p in plans)
    with pytest.raises(PlanError, match="no layout"):
        recommend(SHAPE, 8, Training(32, 1), dataclasses.replace(HW, memory_bytes=1e3), count)


def test_predicted_vs_measured():
    p = plan()
    mem = p.ranks[0].memory
    r = predicted_vs_measured(p, 0, {"params": mem["params"], "activations": mem["activations"] * 1.1})
    assert r["params"]["ok"] and r["params"]["error"] == 0
    assert r["activations"]["ok"] and r["activations"]["error"] == pytest.approx(1 / 1.1 - 1)
    bad = predicted_vs_measured(p, 0, {"activations": mem["activations"] * 2})
    assert not bad["activations"]["ok"] and "outside tolerance" in format_comparison(bad)
    with pytest.raises(ValueError, match="stage 3 out of range"):
        predicted_vs_measured(p, 3, {})


@pytest.mark.parametrize(
    "field",
    [
        "peak_tflops_16",
        "peak_tflops_32",
        "memory_bytes",
        "intra_node_gbps",
        "inter_node_gbps",
        "efficiency",
        "latency_us",
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, "fast"])
def test_every_hardware_field_is_validated(field, value):
    with pytest.raises(PlanError, match=f"hardware 'a100_80gb': {field}=.* must be .*the stock a100_80gb has"):
        hardware_profile("a100_80gb", **{field: value})


def test_custom_profile_fields_are_validated_too():
    fields = dict(HW.__dict__, latency_us=float("nan"))
    del fields["name"]
    with pytest.raises(PlanError, match="hardware 'mine': latency_us=nan must be a finite number"):
        hardware_profile("mine", {"mine": fields})
    assert hardware_profile("a100_80gb", latency_us=0.0).latency_us == 0.0  # zero latency is allowed


def test_advice_never_suggests_what_is_already_set():
    deep = dataclasses.replace(SHAPE, n_layers=8)
    interleaved = plan_layout(deep, Layout(pp=4, vpp=2, schedule="interleaved"), Training(4, 1), HW, count)
    assert interleaved.step["bubble_fraction"] > 0.2
    assert not any("use the interleaved schedule" in a for a in interleaved.advice)
    plain = plan_layout(deep, Layout(pp=4), Training(4, 1), HW, count)
    assert any("use the interleaved schedule" in a for a in plain.advice)
    slow_net = dataclasses.replace(HW, intra_node_gbps=1e-3)
    for overlap in (True, False):
        p = plan_layout(SHAPE, Layout(dp=8, zero=2), Training(8, 1, overlap=overlap), slow_net, count)
        assert p.step["dp_exposed_s"] > 0.2 * p.step["step_time_s"]
        assert any("waits for data-parallel" in a for a in p.advice)
        assert any("overlap" in a for a in p.advice) is (not overlap), p.advice
