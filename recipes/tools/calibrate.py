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
import torch.nn.functional as F

from parallel.plan import hardware_profile

from ..config import RecipeConfig, model_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMALL, LARGE = 4 * 2**10, 8 * 2**20  # all-reduce payloads: latency, bandwidth


def _time(
    fn, min_s: float = 0.1, device: torch.device | None = None, reps: int | None = None, stat=statistics.median
) -> float:
    """``stat`` (the median: the typical time, what a training step that runs the op many times pays;
    the minimum is the luckiest repeat, 7–15 % faster than the median for a block on a CPU, and hides
    part of ranks slowing each other down: two processes on two cores 1.03–1.13× by the minimum,
    1.10–1.4× by the median in two trials) of the seconds of ``fn()`` over repeats filling ``min_s``, or exactly ``reps`` (collectives:
    every rank must call as often), after one warm-up. Measure on a quiet machine (``benchmarks/plan.py``
    waits for one)."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while (len(times) < reps) if reps else (time.perf_counter() - start < min_s or len(times) < 5):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return stat(times)


#: collectives are timed in this many rounds of fixed repeats; the quietest round's mean counts
ROUNDS = 5


def _quietest(fn, device: torch.device, reps: int) -> float:
    """The lowest of :data:`ROUNDS` rounds' mean seconds of ``reps`` calls of ``fn``: the mean is what a
    step issuing many such calls pays (a collective's cost is bimodal: fast when both ranks arrive
    hot, ≈ 1 ms when one has to be woken), the quietest round the one other jobs on a shared machine
    disturbed least. A fixed count: every member of a group calls it equally often."""
    return min(_time(fn, device=device, reps=reps, stat=statistics.mean) for _ in range(ROUNDS))


#: rounds of the paired measurements (a collective's fixed cost, overlap): many, each short
PAIRED_ROUNDS = 15


def _paired(
    fns: dict, device: torch.device, reps: int, rounds: int = PAIRED_ROUNDS, stats: dict | None = None
) -> list[dict[str, float]]:
    """Per round, the mean seconds (or ``stats[name]`` of them) of ``reps`` calls of each of ``fns``
    (by name), run one after the
    other in the same round: a difference or ratio between them is taken within a round (the machine's
    state drifts between rounds on a shared host: both sides of a difference see the same drift), and
    its median over rounds is what counts (:func:`fit_collective_overhead`, :func:`fit_overlap_fraction`).
    A fixed count: every member of a group calls each as often."""
    stats = stats or {}
    return [
        {k: _time(fn, device=device, reps=reps, stat=stats.get(k, statistics.mean)) for k, fn in fns.items()}
        for _ in range(rounds)
    ]


def _typical(fn, device: torch.device, reps: int) -> float:
    """The median of :data:`ROUNDS` rounds' mean seconds of ``reps`` calls of ``fn`` (a fixed count):
    for costs that depend on the ranks' arrival skew, where the quietest round would be the luckiest."""
    return statistics.median(_time(fn, device=device, reps=reps, stat=statistics.mean) for _ in range(ROUNDS))


