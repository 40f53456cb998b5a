"""Timing on this machine for ``mode=calibrate``: the timers, the model's GEMMs, memory bandwidth,
flash attention, the block a CPU rank runs, the speed probe and the host's fixed costs."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

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
#: and the first to arrive waits for the last), too noisily to fit a slope from (docs/planner.md)
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
