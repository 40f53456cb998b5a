"""mode=calibrate: the profile file round-trips through plan.hardware=<file> and is validated."""

import dataclasses
import json

import pytest

from parallel.plan import PlanError, hardware_profile
from recipes.tools.calibrate import calibrate
from recipes.tools.calibrate_fit import (
    fit_collective_overhead,
    fit_colocated_slowdown,
    fit_launched_ahead,
    fit_links,
    fit_overlap_fraction,
)
from recipes.tools.calibrate_timing import LARGE
from recipes.tools.plan import plan_from_config
from recipes.tools.plan_scenarios import scenario_config

TINY = ["model.preset=gpt_tiny", "model.d_model=64", "model.seq_len=32", "train.precision=fp32"]


def test_calibrated_profile_round_trips_and_plans(tmp_path):
    fields = calibrate(scenario_config(TINY), str(tmp_path), ranks=1)  # one rank: no collectives spawned
    path = tmp_path / "hardware.json"
    hw = hardware_profile(str(path))
    assert hw.name == "hardware" and {k: hw.fields()[k] for k in fields} == fields
    assert fields["peak_tflops_32"] > 0 and fields["hbm_gbps"] > 0 and 0 < fields["attention_efficiency"] <= 1
    assert fields["microbatch_overhead_us"] >= 0 and fields["step_overhead_us"] >= 0  # measured, in the file
    # one rank: nothing shares the host or the collectives, and the file says so
    assert (fields["collective_overhead_us"], fields["colocated_slowdown"], fields["overlap_fraction"]) == (0, 0, 1)
    plan = plan_from_config(scenario_config(TINY + [f"plan.hardware={path}"]))
    assert plan.step["step_time_s"] > 0
    raw = json.loads((tmp_path / "calibration.json").read_text())
    assert raw["gemm_fp32"] and raw["probe"]["block_s"] > 0  # the raw measurements and the speed probe are kept


def test_a_bad_profile_file_is_refused(tmp_path):
    good = dict(hardware_profile("cpu").__dict__)
    del good["name"]
    for field, value in (("latency_us", -5.0), ("hbm_gbps", 0.0)):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**good, field: value}))
        with pytest.raises(PlanError, match=f"hardware 'bad': {field}="):
            hardware_profile(str(path))
    with pytest.raises(PlanError, match="run mode=calibrate"):
        hardware_profile(str(tmp_path / "missing.json"))


def test_link_fit_inverts_the_ring_model():
    bw, lat = 3e9, 40e-6
    rows = []
    for n in (2, 3, 4):
        small = 2 * (n - 1) * lat  # 4 KiB: latency only (its bytes are negligible by construction here)
        rows.append({"n": n, "small_s": small, "large_s": 2 * (n - 1) / n * LARGE / bw + small})
    gbps, latency_us = fit_links(rows)
    assert gbps == pytest.approx(bw / 1e9) and latency_us == pytest.approx(lat * 1e6)


def test_time_report_compares_and_names_the_largest_part():
    from recipes.training.reports import format_time_comparison

    plan = plan_from_config(scenario_config(TINY + ["plan.hardware=cpu"]))
    predicted = plan.step["step_time_s"]
    close = format_time_comparison(plan, predicted * 1.1)
    assert f"predicted {predicted:.3f} s" in close and "+10%" in close and "the gap" not in close
    far = format_time_comparison(plan, predicted * 2)
    assert "the gap is" in far and "compute (the largest part) would have to be" in far


