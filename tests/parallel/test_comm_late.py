"""Late-completion mode: blocking collectives return once issued, as NCCL's do for the host."""

import time

import torch
import torch.distributed as dist

from parallel import comm
from parallel.testing import run_ranks

LAG = 0.5  # seconds rank 1 arrives late


def _timed_collectives():
    """Rank 1 joins every collective LAG late; rank 0 reports how long each call held it."""
    rank = dist.get_rank()
    out = {}
    with comm.late_completion():
        t = torch.tensor([rank + 1.0])
        if rank == 1:
            time.sleep(LAG)
        t0 = time.perf_counter()
        comm.all_reduce(t)
        out["issue_s"] = time.perf_counter() - t0  # queued only
        out["pending"] = comm.pending_count()
        doubled = t * 2  # a device op on the result is ordered after the collective
        out["value"] = doubled.item()
        out["read_s"] = time.perf_counter() - t0
        g = torch.zeros(4)
        comm.all_gather(g, torch.full((2,), float(rank)))
        out["gathered"] = g.tolist()
        if rank == 1:
            time.sleep(LAG)
        t0 = time.perf_counter()
        comm.barrier()
        out["barrier_s"] = time.perf_counter() - t0
        out["pending_after_barrier"] = comm.pending_count()
        comm.broadcast(torch.zeros(1), src=0)  # left pending: completed when the block ends
    out["pending_after_block"] = comm.pending_count()
    return out


def test_blocking_collectives_return_early_and_complete_on_host_reads_and_barriers():
    r0, r1 = run_ranks(_timed_collectives, 2, timeout=60)
    assert r0["issue_s"] < LAG / 2 and r0["pending"] == 1  # returned without waiting for rank 1
    assert r0["read_s"] >= LAG * 0.8  # ... but reading the result waited for it
    assert r0["value"] == r1["value"] == 6.0
    assert r0["gathered"] == r1["gathered"] == [0.0, 0.0, 1.0, 1.0]
    assert r0["barrier_s"] >= LAG * 0.8  # a real barrier: the host waits for the late rank
    assert r0["pending_after_barrier"] == 0 and r0["pending_after_block"] == r1["pending_after_block"] == 0


def _plain():
    t = torch.ones(1)
    comm.all_reduce(t)
    return comm.pending_count(), t.item()


def test_outside_the_mode_collectives_complete_before_returning():
    assert run_ranks(_plain, 2, timeout=60) == [(0, 2.0), (0, 2.0)]
