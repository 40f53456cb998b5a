"""The hardware profile's host-side terms enter the plan exactly as documented: a fixed cost per
collective call (``collective_overhead_us``), the busy-rank slowdown of ranks sharing a host
(``colocated_slowdown``), the share of overlapped communication really hidden (``overlap_fraction``),
and the last gradient bucket's reduction after backward. Pure: no process is started."""

import dataclasses

import pytest

from parallel.plan import Layout, PlanError, Training, hardware_profile, plan_layout
from parallel.plan.compute import colocated, colocated_factor
from parallel.plan.traffic import AxisTraffic, dp_traffic

from .test_planner import SHAPE, count

HW = hardware_profile("cpu")  # 1 device per node: no colocation unless a test says so


def test_every_call_pays_latency_steps_and_the_fixed_cost():
    hw = HW.replace(latency_us=30.0, collective_overhead_us=500.0)
    axis = AxisTraffic(4, False)
    one = axis.add("all_reduce", 8e6, 3, hw, "x", calls=5)
    sent = 2 * 3 / 4 * 8e6  # ring all-reduce over 4 ranks
    assert one == pytest.approx(sent / hw.bandwidth(False) + 5 * (2 * 3 * 30e-6 + 500e-6), rel=1e-12)
    assert axis.time_s == pytest.approx(3 * one, rel=1e-12) and axis.bytes == pytest.approx(3 * sent)
    p2p = AxisTraffic(2, False).add("p2p", 1e3, 1, hw, "y")
    assert p2p == pytest.approx(1e3 / hw.bandwidth(False) + 30e-6 + 500e-6, rel=1e-12)


def test_buckets_and_units_are_separate_calls():
    hw = HW.replace(latency_us=0.0, collective_overhead_us=1000.0)
    kw = dict(psi=10**6, micro_batches=2, param_bytes=4, comm_bytes=4)
    one = dp_traffic(hw, AxisTraffic(2, False), zero=0, **kw)
    four = dp_traffic(hw, AxisTraffic(2, False), zero=0, buckets=4, **kw)
    assert four["grad_per_step"] - one["grad_per_step"] == pytest.approx(3e-3)
    # ZeRO-3 without overlap: every reduction blocks on issue; the gathers are prefetched whatever
    # comm.overlap (parallel.overlap.ZERO3_GATHER): only the first unit's block
    z3 = dp_traffic(hw, AxisTraffic(2, False), zero=3, units=8, overlap=False, **kw)
    z3_one = dp_traffic(hw, AxisTraffic(2, False), zero=3, overlap=False, **kw)
    assert z3["grad_per_mb"] - z3_one["grad_per_mb"] == pytest.approx(7e-3)
    for key in ("param_fwd_per_mb", "param_bwd_per_mb"):
        assert z3[key] == pytest.approx(z3_one[key])


def test_collectives_launched_ahead_skip_the_blocking_cost():
    """ZeRO-3 with overlap: of a micro-batch's 8 unit buckets (2 per block: weights, and biases and
    norms) and the rest's 2, only the first unit's gathers, and the reductions launched when backward
    ends (the first unit's and the rest's) pay ``collective_overhead_us``; every call pays its latency."""
    kw = dict(psi=10**6, micro_batches=2, param_bytes=4, comm_bytes=4, zero=3)
    calls = dict(buckets=10, units=8, root_calls=2, first_unit_calls=2)
    free = HW.replace(latency_us=10.0, collective_overhead_us=0.0)
    costly = free.replace(collective_overhead_us=1000.0)
    for overlap, gathers, reductions in ((True, 2, 4), (False, 2, 10)):
        a = dp_traffic(free, AxisTraffic(2, False), overlap=overlap, **calls, **kw)
        b = dp_traffic(costly, AxisTraffic(2, False), overlap=overlap, **calls, **kw)
        assert b["param_fwd_per_mb"] - a["param_fwd_per_mb"] == pytest.approx(gathers * 1e-3)
        assert b["param_bwd_per_mb"] - a["param_bwd_per_mb"] == pytest.approx(gathers * 1e-3)
        assert b["grad_per_mb"] - a["grad_per_mb"] == pytest.approx(reductions * 1e-3)
    # a measured cost per call launched ahead replaces their latency steps (0: latency steps)
    measured = costly.replace(ahead_call_us=300.0)
    c = dp_traffic(measured, AxisTraffic(2, False), **calls, **kw)
    b = dp_traffic(costly, AxisTraffic(2, False), **calls, **kw)
    assert c["param_fwd_per_mb"] - b["param_fwd_per_mb"] == pytest.approx((8 - 2) * (300e-6 - 10e-6))
    assert c["grad_per_mb"] - b["grad_per_mb"] == pytest.approx((10 - 4) * (300e-6 - 10e-6))
    # the buckets of one unit are launched together: the measured cost once per unit (4 blocks here)
    d = dp_traffic(measured, AxisTraffic(2, False), unit_count=4, **calls, **kw)
    assert d["param_fwd_per_mb"] - b["param_fwd_per_mb"] == pytest.approx((4 - 1) * 300e-6 - (8 - 2) * 10e-6)
    assert d["grad_per_mb"] - b["grad_per_mb"] == pytest.approx((4 - 1) * 300e-6 - (10 - 4) * 10e-6)
    latency_only = dp_traffic(free, AxisTraffic(2, False), **calls, **kw)
    nothing = dp_traffic(free.replace(latency_us=0.0), AxisTraffic(2, False), **calls, **kw)
    assert latency_only["param_fwd_per_mb"] - nothing["param_fwd_per_mb"] == pytest.approx(8 * 10e-6)


