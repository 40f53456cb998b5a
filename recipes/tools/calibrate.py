"""``mode=calibrate``: measure this machine and write a hardware profile ``plan.hardware=<file>`` reads.

Measured, in well under a minute (the numbers the planner's time model uses, ``parallel.plan.compute``):

* **matmul throughput** over the configured model's GEMMs (q/k/v, attention output, MLP in and
  out, the head) at its micro-batch, sequence and tp, in the run's precision and in fp32: the
  rate ``R`` that with the measured memory bandwidth fits ``t = 2MKN/R + bytes/HBM`` by least
  squares; the profile's peak is ``R`` and its ``efficiency`` 1 (what this machine reaches on these
  shapes is its "large-GEMM" rate);
* **flash attention** (SDPA, causal) on the model's heads: ``attention_efficiency`` against ``R``;
* **fixed host costs** (what a CPU pays per op, launch and Python line; 0 on GPU profiles): one
  block's forward + backward beyond its work (``block_overhead_us``; the block timed by the speed
  probe, :func:`speed_probe`, one second before the other measurements and one after the ranks), one micro-batch through the
  whole model and its loss beyond its blocks' and head's work (``microbatch_overhead_us``), one
  step's clip + optimizer + zero_grad beyond the optimizer's memory-bound work (``step_overhead_us``);
* **memory bandwidth**: a copy of a 64 MiB tensor (read + write);
* **collectives**: all-reduces of 4 KiB (latency) and 8 MiB (bandwidth) over groups of 2…N ranks
  spawned with the recipe's launcher (``launch.local``) on the default backend, fitted to the
  planner's ring model ``2(n−1)/n·B/bw + 2(n−1)·latency``;
* **a collective's fixed host cost** (``collective_overhead_us``): training issues a blocking
  collective right after compute (TP's per block, the step's scalars, pipeline receives), not in a
  tight loop: the rank that arrives first sleeps and is woken, and ``parallel.comm`` adds its Python.
  Measured on the same ranks: ≈ 1 ms of the model's GEMMs (:data:`COMPUTE_BEFORE_S`) followed by a
  4 KiB ``parallel.comm.all_reduce``, less the GEMMs alone and the ring's fitted latency steps (the
  median over :data:`PAIRED_ROUNDS` rounds of the difference within each round, :func:`_paired`: the
  cost includes the ranks' arrival skew, which the luckiest round hides; the ring's latency and
  bandwidth are the quietest round's, what other jobs disturbed least);
* **ranks sharing the host** (``colocated_slowdown``): the configured model's block forward + backward
  on one rank alone, then on k = 2…min(cores, N) ranks at once (the median over repeats, as above);
  the slowdown per extra busy rank is the least-squares slope of ``t_k / t_1 − 1`` over ``k − 1``;
* **each collective kind** (``all_gather_bw_scale``, ``reduce_scatter_bw_scale``): blocking
  ``parallel.comm`` all-gathers and reduce-scatters of one block's parameters (a ZeRO-3 unit), so the
  engine's own paths (on gloo: a sum reduce-scatter as an all-to-all, an all-gather of ≥ 1 MiB as
  broadcasts, a smaller one gloo's own), less the same kind on 4 KiB: the rate each kind's bytes
  move at, over the all-reduce's (1: the ring's, what NCCL runs);
* **a collective launched ahead of its wait** (``ahead_call_us``): ZeRO-3's prefetched all-gathers and
  hook-launched reduce-scatters of one unit as the engine issues them (the block's buckets, packed by
  class, launched together), asynchronously before the block's own forward and waited for after it,
  less the forward alone (paired rounds) and the bytes' time at the kind's bandwidth, averaged over
  both kinds;
* **a TP collective inside the model** (``tp_call_us``): one micro-batch through the configured
  model built at tp = 2 on two ranks, forward + backward (paired rounds), less what the planner gives
  it with the fields above (its work with both ranks busy, the fixed costs per block and micro-batch,
  each TP call's latency, bytes and ``collective_overhead_us``), per TP call: what TP's collectives
  cost in the model's real duty cycle (the autograd Function around each, the compute after its
  wake-up resuming cold) beyond the GEMM loop behind ``collective_overhead_us``;
* **how much compute hides** (``overlap_fraction``): on every rank, the block, an all-reduce of its
  gradients, and the all-reduce launched asynchronously before the block; the share of the shorter
  one the overlap saved (on a CPU whose cores all run ranks, gloo's copies compete with the compute).

The profile (``hardware.json``, the :class:`~parallel.plan.Hardware` fields) and the raw measurements
(``calibration.json``) go to the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from parallel.plan import hardware_profile

from ..config import RecipeConfig, model_config
from .calibrate_collectives import _collectives_worker
from .calibrate_fit import (
    block_overhead_us,
    fit_collective_overhead,
    fit_colocated_slowdown,
    fit_kind_scales,
    fit_launched_ahead,
    fit_links,
    fit_overlap_fraction,
    fit_tp_call_us,
)
from .calibrate_timing import (
    DTYPES,
    attention_fraction,
    gemm_rate,
    host_overheads_us,
    memory_bandwidth,
    model_gemms,
    speed_probe,
)


def calibrate(rc: RecipeConfig, run_dir: str, *, ranks: int | None = None) -> dict[str, Any]:
    """Measure, write ``hardware.json`` and ``calibration.json`` into ``run_dir``; return the profile fields."""
    from launch.local import spawn_local

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    n = ranks or rc.plan.world_size or (torch.cuda.device_count() if cuda else min(4, os.cpu_count() or 2))
    threads = rc.train.threads or 1
    torch.set_num_threads(threads)
    probes = [speed_probe(rc, device)]  # the machine's speed as the profile measures it: before and after
    hbm = memory_bandwidth(device)
    shapes = model_gemms(rc)
    low_name = rc.train.precision if rc.train.precision in DTYPES else "fp32"
    low = DTYPES[low_name]
    r32, rows32 = gemm_rate(shapes, torch.float32, hbm, device)
    r16, rows16 = (r32, rows32) if low == torch.float32 else gemm_rate(shapes, low, hbm, device)
    attention = attention_fraction(rc, low, r16 if low != torch.float32 else r32, device)
    mc = model_config(rc.model)
    busy = n if cuda else min(n, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    per_rank = (
        spawn_local(
            _collectives_worker,
            n,
            tuple(range(2, n + 1)),
            threads,
            shapes[0],
            mc,
            rc.train.micro_batch,
            busy,
            low_name,
            rc.comm.bucket_mb,
        )
        if n > 1
        else {}
    )
    links = per_rank[0]["links"] if per_rank else []
    blocks = [b for r in per_rank.values() for b in r["block"]]
    gbps, latency_us = fit_links(links) if links else (hbm / 1e9, 0.0)
    fields = {
        "peak_tflops_16": r16 / 1e12,
        "peak_tflops_32": r32 / 1e12,
        "memory_bytes": float(torch.cuda.get_device_properties(0).total_memory if cuda else _host_memory()),
        "intra_node_gbps": gbps,
        "inter_node_gbps": gbps,  # one machine: no network measured
        "gpus_per_node": max(1, n),
        "efficiency": 1.0,
        "latency_us": latency_us,
        "hbm_gbps": hbm / 1e9,
        "attention_efficiency": attention,
        "collective_overhead_us": fit_collective_overhead(links, latency_us),
        "colocated_slowdown": fit_colocated_slowdown(blocks),
        "overlap_fraction": fit_overlap_fraction(per_rank[0].get("overlap") if per_rank else None),
    }
    fields.update(fit_kind_scales(per_rank[0].get("kinds") if per_rank else None, gbps))
    fields["ahead_call_us"] = fit_launched_ahead(per_rank[0].get("ahead") if per_rank else None, gbps, fields)
    probes.append(speed_probe(rc, device))  # after the ranks: the block's time is the two probes' mean
    probe = {"block_s": statistics.mean(p["block_s"] for p in probes), "before_after_s": [p["block_s"] for p in probes]}
    fields["block_overhead_us"] = block_overhead_us(rc, fields, probe["block_s"])
    fields["microbatch_overhead_us"], fields["step_overhead_us"] = host_overheads_us(rc, fields, device)
    fields["tp_call_us"] = fit_tp_call_us(per_rank[0].get("tp_block") if per_rank else None, rc, fields)
    profile = hardware_profile("calibrated", {"calibrated": fields})  # refuse what the planner would refuse
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    nested = {k: v for k, v in dataclasses.asdict(profile).items() if k != "name"}  # host costs under "host"
    (out / "hardware.json").write_text(json.dumps(nested, indent=1))
    raw = {
        "threads": threads,
        "gemm_fp32": rows32,
        "gemm_low": rows16,
        "allreduce": links,
        "block_busy_ranks": blocks,
        "overlap": per_rank[0].get("overlap") if per_rank else None,
        "launched_ahead": per_rank[0].get("ahead") if per_rank else None,
        "kinds": per_rank[0].get("kinds") if per_rank else None,
        "tp_block": per_rank[0].get("tp_block") if per_rank else None,
        "ranks": n,
        "probe": probe,
    }
    (out / "calibration.json").write_text(json.dumps(raw, indent=1))
    return fields


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_calibrate(rc: RecipeConfig, run_dir: str) -> dict[str, Any]:
    """``mode=calibrate``: measure, write, print where the profile went and how to use it."""
    t0 = time.perf_counter()
    fields = calibrate(rc, run_dir)
    path = Path(run_dir) / "hardware.json"
    print(
        f"calibrated in {time.perf_counter() - t0:.0f} s: GEMM {fields['peak_tflops_32'] * 1e3:.1f} GFLOP/s fp32, "
        f"memory {fields['hbm_gbps']:.1f} GB/s, all-reduce {fields['intra_node_gbps']:.2f} GB/s per rank, "
        f"latency {fields['latency_us']:.0f} µs + {fields['collective_overhead_us']:.0f} µs per collective, "
        f"slowdown {fields['colocated_slowdown']:.2f} per other busy rank, "
        f"{fields['overlap_fraction']:.0%} of an overlapped all-reduce hidden, "
        f"{fields['ahead_call_us']:.0f} µs per collective launched ahead, "
        f"all-gather / reduce-scatter at {fields['all_gather_bw_scale']:.2f} / "
        f"{fields['reduce_scatter_bw_scale']:.2f} × the all-reduce's bandwidth, "
        f"{fields['tp_call_us']:.0f} µs more per TP collective in the model, "
        f"fixed costs {fields['block_overhead_us']:.0f} µs per block, "
        f"{fields['microbatch_overhead_us']:.0f} µs per micro-batch, {fields['step_overhead_us']:.0f} µs per step"
        f"\nuse it: mode=plan plan.hardware={path}"
    )
    return {"hardware": str(path), **fields}