def test_fixed_host_costs_round_trip_and_enter_the_step_as_documented(tmp_path):
    """``microbatch_overhead_us`` per micro-batch (a third forward, two thirds backward, on the head's
    chunk) and ``step_overhead_us`` once per step: with pp = dp = 1 the step grows by exactly
    ``m·microbatch + step`` over the same profile without them."""
    base = dict(hardware_profile("cpu").__dict__)
    del base["name"]
    paths = {}
    for name, extra in (("plain", {}), ("fixed", {"microbatch_overhead_us": 700.0, "step_overhead_us": 3000.0})):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({**base, **extra}))
    hw = hardware_profile(str(paths["fixed"]))
    assert (hw.host.microbatch_overhead_us, hw.host.step_overhead_us) == (700.0, 3000.0)
    layout = ["train.global_batch=4", "train.micro_batch=1"]  # m = 4
    plain, fixed = (
        plan_from_config(scenario_config(TINY + layout + [f"plan.hardware={paths[n]}"])) for n in ("plain", "fixed")
    )
    assert fixed.step["step_time_s"] - plain.step["step_time_s"] == pytest.approx(4 * 700e-6 + 3000e-6, rel=1e-9)
    assert fixed.step["step_overhead_s"] == pytest.approx(3000e-6) and plain.step["step_overhead_s"] == 0.0
    r0, r1 = plain.ranks[0], fixed.ranks[0]
    assert r1.forward_s - r0.forward_s == pytest.approx(700e-6 / 3) and r1.backward_s - r0.backward_s == pytest.approx(
        2 * 700e-6 / 3
    )
    for bad in (-1.0, float("nan")):
        with pytest.raises(PlanError, match="step_overhead_us"):
            hardware_profile("cpu", step_overhead_us=bad)


def test_host_term_fits_invert_their_models():
    lat = 100.0  # µs per ring step
    rows = [{"n": n, "compute_s": 1e-3, "after_compute_s": 1e-3 + 2 * (n - 1) * lat * 1e-6 + 700e-6} for n in (2, 3)]
    assert fit_collective_overhead(rows, lat) == pytest.approx(700.0)
    assert fit_collective_overhead(rows, 1e6) == 0.0  # never negative
    blocks = [{"k": 1, "s": 2.0}] + [{"k": k, "s": 2.0 * (1 + 0.25 * (k - 1))} for k in (2, 2, 3, 3, 3)]
    assert fit_colocated_slowdown(blocks) == pytest.approx(0.25)
    assert fit_colocated_slowdown([{"k": 1, "s": 2.0}]) == 0.0
    assert fit_overlap_fraction({"block_s": 3.0, "comm_s": 1.0, "both_s": 3.25}) == pytest.approx(0.75)
    assert fit_overlap_fraction({"block_s": 3.0, "comm_s": 1.0, "both_s": 5.0}) == 0.0  # worse than serial
    assert fit_overlap_fraction(None) == 1.0
    # paired rounds: the median of each round's own difference / share, not of the pooled figures
    rounds = [{"compute_s": c, "after_compute_s": c + 2 * lat * 1e-6 + 500e-6} for c in (1e-3, 5e-3, 2e-3)]
    assert fit_collective_overhead([{"n": 2, "rounds": rounds, "compute_s": 0, "after_compute_s": 0}], lat) == (
        pytest.approx(500.0)
    )
    shares = [{"block_s": b, "comm_s": 1.0, "both_s": b + 0.5} for b in (3.0, 9.0, 4.0)]
    assert fit_overlap_fraction({"rounds": shares, "block_s": 0, "comm_s": 0, "both_s": 0}) == pytest.approx(0.5)
    # launched ahead: the mean over both kinds of (with − without compute) less the bytes at the ring's rate
    sent_s = 1 / 2 * 4e6 / 2e9  # n = 2, 4 MB at 2 GB/s
    ahead = [
        {"compute_s": c, "all_gather_s": c + sent_s + 300e-6, "reduce_scatter_s": c + sent_s + 500e-6}
        for c in (1e-3, 2e-3, 7e-3)
    ]
    assert fit_launched_ahead({"n": 2, "payload_bytes": 4e6, "rounds": ahead}, 2.0) == pytest.approx(400.0)
    assert fit_launched_ahead(None, 2.0) == 0.0  # one rank: the planner uses the ring's latency steps