def test_the_plan_counts_zero_buckets_as_the_engine_packs_them():
    """A block's parameters are two buckets (with and without weight decay), the rest two more
    (``parallel.zero.layout.plan_buckets``): ZeRO-0 reduces them as two all-reduces, ZeRO-3 gathers
    each block as two all-gathers per micro-batch and direction and reduce-scatters every bucket."""
    from parallel.plan.memory import StageParams, zero_bucket_counts

    d, v = SHAPE.d_model, SHAPE.padded_vocab(1)
    block = ((3 * d * d, d * d, 4 * d * d, 4 * d * d), (3 * d, d, 4 * d, d, 2 * d, 2 * d))  # weights; biases, norms

    def classes(layers, has_embedding, has_head, tp):
        p = count(layers, has_embedding, has_head, tp)
        root = ((v * d,) if has_embedding else (), (2 * d,) if has_head else ())
        return StageParams(p.numel, full=p.full, blocks=(block,) * len(layers), root=root)

    params = classes(range(0, SHAPE.n_layers), True, True, 1)
    assert zero_bucket_counts(params, 25 * 2**20, 4, per_unit=True) == (2,) * SHAPE.n_layers + (2,)
    assert zero_bucket_counts(params, 25 * 2**20, 4, per_unit=False) == (2,)
    assert zero_bucket_counts(count(range(0, 2), True, True, 1), 25 * 2**20, 4) is None  # classes unknown
    tr = Training(global_batch=4, micro_batch=2)
    z0 = plan_layout(SHAPE, Layout(dp=2), tr, HW, classes).ranks[0].traffic["dp"]["by_kind"]
    assert z0["all_reduce"]["calls"] == 2 + 1  # two buckets + the loss
    z3 = plan_layout(SHAPE, Layout(dp=2, zero=3), tr, HW, classes).ranks[0].traffic["dp"]["by_kind"]
    assert z3["all_gather"]["calls"] == 2 * 2 * SHAPE.n_layers + 2  # m = 1: forward, backward; the rest once
    assert z3["reduce_scatter"]["calls"] == 2 * SHAPE.n_layers + 2


def _plan(layout, hw, **training):
    return plan_layout(SHAPE, layout, Training(**{"global_batch": 16, "micro_batch": 2, **training}), hw, count)


def test_a_collective_overhead_delays_each_pipeline_message():
    base = _plan(Layout(pp=2), HW)
    slow = _plan(Layout(pp=2), HW.replace(collective_overhead_us=2000.0))
    m = 8  # 1F1B with pp = 2 puts m + 1 transfers on the critical path (parallel.plan.pipeline.closed_form)
    assert slow.step["pipeline_s"] - base.step["pipeline_s"] == pytest.approx((m + 1) * 2e-3, rel=1e-9)


