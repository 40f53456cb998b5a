"""Helpers every benchmark shares: alternating timers, spread statistics, and
making PyTorch's own collectives visible to :class:`parallel.comm.CommCounter`.

Benchmark-only code: never imported by ``parallel/``, ``models/`` or ``recipes/``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from parallel import comm


def time_alternating(
    steps_by_name: dict[str, Callable[[], object]],
    steps: int,
    warmup: int = 2,
    barrier: bool = True,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each contender's step, ``steps`` rounds after ``warmup`` rounds.

    Each round runs every contender once, so that a change in machine load (other
    processes on shared cores) hits all of them alike; odd rounds run them in
    reverse order, so that no contender always goes first (after the barrier, with
    caches left by another model) or always follows the same one. With
    ``barrier`` all ranks start each step together (a benchmark-only barrier
    that moves no payload). ``cpu``: if given, filled with each step's CPU seconds of this
    process (``time.process_time``: all its threads, gloo's included), which other
    processes on shared cores do not inflate as they inflate wall time."""
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}
    if cpu is not None:
        cpu.update({name: [] for name in steps_by_name})
    order = list(steps_by_name.items())
    for i in range(steps + warmup):
        for name, step in order if i % 2 == 0 else order[::-1]:
            if barrier:
                comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                if cpu is not None:
                    cpu[name].append(time.process_time() - c0)
    return times


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Per round, the slowest rank's time (a step ends when its last rank ends)."""
    return [max(r[i] for r in per_rank) for i in range(len(per_rank[0]))]


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile of ``xs`` (``0 ≤ q ≤ 1``)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def compare(ours: list[float], theirs: list[float]) -> dict:
    """Median step times and the per-round ratio ours/theirs with its spread.

    Each round ran both contenders back to back under the same load, so the
    ratio is taken round by round; ``ratio`` is its median, ``ratio_lo`` /
    ``ratio_hi`` its 25th and 75th percentiles."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"need the same non-zero number of rounds, got {len(ours)} and {len(theirs)}")
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {
        "ours_ms": 1e3 * statistics.median(ours),
        "theirs_ms": 1e3 * statistics.median(theirs),
        "ratio": statistics.median(ratios),
        "ratio_lo": quantile(ratios, 0.25),
        "ratio_hi": quantile(ratios, 0.75),
        "rounds": len(ratios),
    }


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2) -> this rank's shard


def torch_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind parameters, gradients and optimizer state."""
    tensors = [local_tensor(p) for p in model.parameters()]
    tensors += [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [
        local_tensor(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    ]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# torch.distributed collectives PyTorch's own wrappers call; counted only while COUNT_TORCH["on"]
_WRAPPED = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
}
_ORIGINAL: dict = {}
COUNT_TORCH = {"on": False}


def count_torch_collectives() -> None:
    """Report torch.distributed's collectives to parallel.comm's counter (benchmark only;
    idempotent). Counting happens while ``COUNT_TORCH["on"]`` is true."""
    for name, op in _WRAPPED.items():
        if name in _ORIGINAL or not hasattr(dist, name):
            continue
        _ORIGINAL[name] = original = getattr(dist, name)

        def counted(*args, _original=original, _op=op, **kwargs):
            if COUNT_TORCH["on"]:
                group = kwargs.get("group")
                # all_reduce/broadcast: the tensor; all_gather: the (gathered) output; reduce_scatter: the input
                names = ("input",) if _op == "reduce_scatter" else ("tensor", "output_tensor")
                pos = 1 if _op == "reduce_scatter" else 0
                t = args[pos] if len(args) > pos else next(kwargs[n] for n in names if n in kwargs)
                comm.record(comm.group_label(group), _op, t.numel() * t.element_size(), dist.get_world_size(group))
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def ddp_comm_hook(_, bucket):
    """DDP's default all-reduce of one bucket, made visible to the counter."""
    count_torch_collectives()
    t = bucket.buffer().div_(dist.get_world_size())
    comm.record("world", "all_reduce", t.numel() * t.element_size(), dist.get_world_size())
    return _ORIGINAL["all_reduce"](t, async_op=True).get_future().then(lambda f: f.value()[0])


@contextlib.contextmanager
def counting_torch(counter: comm.CommCounter | None):
    """Count torch.distributed's collectives into ``counter`` inside the block (no-op for None)."""
    if counter is None:
        yield
        return
    count_torch_collectives()
    COUNT_TORCH["on"] = True
    try:
        with counter:
            yield
    finally:
        COUNT_TORCH["on"] = False