@pytest.mark.parametrize(
    "field",
    [
        "collective_overhead_us",
        "colocated_slowdown",
        "overlap_fraction",
        "ahead_call_us",
        "tp_call_us",
        "all_gather_bw_scale",
        "reduce_scatter_bw_scale",
    ],
)
def test_host_terms_round_trip_through_the_profile_file_and_bad_ones_are_refused(tmp_path, field):
    good = dict(hardware_profile("cpu").__dict__)
    del good["name"]
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**good, field: 0.5}))
    assert hardware_profile(str(path)).fields()[field] == 0.5
    for bad in (-1.0, float("nan")):
        path.write_text(json.dumps({**good, field: bad}))
        with pytest.raises(PlanError, match=f"{field}="):
            hardware_profile(str(path))


def test_tp_call_cost_is_the_in_situ_residual_per_tp_call():
    """``tp_call_us``: a micro-batch through the model at tp = 2 measured ``δ`` slower than another
    gives ``δ / calls`` more per call; nothing measured (one rank) gives 0, never negative."""
    from recipes.tools.calibrate_fit import fit_tp_call_us

    rc = scenario_config(TINY)
    fields = dict(hardware_profile("cpu").__dict__)
    del fields["name"]
    row = {"tp": 2, "micro_batch": 2, "calls": 20, "s": 1.0}
    slower = {**row, "s": 1.0 + 20 * 150e-6}
    assert fit_tp_call_us(slower, rc, fields) - fit_tp_call_us(row, rc, fields) == pytest.approx(150.0)
    assert fit_tp_call_us({**row, "s": 0.0}, rc, fields) == 0.0
    assert fit_tp_call_us(None, rc, fields) == 0.0


def test_kind_scales_take_each_kinds_bytes_rate_and_price_the_planners_calls():
    from parallel.plan.traffic import AxisTraffic
    from recipes.tools.calibrate_fit import fit_kind_scales

    gbps, n, payload, small = 2.0, 2, 8e5, 4096
    sent = (n - 1) / n * (payload - small)
    row = {"n": n, "payload_bytes": payload, "payload_bytes_small": small}
    for kind, scale, fixed in (("all_gather", 0.25, 900e-6), ("reduce_scatter", 1.6, 300e-6)):
        row[f"{kind}_s_small"] = fixed  # the kind's own fixed cost, whatever the all-reduce's latency
        row[f"{kind}_s"] = fixed + sent / (scale * gbps * 1e9)
    scales = fit_kind_scales(row, gbps)
    assert scales == pytest.approx({"all_gather_bw_scale": 0.25, "reduce_scatter_bw_scale": 1.6})
    assert fit_kind_scales(None, gbps) == {"all_gather_bw_scale": 1.0, "reduce_scatter_bw_scale": 1.0}
    # paired rounds: the difference within each round counts, whatever the round's fixed cost
    drift = [{k: v + d for k, v in row.items() if k.endswith(("_s", "_s_small"))} for d in (0.0, 2e-3, 5e-4)]
    assert fit_kind_scales({**row, "rounds": drift}, gbps) == pytest.approx(scales)
    hw = hardware_profile("cpu", intra_node_gbps=gbps, latency_us=100.0, collective_overhead_us=0.0, **scales)
    for kind, scale in (("all_gather", 0.25), ("reduce_scatter", 1.6)):  # the planner's call at that rate
        assert AxisTraffic(n, False).add(kind, payload, 1, hw, "x") == pytest.approx(
            (n - 1) / n * payload / (scale * gbps * 1e9) + 100e-6, rel=1e-12
        )
    # an all-reduce keeps the link's rate; the ahead fit takes each kind's bytes at its own rate
    assert AxisTraffic(n, False).add("all_reduce", payload, 1, hw, "x") == pytest.approx(
        2 * (n - 1) / n * payload / (gbps * 1e9) + 200e-6, rel=1e-12
    )
    ahead = [{"compute_s": c, "all_gather_s": c + 2e-3, "reduce_scatter_s": c + 5e-4} for c in (1e-3, 2e-3, 4e-3)]
    bytes_s = {k: (n - 1) / n * payload / (s * gbps * 1e9) for k, s in (("ag", 0.25), ("rs", 1.6))}
    expected = ((2e-3 - bytes_s["ag"]) + (5e-4 - bytes_s["rs"])) / 2 * 1e6
    assert fit_launched_ahead({"n": n, "payload_bytes": payload, "rounds": ahead}, gbps, scales) == pytest.approx(
        expected
    )