def test_ranks_sharing_a_host_compute_slower_by_the_calibrated_factor():
    shared = HW.replace(gpus_per_node=2, colocated_slowdown=0.5)
    assert colocated_factor(shared, 1) == 1.0 and colocated_factor(shared, 3) == 2.0
    assert colocated(shared, 2).peak_flops("fp32") == pytest.approx(shared.peak_flops("fp32") / 1.5)
    apart = _plan(Layout(dp=2), shared.replace(colocated_slowdown=0.0))
    together = _plan(Layout(dp=2), shared)
    assert together.ranks[0].compute_s == pytest.approx(1.5 * apart.ranks[0].compute_s, rel=1e-9)
    assert together.step["colocated_factor"] == 1.5 and apart.step["colocated_factor"] == 1.0
    one_per_node = _plan(Layout(dp=2), shared.replace(gpus_per_node=1))
    assert one_per_node.ranks[0].compute_s == pytest.approx(apart.ranks[0].compute_s, rel=1e-12)
    assert together.hardware["peak_tflops_32"] == shared.peak_tflops_32  # the plan records the profile as given


def test_overlap_fraction_zero_exposes_what_overlap_would_hide():
    slow = HW.replace(intra_node_gbps=0.01, inter_node_gbps=0.01, gpus_per_node=8)
    kw = dict(bucket_mb=0.01)  # many buckets: with full hiding most of the reduction is hidden
    hidden = _plan(Layout(dp=4), slow, overlap=True, **kw)
    none = _plan(Layout(dp=4), slow.replace(overlap_fraction=0.0), overlap=True, **kw)
    serial = _plan(Layout(dp=4), slow, overlap=False, **kw)
    assert hidden.step["dp_exposed_s"] < none.step["dp_exposed_s"]
    assert none.step["dp_exposed_s"] == pytest.approx(serial.step["dp_exposed_s"], rel=1e-9)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("collective_overhead_us", -1.0),
        ("collective_overhead_us", float("nan")),
        ("colocated_slowdown", -0.1),
        ("colocated_slowdown", float("inf")),
        ("overlap_fraction", 1.5),
        ("overlap_fraction", float("nan")),
        ("ahead_call_us", -1.0),
        ("ahead_call_us", float("inf")),
        ("tp_call_us", -1.0),
        ("tp_call_us", float("nan")),
    ],
)
def test_bad_host_terms_are_refused(field, bad):
    with pytest.raises(PlanError, match=f"{field}="):
        hardware_profile("cpu", **{field: bad})


def test_the_steps_tp_and_pp_scalars_are_exposed():
    """After backward the step all-reduces the gradient norm over tp and pp and broadcasts the loss from
    the last stage: nothing hides them, each pays its latency steps and the blocking cost."""
    hw = HW.replace(latency_us=100.0, collective_overhead_us=1000.0)
    pp = _plan(Layout(pp=2), hw)
    bw = hw.bandwidth(True)  # the cpu profile: one rank per node, so every group crosses nodes
    one = 1 * 100e-6 + 1e-3 + 1 / 2 * 4 / bw  # a 4-byte broadcast over 2 ranks: 1 ring step, half sent
    two = 2 * 100e-6 + 1e-3 + 2 * 1 / 2 * 4 / bw  # a 4-byte all-reduce: 2 steps
    emb = pp.ranks[0].traffic["embedding"]["time_s"]
    assert pp.step["scalars_s"] == pytest.approx(emb + one + two, rel=1e-9)
    tp = _plan(Layout(tp=2), hw)
    assert tp.step["scalars_s"] == pytest.approx(two, rel=1e-9)


def test_tp_call_cost_of_hidable_collectives_is_not_hidden():
    """``tp_call_us`` is compute-side (the autograd Function around each call): for sequence
    parallelism's asynchronous backward collectives, which column compute may hide
    (TP_SP_BACKWARD), it goes to the exposed backward, not into the seconds that can hide."""
    from parallel.plan.traffic import tp_traffic

    kw = dict(n_layers=2, has_embedding=False, has_head=False, mb=1, m=1, e=2, sp=True, ckpt=None)
    free = tp_traffic(SHAPE, AxisTraffic(2, False), HW, **kw)
    costly = tp_traffic(SHAPE, AxisTraffic(2, False), HW.replace(tp_call_us=1000.0), **kw)
    assert costly[2] == free[2]  # the hidable collectives: their wire time only
    calls = 2 * 2 * 2 + 3 * 2 * 2  # forward: 2 pairs per block; backward: all-gathers, scatters, re-gathers
    assert (costly[0] + costly[1]) - (free[0] + free[1]) == pytest.approx(calls * 1e-3)


