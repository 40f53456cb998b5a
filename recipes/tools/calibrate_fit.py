"""The profile's fields from ``mode=calibrate``'s measurements: each fit inverts the planner's model
of what was measured (pure: no process, no timing)."""

from __future__ import annotations

import statistics

from ..config import RecipeConfig, model_config
from .calibrate_timing import LARGE


def block_overhead_us(rc: RecipeConfig, fields: dict, block_s: float) -> float:
    """Microseconds one block's forward + backward takes beyond what the planner's work model gives
    it with ``fields`` (launches, Python, autograd), from ``block_s``, the configured model's block
    measured at its micro-batch (:func:`speed_probe`: the same measurement, so the profile and the
    probe that later rescales it agree on what the block costs)."""
    from parallel.plan import ModelShape
    from parallel.plan.compute import layer_time
    from parallel.plan.hardware import Hardware

    mc = model_config(rc.model)
    hw = Hardware.from_fields("calibrating", {**fields, "block_overhead_us": 0.0})
    work = layer_time(ModelShape.of(mc), rc.train.micro_batch, 1, False, hw, rc.train.precision)
    return max(0.0, block_s - work.forward - work.backward) * 1e6


def fit_tp_call_us(row: dict | None, rc: RecipeConfig, fields: dict) -> float:
    """Microseconds each TP collective inside the model costs beyond what the planner gives one
    micro-batch's forward + backward with ``fields`` (the blocks' and head's work at tp with
    ``colocated_slowdown`` for the tp ranks busy at once, ``block_overhead_us`` and
    ``microbatch_overhead_us``, and every TP call's ring latency, bytes and ``collective_overhead_us``):
    ``(t_measured − planned) / calls``, ≥ 0; 0 without a row (one rank, or a model tp = 2 cannot split)."""
    if not row or not row.get("calls"):
        return 0.0
    from parallel.plan import ModelShape
    from parallel.plan.compute import colocated, head_time, layer_time
    from parallel.plan.hardware import Hardware
    from parallel.plan.traffic import AxisTraffic, tp_traffic

    mc = model_config(rc.model)
    hw = Hardware.from_fields("calibrating", {**fields, "tp_call_us": 0.0})
    tp, mb, precision = row["tp"], row["micro_batch"], rc.train.precision
    shape, work_hw = ModelShape.of(mc), colocated(hw, tp)
    layer, head = layer_time(shape, mb, tp, False, work_hw, precision), head_time(shape, mb, tp, work_hw, precision)
    e = 4 if precision == "fp32" else 2
    tf, tb, _ = tp_traffic(
        shape, AxisTraffic(tp, False), hw, n_layers=mc.n_layers, has_embedding=True, has_head=True,
        mb=mb, m=1, e=e, sp=False, ckpt="none",
    )  # fmt: skip
    planned = mc.n_layers * (layer.forward + layer.backward) + head.forward + head.backward + tf + tb
    return max(0.0, (row["s"] - planned) / row["calls"]) * 1e6


def fit_kind_scales(row: dict | None, gbps: float) -> dict[str, float]:
    """``all_gather_bw_scale`` and ``reduce_scatter_bw_scale``: per kind, the rate its bytes move at
    (``(n−1)/n`` of the unit's payload less the small one sent, over the unit's time less the same
    kind's time on :data:`SMALL` bytes: the kind's own fixed cost, so the all-reduce's bimodal latency
    fit does not enter; the median over the row's paired ``rounds`` of the difference within a round,
    or the row's own figures without rounds), over the all-reduce's ``gbps``; the difference floored
    at a twentieth of the unit's time, the scale clipped to [0.01, 100]; 1 (the ring's) without a row."""
    scales = {}
    for kind in ("all_gather", "reduce_scatter"):
        if not row or not (row.get("rounds") or f"{kind}_s" in row):
            scales[f"{kind}_bw_scale"] = 1.0
            continue
        n, pairs = row["n"], row.get("rounds") or [row]
        sent = (n - 1) / n * (row["payload_bytes"] - row.get("payload_bytes_small", 0))
        t = statistics.median(p[f"{kind}_s"] for p in pairs)
        rest = max(statistics.median(p[f"{kind}_s"] - p.get(f"{kind}_s_small", 0.0) for p in pairs), t / 20)
        scales[f"{kind}_bw_scale"] = min(100.0, max(0.01, sent / (gbps * 1e9) / rest))
    return scales