def _unit_rank():
    import torch
    import torch.distributed as dist

    from recipes.config import model_config
    from recipes.tools.calibrate_collectives import _launched_ahead, _unit_kinds
    from recipes.tools.calibrate_timing import _block, unit_buckets

    torch.set_num_threads(1)
    mc = model_config(scenario_config(TINY).model)
    block, x = _block(mc, 1, torch.float32, torch.device("cpu"))
    numel = sum(p.numel() for p in block.parameters())
    kinds = _unit_kinds(numel, dist.group.WORLD, torch.device("cpu"))
    ahead = _launched_ahead(block, x, dist.group.WORLD, torch.device("cpu"))
    return numel, unit_buckets(block), kinds, ahead


def test_unit_collectives_are_measured_as_the_engine_packs_a_unit():
    from parallel.testing import run_ranks
    from recipes.tools.calibrate_fit import fit_kind_scales

    numel, buckets, kinds, ahead = run_ranks(_unit_rank, 2, timeout=120)[0]
    assert len(buckets) == 2 and sum(buckets) == numel  # weights; biases and norms (packing.bucket_class)
    assert ahead["buckets"] == buckets and ahead["payload_bytes"] >= 4 * numel and len(ahead["rounds"]) > 1
    assert kinds["payload_bytes"] >= 4 * numel and kinds["payload_bytes_small"] == 4096
    assert all(r["all_gather_s"] > 0 and r["reduce_scatter_s_small"] > 0 for r in kinds["rounds"])
    scales = fit_kind_scales(kinds, 1.0)
    assert all(0.01 <= v <= 100 for v in scales.values()) and fit_launched_ahead(ahead, 1.0, scales) >= 1.0


def test_the_microbatch_residual_takes_the_block_as_the_planner_does(monkeypatch):
    """host_overheads_us subtracts n_layers × the round's block time: the median of its calls, as the
    planner's block time is the speed probe's median (``_time``), not their mean."""
    import statistics

    import torch

    import recipes.tools.calibrate_timing as cal

    seen, paired = {}, cal._paired

    def spy(fns, device, reps, rounds=cal.PAIRED_ROUNDS, stats=None):
        seen.update(stats or {})
        return [{"mb_s": 0.01, "block_s": 0.001}]

    monkeypatch.setattr(cal, "_paired", spy)
    rc = scenario_config(TINY)
    fields = dataclasses.asdict(hardware_profile("cpu"))
    del fields["name"]
    cal.host_overheads_us(rc, fields, torch.device("cpu"))
    assert seen.get("block_s") is statistics.median and "mb_s" not in seen
    ticks = iter([0.0, 0.0, 0.0, 0.3])  # warm-up, then 0, 0, 0.3 s: median 0, mean 0.1

    def step():
        import time

        time.sleep(next(ticks))

    assert paired({"x": step}, torch.device("cpu"), 3, rounds=1, stats={"x": statistics.median})[0]["x"] < 0.05


def test_a_unit_is_split_into_buckets_above_bucket_mb_as_the_engine_packs_it():
    import torch

    from recipes.config import model_config
    from recipes.tools.calibrate_timing import _block, unit_buckets

    block, _ = _block(model_config(scenario_config(TINY).model), 1, torch.float32, torch.device("cpu"))
    numels = [p.numel() for p in block.parameters()]
    assert len(unit_buckets(block)) == 2  # 25 MB: one bucket per class (weights; biases and norms)
    cap = 0.02 * 2**20 / 4  # elements of a 20 KiB fp32 bucket
    small = unit_buckets(block, bucket_mb=0.02)
    assert sum(small) == sum(numels) and len(small) > 2
    assert all(n <= cap or n in numels for n in small)  # a parameter above the cap gets its own bucket