def test_calls_priced_with_the_measured_ahead_cost_are_not_hidden_again():
    """calibrate measures ``ahead_call_us`` as what a unit's calls launched ahead leave exposed beyond
    their bytes (``recipes.tools.calibrate_fit.fit_launched_ahead``): those calls' seconds, bytes included, are
    already net of overlap, so ``overlap_fraction`` hides none of them. Only ZeRO-3 launches calls
    ahead (its prefetched gathers, its reductions from backward hooks); the first unit's and the
    rest's calls block and stay hideable. Without a measured cost (the GPU profiles) nothing is."""
    from parallel.plan.exposure import exposed_dp_time as _exposed_dp_time

    kw = dict(psi=10**6, micro_batches=2, param_bytes=4, comm_bytes=4)
    calls = dict(buckets=10, units=8, root_calls=2, first_unit_calls=2, unit_count=4)
    measured = HW.replace(latency_us=10.0, collective_overhead_us=100.0, ahead_call_us=300.0)
    for zero in (0, 1, 2):
        t = dp_traffic(measured, AxisTraffic(2, False), zero=zero, **calls, **kw)
        assert t["measured_per_mb"] == t["measured_per_step"] == 0.0
    t = dp_traffic(measured, AxisTraffic(2, False), zero=3, **calls, **kw)
    wire = 0.5 * 10**6 * 4 / measured.kind_bandwidth("all_gather", False)
    gathers = 2 * (wire * (8 - 2) / 8 + (4 - 1) * 300e-6)  # forward and backward: 6 of 8 calls, 3 launches
    rs_wire = 0.5 * 10**6 * 4 / measured.kind_bandwidth("reduce_scatter", False)
    reductions = rs_wire * (10 - 4) / 10 + (4 - 1) * 300e-6
    assert t["measured_per_mb"] == pytest.approx(gathers + reductions, rel=1e-12)
    assert dp_traffic(HW, AxisTraffic(2, False), zero=3, **calls, **kw)["measured_per_mb"] == 0.0
    # every second measured: the fraction hides nothing; none measured: as partly_hidden says
    dp = dict.fromkeys(("grad_per_step", "param_after_step", "measured_per_step"), 0.0)
    dp.update(grad_per_mb=0.01, param_fwd_per_mb=0.01, param_bwd_per_mb=0.01, measured_per_mb=0.03)
    for fraction in (0.0, 0.4, 1.0):
        assert _exposed_dp_time(dp, 2, 1.0, 1.0, True, 4, fraction) == pytest.approx(2 * 0.03)
    half = _exposed_dp_time({**dp, "measured_per_mb": 0.015}, 2, 1.0, 1.0, True, 4, 1.0)
    none = _exposed_dp_time({**dp, "measured_per_mb": 0.0}, 2, 1.0, 1.0, True, 4, 1.0)
    assert none == pytest.approx(2 * 0.01 / 4) and half == pytest.approx(none + 2 * 0.5 * (0.03 - 0.01 / 4))


def test_gpu_profiles_have_no_host_costs_and_files_nest_them(tmp_path):
    """Host costs are a separate object (``Hardware.host``), absent on every stock profile; a profile
    file nests them under ``host`` (what mode=calibrate writes) and the older flat form still loads."""
    import json

    from parallel.plan import PROFILES
    from parallel.plan.hardware import NO_HOST_COSTS, HostCosts, host_costs

    assert all(hw.host is None and host_costs(hw) == NO_HOST_COSTS == HostCosts() for hw in PROFILES.values())
    costly = HW.replace(tp_call_us=5.0)
    assert costly.host == HostCosts(tp_call_us=5.0) and costly.replace(tp_call_us=0.0).host is None
    fields = {k: v for k, v in dataclasses.asdict(costly).items() if k != "name"}
    (tmp_path / "nested.json").write_text(json.dumps(fields))
    (tmp_path / "flat.json").write_text(json.dumps(costly.fields()))
    for name in ("nested", "flat"):
        assert hardware_profile(str(tmp_path / f"{name}.json")).replace(name="cpu") == costly


def test_the_run_queue_clock_only_with_a_calibrated_cpu_profile(tmp_path):
    import json

    from recipes.tools.plan_scenarios import scenario_config
    from recipes.training.reports import cpu_wait_clock, runqueue_seconds

    path = tmp_path / "calibrated.json"
    path.write_text(
        json.dumps({k: v for k, v in dataclasses.asdict(HW.replace(block_overhead_us=9.0)).items() if k != "name"})
    )
    assert cpu_wait_clock(scenario_config(["model.preset=gpt_tiny", f"plan.hardware={path}"])) is runqueue_seconds
    assert cpu_wait_clock(scenario_config(["model.preset=gpt_tiny", "plan.hardware=a100_80gb"])) is None
