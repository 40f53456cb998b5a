"""A sum reduce-scatter on gloo runs as an all-to-all and a local sum: the same result as
gloo's own reduce-scatter, the same bytes counted, and it is the path taken (issue 17)."""

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.testing import run_ranks


def _rank():
    n, me = dist.get_world_size(), dist.get_rank()
    x = torch.randn(n * 1000, generator=torch.Generator().manual_seed(me)) * (me + 1)
    native = torch.empty(1000)
    dist.reduce_scatter_tensor(native, x.clone())
    calls = []
    original = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        counter = comm.CommCounter()
        with counter:
            sync = torch.empty(1000)
            comm.reduce_scatter(sync, x.clone())
            out = torch.empty(1000)
            handle = comm.reduce_scatter(out, x.clone(), async_op=True)
            handle.wait()
            max_out = torch.empty(1000)
            comm.reduce_scatter(max_out, x.clone(), op=dist.ReduceOp.MAX)  # not a sum: gloo's own
    finally:
        dist.all_to_all_single = original
    from parallel.comm import gloo

    pool = gloo._A2A_BUFFERS[(x.numel(), x.dtype, x.device)]
    assert len(pool) == 1  # the second sum reused the first's buffers (fresh host buffers cost page faults)
    for size in range(1, gloo.A2A_POOL_SIZES + 2):  # a sweep over sizes keeps the last ones only
        comm.reduce_scatter(torch.empty(size), torch.ones(n * size))
    assert len(gloo._A2A_BUFFERS) == gloo.A2A_POOL_SIZES
    assert (x.numel(), x.dtype, x.device) not in gloo._A2A_BUFFERS
    assert gloo.runs_on_gloo(None, torch.device("cpu")) and not gloo.runs_on_gloo(None, torch.device("meta"))
    full = [torch.randn(n * 1000, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(n)]
    want_max = torch.stack(full).amax(0).view(n, -1)[me]
    return native, sync, out, max_out, want_max, len(calls), counter.sent_bytes(op="reduce_scatter")


def test_gloo_sum_reduce_scatter_equals_gloos_own_and_counts_the_same_bytes():
    n = 3
    for native, sync, out, max_out, want_max, calls, sent in run_ranks(_rank, n, timeout=60):
        torch.testing.assert_close(sync, native, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, native, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(max_out, want_max)
        assert calls == 2  # the two sums went through the all-to-all, the max did not
        assert sent == 3 * (n - 1) / n * n * 1000 * 4  # three reduce-scatters of n·1000 fp32 each


def _gather_rank():
    from parallel.comm import gloo

    n, me = dist.get_world_size(), dist.get_rank()
    big = gloo.GLOO_GATHER_BY_BROADCAST_BYTES // 4 // n + 7  # output just over the threshold
    results = []
    calls = []
    original = dist.broadcast
    dist.broadcast = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        counter = comm.CommCounter()
        with counter:
            for size, dtype in [(big, torch.float32), (2 * big, torch.bfloat16), (5, torch.float32)]:
                shard = (torch.arange(size) + 1000 * me).to(dtype)
                native = torch.empty(n * size, dtype=dtype)
                dist.all_gather_into_tensor(native, shard)
                ours = torch.empty(n * size, dtype=dtype)
                handle = comm.all_gather(ours, shard, async_op=True)
                handle.wait()
                sync = torch.empty(n * size, dtype=dtype)
                comm.all_gather(sync, shard)
                results.append((native, ours, sync))
    finally:
        dist.broadcast = original
    with pytest.raises(ValueError, match="differ"):  # as gloo's own refuses; the broadcasts would convert
        comm.all_gather(torch.empty(n * big), torch.ones(big, dtype=torch.bfloat16))
    return results, len(calls), counter.sent_bytes(op="all_gather")


def test_gloo_large_all_gather_by_broadcasts_equals_gloos_own_and_counts_the_same_bytes():
    from parallel.comm import gloo

    n = 3
    big = gloo.GLOO_GATHER_BY_BROADCAST_BYTES // 4 // n + 7
    for results, calls, sent in run_ranks(_gather_rank, n, timeout=60):
        for native, ours, sync in results:
            assert torch.equal(ours, native) and torch.equal(sync, native)
        assert calls == 2 * 2 * n  # the large fp32 and bf16 gathers (async and blocking): n broadcasts each
        per_call = [n * big * 4] * 2 + [n * 2 * big * 2] * 2 + [n * 5 * 4] * 2  # async and blocking
        assert sent == pytest.approx(sum(per_call) * (n - 1) / n)


def _in_place_rank():
    from parallel.comm import gloo

    n, me = dist.get_world_size(), dist.get_rank()
    results = []
    big = gloo.GLOO_GATHER_BY_BROADCAST_BYTES // 4 // n + 7  # the broadcast path; 5: gloo's own
    for size in (big, 5):
        x = torch.randn(n * size, generator=torch.Generator().manual_seed(me))
        want = torch.empty(size)
        dist.reduce_scatter_tensor(want, x.clone())
        buf = x.clone()
        handle = comm.reduce_scatter(buf[me * size : (me + 1) * size], buf, async_op=True)  # in place
        handle.wait()
        got = buf[me * size : (me + 1) * size].clone()
        buf = x.clone()  # a max on gloo runs gloo's own, in place too
        comm.reduce_scatter(buf[me * size : (me + 1) * size], buf, op=dist.ReduceOp.MAX)
        want_max = torch.empty(size)
        dist.reduce_scatter_tensor(want_max, x.clone(), op=dist.ReduceOp.MAX)
        gathered = torch.full((n * size,), -1.0)
        gathered[me * size : (me + 1) * size] = me + torch.arange(size) / size
        native = torch.empty(n * size)
        dist.all_gather_into_tensor(native, gathered[me * size : (me + 1) * size].clone())
        comm.all_gather(gathered, gathered[me * size : (me + 1) * size])  # in place
        results.append((want, got, want_max, buf[me * size : (me + 1) * size], native, gathered))
    return results


def test_reduce_scatter_and_all_gather_in_place_equal_the_out_of_place_ones():
    """ZeRO-1 reduce-scatters into its own range of the gradient buffer and gathers from its own
    range of the parameters (no fresh host buffer, no copy; issue 17): both paths of each, in place,
    equal gloo's own out of place."""
    for results in run_ranks(_in_place_rank, 2, timeout=60):
        for want, got, want_max, got_max, native, gathered in results:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            assert torch.equal(got_max, want_max)
            assert torch.equal(gathered, native)


def _misplaced_rank():
    me = dist.get_rank()
    errors = []
    buf = torch.ones(2 * 64)
    other = buf[(1 - me) * 64 : (2 - me) * 64]  # the OTHER rank's chunk: NCCL would read what it wrote
    for call in (lambda: comm.reduce_scatter(other, buf), lambda: comm.all_gather(buf, other)):
        with pytest.raises(ValueError, match="not this rank's chunk"):
            call()
        errors.append(True)
    disjoint = torch.ones(3 * 64)  # one storage, no overlap: allowed
    comm.reduce_scatter(disjoint[128:], disjoint[:128])
    return errors, disjoint[128:].tolist() == [2.0] * 64


def test_an_overlapping_buffer_that_is_not_this_ranks_chunk_is_refused():
    """The one in-place form is this rank's chunk (NCCL's rule); any other overlap of the two
    buffers is refused on every backend, before any collective, so a CPU run catches it."""
    assert run_ranks(_misplaced_rank, 2, timeout=60) == [([True, True], True)] * 2
