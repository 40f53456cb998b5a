"""The ranks ``mode=calibrate`` spawns: collectives' latency and bandwidth, their fixed costs after
compute, overlap, busy-rank slowdown, the kinds through ``parallel.comm``, calls launched ahead and TP
in situ."""

from __future__ import annotations

import os
import statistics

import torch

from .calibrate_timing import (
    BLOCK_REPS,
    COLLECTIVE_REPS,
    COMPUTE_BEFORE_S,
    DTYPES,
    LARGE,
    OVERLAP_REPS,
    ROUNDS,
    SMALL,
    TP_REPS,
    _block,
    _block_step,
    _paired,
    _quietest,
    _time,
    unit_buckets,
)


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