def model_gemms(rc: RecipeConfig) -> list[tuple[int, int, int]]:
    """The ``(M, K, N)`` of the configured model's GEMMs on one TP rank (plan.compute's shapes)."""
    mc = model_config(rc.model)
    t, T, d = rc.parallel.tp, rc.train.micro_batch * mc.seq_len, mc.d_model
    kv = mc.n_kv_heads * mc.head_dim
    mlp_in = (2 if mc.arch == "llama" else 1) * mc.d_ff
    return [
        (T, d, (d + 2 * kv) // t),
        (T, d // t, d),
        (T, d, mlp_in // t),
        (T, mc.d_ff // t, d),
        (T, d, mc.padded_vocab(t) // t),
    ]


def memory_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 64 MiB copy (bytes read + written)."""
    x = torch.empty(16 * 2**20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _time(lambda: y.copy_(x), device=device)


def gemm_rate(shapes, dtype: torch.dtype, hbm: float, device: torch.device) -> tuple[float, list[dict]]:
    """Least-squares ``R`` of ``t − bytes/HBM = flops/R`` over ``shapes``; and each measurement."""
    e = torch.finfo(dtype).bits // 8
    rows, num, den = [], 0.0, 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        s = _time(lambda: a @ b, device=device)  # noqa: B023
        flops, rest = 2.0 * m * k * n, max(s - e * (m * k + k * n + m * n) / hbm, 1e-9)
        num, den = num + flops * flops, den + flops * rest
        rows.append({"m": m, "k": k, "n": n, "seconds": s, "tflops": flops / s / 1e12})
    return num / den, rows


def attention_fraction(rc: RecipeConfig, dtype: torch.dtype, rate: float, device: torch.device) -> float:
    """Achieved causal SDPA FLOP/s (half of ``4·b·s²·d``) over ``rate``, clipped to (0, 1]."""
    mc = model_config(rc.model)
    b, h, s, hd = rc.train.micro_batch, max(1, mc.n_heads // rc.parallel.tp), mc.seq_len, mc.head_dim
    q, k, v = (torch.randn(b, h, s, hd, dtype=dtype, device=device) for _ in range(3))
    sec = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device=device)
    return min(1.0, max(1e-6, 2.0 * b * h * s * s * hd / sec / rate))


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


#: repeats per paired round of a micro-batch and a block (``microbatch_overhead_us``)
MB_REPS = 3


def host_overheads_us(rc: RecipeConfig, fields: dict, device: torch.device) -> tuple[float, float]:
    """(``microbatch_overhead_us``, ``step_overhead_us``): what one micro-batch through the whole
    configured model (embedding, blocks, head, cross-entropy; forward + backward) and one step
    (gradient clipping's norm, the recipe's optimizer step, zero_grad) take beyond what the planner's
    work model gives them with ``fields``; the micro-batch's is the median over paired rounds of the
    micro-batch less the model's blocks at the first block's time in the same round (the median of its
    calls, as the planner's block time is the probe's median; ``block_overhead_us`` included) and the
    head's work. Measured on the model's own
    modules and the recipe's own optimizer in this process."""
    from models.transformer import build_model
    from parallel.plan import ModelShape
    from parallel.plan.compute import head_time, optimizer_seconds
    from parallel.plan.hardware import Hardware

    from ..training.gpt_engine import optimizer_factory

    mc = model_config(rc.model)
    dtype = DTYPES.get(rc.train.precision, torch.float32)
    b = rc.train.micro_batch
    model = build_model(mc, device=device, dtype=dtype)
    ids = torch.randint(mc.vocab_size, (b, mc.seq_len), device=device)
    block, _ = _block_step(mc, b, dtype, device)
    # paired rounds (≈ 1 s): the micro-batch and one block timed in the same round, so the residual
    # (a few % of the micro-batch) is taken where both saw the same machine speed
    # the block as the planner's block time is taken: the median of its calls (speed_probe, _time)
    fns = {"mb_s": lambda: model.loss(model(ids), ids).backward(), "block_s": block}
    rounds = _paired(fns, device, MB_REPS, stats={"block_s": statistics.median})
    hw = Hardware.from_fields("calibrating", {**fields, "microbatch_overhead_us": 0.0, "step_overhead_us": 0.0})
    head = head_time(ModelShape.of(mc), b, 1, hw, rc.train.precision)
    # the planner's blocks (work + block_overhead_us, the probe's block time) at the round's block time
    residual = statistics.median(r["mb_s"] - mc.n_layers * r["block_s"] for r in rounds)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer_factory(rc, device)([{"params": params}])

    def step():
        torch.nn.utils.clip_grad_norm_(params, rc.train.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=False)

    sec_step = _time(step, min_s=0.3, device=device)
    opt_work = optimizer_seconds(sum(p.numel() for p in params), hw)
    return max(0.0, residual - head.forward - head.backward) * 1e6, max(0.0, sec_step - opt_work) * 1e6


#: seconds of compute before each collective when measuring its fixed cost: ≈ the compute between a
#: TP block's collectives at the benchmark's size. The cost grows with it (the ranks' compute jitters
#: and the first to arrive waits for the last): ≈ 1.5 ms after 1 ms, 1.2–3.3 ms after a 3 ms block on
#: the 2-core VM this was written on, too noisy to fit a slope from (docs/planner.md)
COMPUTE_BEFORE_S = 1e-3
COLLECTIVE_REPS, BLOCK_REPS, OVERLAP_REPS, TP_REPS = 20, 100, 10, 10


def _block(mc, micro_batch: int, dtype: torch.dtype, device: torch.device):
    """The configured model's first block and an input for it at ``micro_batch``."""
    from models.transformer import build_model

    block = build_model(mc, layers=range(0, 1), has_embedding=False, has_head=False, device=device, dtype=dtype)
    x = torch.randn(micro_batch, mc.seq_len, mc.d_model, device=device, dtype=dtype, requires_grad=True)
    return block, x


def _block_step(mc, micro_batch: int, dtype: torch.dtype, device: torch.device):
    """A function running one forward + backward of the configured model's first block."""
    block, x = _block(mc, micro_batch, dtype, device)
    return lambda: block(x).float().sum().backward(), sum(p.numel() for p in block.parameters())


def unit_buckets(module: torch.nn.Module, bucket_mb: float = 25.0) -> list[int]:
    """The element counts of the buckets ZeRO packs ``module``'s parameters into as one unit, by the
    engine's own rule (:func:`parallel.zero.layout.plan_buckets`): per bucket class
    (:func:`parallel.zero.packing.bucket_class`: weight decay or not, …) in packing order, a class
    above ``bucket_mb`` (``comm.bucket_mb``) at the parameters' element size split into several buckets."""
    from parallel.params import wants_weight_decay
    from parallel.zero.layout import plan_buckets
    from parallel.zero.packing import extra_reduce

    params = [
        (n, tuple(p.shape), wants_weight_decay(p), 0, extra_reduce(p))
        for n, p in module.named_parameters()
        if p.requires_grad
    ]
    elem = next(module.parameters()).element_size()
    return [b.numel for b in plan_buckets(params, dp=1, bucket_bytes=int(bucket_mb * 2**20), element_size=elem)]


#: seconds :func:`speed_probe` times for (a few hundred block steps at the benchmark's size)
PROBE_S = 1.0


def speed_probe(rc: RecipeConfig, device: torch.device | None = None, min_s: float = PROBE_S) -> dict[str, float]:
    """This machine's speed now, at the configured model's shapes: ``block_s``, the median seconds of
    one forward + backward of the model's first block at its micro-batch (its GEMMs, attention,
    elementwise work and the host's cost per op: what most of a step is made of on a CPU) over
    ``min_s`` seconds of repeats, in the run's precision and this process's threads. :func:`calibrate`
    records it (``calibration.json``'s ``probe``) beside the profile it measures; the same probe taken
    later, over the calibration's, is how much slower the machine has become since
    (:func:`probe_factor`; ``benchmarks/plan.py`` takes it just before each layout)."""
    device = device or torch.device("cpu")
    mc = model_config(rc.model)
    step, _ = _block_step(mc, rc.train.micro_batch, DTYPES.get(rc.train.precision, torch.float32), device)
    return {"block_s": _time(step, min_s=min_s, device=device)}


def probe_factor(calibration: dict[str, float], now: dict[str, float]) -> float:
    """How many times slower the machine runs now than during the calibration: the ratio of the two
    probes' block times (:func:`speed_probe`); > 1 slower, < 1 faster."""
    return now["block_s"] / calibration["block_s"]


def _collectives_worker(
    sizes: tuple[int, ...],
    threads: int,
    shape: tuple[int, int, int],
    mc=None,
    micro_batch: int = 1,
    busy: int = 1,
    precision: str = "fp32",
    bucket_mb: float = 25.0,
) -> dict:
    """One spawned rank: all-reduces of ``SMALL`` and ``LARGE`` bytes in groups of the first n ranks
    (``torch.distributed`` directly: the ring's latency and bandwidth), a ``SMALL`` all-reduce through
    ``parallel.comm`` after ``COMPUTE_BEFORE_S`` of ``shape``'s GEMMs (the fixed host cost), and the
    block of ``mc`` alone on rank 0 and on k = 2…``busy`` ranks at once (``colocated_slowdown``), and on
    every rank the block, an all-reduce of its gradients, and that all-reduce launched (asynchronously)
    before the block (``overlap_fraction``).
    Every rank issues the same barriers in the same order; only a group's members time."""
    import torch.distributed as dist

    from parallel import comm
    from parallel.groups import default_device, init_distributed

    torch.set_num_threads(threads)
    rank, world = init_distributed(timeout_s=120)
    device = default_device(dist.get_backend(), int(os.environ.get("LOCAL_RANK", "0")))
    m, k, n_ = shape
    a, b = torch.randn(m, k, device=device), torch.randn(k, n_, device=device)
    one = _time(lambda: a @ b, device=device)
    repeats = max(1, round(COMPUTE_BEFORE_S / max(one, 1e-9)))

    def gemms():
        for _ in range(repeats):
            a @ b

    block = _block_step(mc, micro_batch, DTYPES.get(precision, torch.float32), device) if mc is not None else None

    out: dict = {"links": [], "block": []}
    for n in sizes:
        group = dist.new_group(list(range(n)))  # every rank creates every group, in the same order
        row = {"n": n}
        for name, nbytes, reps in (("small_s", SMALL, 10), ("large_s", LARGE, 3)):
            x = torch.ones(nbytes // 4, device=device)
            if rank < n:  # a fixed count: the group's members issue the same collectives
                fn = lambda: dist.all_reduce(x, group=group)  # noqa: B023, E731
                row[name] = _quietest(fn, device, reps)
            dist.barrier()
        x = torch.ones(SMALL // 4, device=device)
        if rank < n:
            after = lambda: (gemms(), comm.all_reduce(x, group=group))  # noqa: B023, E731
            rounds = _paired({"compute_s": gemms, "after_compute_s": after}, device, COLLECTIVE_REPS)
            row["rounds"] = rounds
            row["compute_s"] = statistics.median(r["compute_s"] for r in rounds)
            row["after_compute_s"] = statistics.median(r["after_compute_s"] for r in rounds)
        dist.barrier()
        out["links"].append(row)
    if mc is not None:
        step, numel = block
        for ranks_busy in range(1, busy + 1):  # rank 0 alone, then 2…busy ranks at once
            dist.barrier()
            if rank < ranks_busy:
                out["block"].append({"k": ranks_busy, "s": _time(step, device=device, reps=BLOCK_REPS)})
        dist.barrier()
        grads = torch.ones(numel, device=device)  # one block's gradients, reduced over every rank (the last group)

        def both():
            work = comm.all_reduce(grads, group=group, async_op=True)
            step()
            work.wait()

        rounds = _paired(
            {"block_s": step, "comm_s": lambda: comm.all_reduce(grads, group=group), "both_s": both},
            device,
            OVERLAP_REPS,
        )
        out["overlap"] = {k: statistics.median(r[k] for r in rounds) for k in ("block_s", "comm_s", "both_s")}
        out["overlap"]["rounds"] = rounds
        dist.barrier()
        unit, x_unit = _block(mc, micro_batch, DTYPES.get(precision, torch.float32), device)
        out["kinds"] = _unit_kinds(numel, group, device)
        dist.barrier()
        out["ahead"] = _launched_ahead(unit, x_unit, group, device, bucket_mb)
        dist.barrier()
        out["tp_block"] = _tp_block(mc, micro_batch, DTYPES.get(precision, torch.float32), device)
        dist.barrier()
    dist.destroy_process_group()
    return out


#: the tensor-parallel size the in-situ TP collective cost is measured at (``tp_call_us``)
TP_CALIBRATION = 2


def _tp_block(mc, micro_batch: int, dtype: torch.dtype, device: torch.device) -> dict | None:
    """TP's collectives where and as often as training issues them: one micro-batch through the
    configured model (embedding, blocks, head, cross-entropy; forward + backward) built at
    tp = :data:`TP_CALIBRATION` over ranks 0–1, its blocking collectives inside the model's autograd
    between the pieces of the compute; the median over paired rounds of its mean seconds, and the TP
    calls one micro-batch issues (``parallel.comm``'s counter). Every rank creates the group; its
    members time. None when the model does not split that way (``tp_call_us`` then stays 0)."""
    import torch.distributed as dist

    from models.config import ModelConfigError
    from models.transformer import build_model
    from parallel import comm

    try:
        mc.validate(tp=TP_CALIBRATION)
    except ModelConfigError:
        return None
    group = dist.new_group(list(range(TP_CALIBRATION)))  # every rank, in the same order
    if dist.get_rank() >= TP_CALIBRATION:
        return None
    model = build_model(mc, tp_group=group, device=device, dtype=dtype)
    ids = torch.randint(mc.vocab_size, (micro_batch, mc.seq_len), device=device)

    def step():
        model.loss(model(ids), ids).backward()

    counter = comm.CommCounter()
    with counter:
        step()
    calls = sum(s["calls"] for ops in counter.summary().values() for s in ops.values())
    rounds = _paired({"model_s": step}, device, TP_REPS, rounds=ROUNDS)
    return {
        "tp": TP_CALIBRATION,
        "micro_batch": micro_batch,
        "calls": calls,
        "s": statistics.median(r["model_s"] for r in rounds),
    }


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


def _unit_kinds(numel: int, group, device: torch.device) -> dict:
    """What each kind costs through ``parallel.comm`` (the engine's paths: on gloo a sum
    reduce-scatter as an all-to-all, an all-gather of ≥ 1 MiB as broadcasts) on ``numel`` fp32
    elements, a ZeRO unit's parameters, and on :data:`SMALL` bytes (the kind's own fixed cost):
    blocking calls, both sizes of both kinds in each of :data:`PAIRED_ROUNDS` rounds (:func:`_paired`;
    a single call's cost is bimodal here, so differences are taken within a round). Every member of
    ``group`` calls."""
    from parallel import comm

    n = comm.group_size(group)
    row: dict = {"n": n}
    fns = {}
    for size, suffix in ((numel, ""), (SMALL // 4, "_small")):
        shard, full = torch.ones(-(-size // n), device=device), torch.ones(n * -(-size // n), device=device)
        row["payload_bytes" + suffix] = full.numel() * 4
        fns["all_gather_s" + suffix] = lambda f=full, s=shard: comm.all_gather(f, s, group=group)
        fns["reduce_scatter_s" + suffix] = lambda f=full, s=shard: comm.reduce_scatter(s, f, group=group)
    row["rounds"] = _paired(fns, device, COLLECTIVE_REPS // 2)
    return row


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


def _launched_ahead(
    block: torch.nn.Module, x: torch.Tensor, group, device: torch.device, bucket_mb: float = 25.0
) -> dict:
    """ZeRO-3's collectives as the engine issues them: a unit's buckets (:func:`unit_buckets`, the
    block's parameters packed by class and split above ``bucket_mb`` as the engine packs them; fp32 buffers) launched together asynchronously, all-gathers (the
    prefetch) or reduce-scatters (from the unit's backward hook), then the block's own forward (the
    compute a prefetch hides behind; ≈ 1 ms at the benchmark's size), then the waits; paired rounds
    (:func:`_paired`) with the forward alone. Every member of ``group`` calls."""
    from parallel import comm

    n = comm.group_size(group)
    sizes = unit_buckets(block, bucket_mb)
    bufs = [(torch.ones(-(-s // n), device=device), torch.ones(n * -(-s // n), device=device)) for s in sizes]

    def compute():
        block(x)

    def gather():
        works = [comm.all_gather(full, shard, group=group, async_op=True) for shard, full in bufs]
        compute()
        for w in works:
            w.wait()

    def scatter():
        works = [comm.reduce_scatter(shard, full, group=group, async_op=True) for shard, full in bufs]
        compute()
        for w in works:
            w.wait()

    rounds = _paired(
        {"compute_s": compute, "all_gather_s": gather, "reduce_scatter_s": scatter}, device, COLLECTIVE_REPS
    )
    return {"n": n, "payload_bytes": sum(full.numel() for _, full in bufs) * 4, "buckets": sizes, "rounds": rounds}


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