def fit_launched_ahead(row: dict | None, gbps: float, scales: dict[str, float] | None = None) -> float:
    """Microseconds one unit's collectives launched ahead of their wait cost beyond their bytes at
    ``gbps`` (GB/s per rank, ring: ``(n−1)/n`` of the payload sent) times the kind's measured scale
    (``scales``: :func:`fit_kind_scales`; 1 without): the median over the paired rounds of
    ``t(collectives + compute) − t(compute)`` less the bytes' time, the mean over both kinds,
    ≥ 1 µs; 0 (not measured: the planner prices such calls at the ring's latency steps) without a row."""
    if not row or not row.get("rounds"):
        return 0.0
    scales = scales or {}
    extra = []
    for kind in ("all_gather", "reduce_scatter"):
        rate = gbps * 1e9 * scales.get(f"{kind}_bw_scale", 1.0)
        sent = (row["n"] - 1) / row["n"] * row["payload_bytes"] / rate
        extra.append(statistics.median(r[f"{kind}_s"] - r["compute_s"] for r in row["rounds"]) - sent)
    return max(1.0, statistics.mean(extra) * 1e6)


def fit_links(rows: list[dict]) -> tuple[float, float]:
    """(GB/s per rank, latency µs) of the ring model from each group size's small and large times."""
    lat = [r["small_s"] / (2 * (r["n"] - 1)) for r in rows]
    bw = [
        2 * (r["n"] - 1) / r["n"] * LARGE / max(r["large_s"] - 2 * (r["n"] - 1) * la, 1e-9) for r, la in zip(rows, lat)
    ]
    return statistics.median(bw) / 1e9, statistics.median(lat) * 1e6


def fit_collective_overhead(rows: list[dict], latency_us: float) -> float:
    """Microseconds a ``parallel.comm`` collective issued after compute takes beyond its ring latency
    steps: over group sizes, the median of ``after_compute_s − compute_s − 2(n−1)·latency``, ≥ 0, each
    the median over the row's paired ``rounds`` of the difference within a round (:func:`_paired`), or
    of the row's own two figures where it has no rounds."""

    def extra(r: dict) -> float:
        steps = 2 * (r["n"] - 1) * latency_us * 1e-6
        pairs = r.get("rounds") or [r]
        return statistics.median(p["after_compute_s"] - p["compute_s"] for p in pairs) - steps

    values = [extra(r) for r in rows]
    return max(0.0, statistics.median(values) * 1e6) if values else 0.0


def _hidden_share(row: dict) -> float:
    hidden = row["block_s"] + row["comm_s"] - row["both_s"]
    return min(1.0, max(0.0, hidden / max(min(row["block_s"], row["comm_s"]), 1e-12)))


def fit_overlap_fraction(row: dict | None) -> float:
    """The share of an all-reduce that a block's forward + backward hides when the all-reduce is
    launched first: ``(t_block + t_comm − t_both) / min(t_block, t_comm)``, clipped to [0, 1], the
    median over the row's paired ``rounds`` (:func:`_paired`; the row's own figures without rounds);
    1 when nothing was measured (one rank)."""
    if not row:
        return 1.0
    return statistics.median(_hidden_share(r) for r in (row.get("rounds") or [row]))


def fit_colocated_slowdown(blocks: list[dict]) -> float:
    """The slope ``s`` of ``t_k / t_1 = 1 + s·(k − 1)`` (least squares through the origin) from block
    timings ``{"k", "s"}`` of every busy rank (``t_k``: their mean at k ranks at once), ≥ 0; 0 when
    only one rank was timed."""
    by_k: dict[int, list[float]] = {}
    for b in blocks:
        by_k.setdefault(b["k"], []).append(b["s"])
    if 1 not in by_k or len(by_k) < 2:
        return 0.0
    t1 = statistics.mean(by_k[1])
    pts = [(k - 1, statistics.mean(ts) / t1 - 1) for k, ts in by_k.items() if k > 1]
    return max(0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts))
