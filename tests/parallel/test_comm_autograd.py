"""The autograd TP regions: forward values, adjoint backward, bytes, and no traffic at tp=1."""

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.testing import run_ranks

FNS = {
    "copy": comm.copy_to_tp_region,
    "reduce": comm.reduce_from_tp_region,
    "scatter": comm.scatter_to_tp_region,
    "gather": comm.gather_from_tp_region,
    "sp_scatter": comm.scatter_to_sequence_parallel_region,
    "sp_gather": comm.gather_from_sequence_parallel_region,
    "sp_reduce_scatter": comm.reduce_scatter_to_sequence_parallel_region,
}


# Each region maps logical tensors: an input is either *replicated* (one tensor, the same on
# every rank) or *distinct* per rank (a shard, or a partial sum); the upstream gradient is
# either the *same* on every rank (the output is replicated and the loss counted once) or
# *per-rank* (each rank's output feeds its own part of a summed loss).
KINDS = {  # name: (input kind, upstream-gradient kind)
    "copy": ("replicated", "per-rank"),
    "reduce": ("distinct", "same"),
    "scatter": ("replicated", "per-rank"),
    "gather": ("distinct", "same"),
    "sp_scatter": ("replicated", "per-rank"),
    "sp_gather": ("distinct", "per-rank"),
    "sp_reduce_scatter": ("distinct", "per-rank"),
}


def _randn(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _input(name, r):
    return _randn(0 if KINDS[name][0] == "replicated" else r, (2, 4, 4))


def _upstream(name, r, shape):
    return _randn(100 + (r if KINDS[name][1] == "per-rank" else 0), shape)


def _expected(name, r, n):
    """(output, input gradient) on rank r, derived from the logical operation."""
    xs = [_input(name, q) for q in range(n)]
    out = {
        "copy": xs[r],
        "reduce": sum(xs),
        "scatter": xs[r].chunk(n, -1)[r],
        "gather": torch.cat(xs, -1),
        "sp_scatter": xs[r].chunk(n, 1)[r],
        "sp_gather": torch.cat(xs, 1),
        "sp_reduce_scatter": sum(xs).chunk(n, 1)[r],
    }[name]
    ws = [_upstream(name, q, out.shape) for q in range(n)]
    grad = {
        "copy": sum(ws),
        "reduce": ws[0],
        "scatter": torch.cat(ws, -1),
        "gather": ws[0].chunk(n, -1)[r],
        "sp_scatter": torch.cat(ws, 1),
        "sp_gather": sum(ws).chunk(n, 1)[r],
        "sp_reduce_scatter": torch.cat(ws, 1),
    }[name]
    return out, grad


def _rank(name):
    n, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(n)), group_desc="tp")
    x = _input(name, r).requires_grad_()
    counter = comm.CommCounter()
    with counter:
        y = FNS[name](x, group)
        y.backward(_upstream(name, r, y.shape))
    return y.detach(), x.grad, counter.sent_bytes("tp")


@pytest.mark.parametrize("name", list(FNS))
def test_forward_and_backward_on_two_ranks(name):
    n = 2
    results = run_ranks(_rank, n, name)
    for r, (y, grad, _) in enumerate(results):
        out, expected_grad = _expected(name, r, n)
        torch.testing.assert_close(y, out)
        torch.testing.assert_close(grad, expected_grad, msg=f"{name} grad on rank {r}")
    x_bytes = 2 * 4 * 4 * 4
    sent = {  # forward + backward, per rank, from the module docstring's table
        "copy": 2 * (n - 1) / n * x_bytes,
        "reduce": 2 * (n - 1) / n * x_bytes,
        "scatter": (n - 1) / n * x_bytes,
        "gather": (n - 1) / n * n * x_bytes,
        "sp_scatter": (n - 1) / n * x_bytes,
        "sp_gather": 2 * (n - 1) / n * n * x_bytes,
        "sp_reduce_scatter": 2 * (n - 1) / n * x_bytes,
    }[name]
    assert results[0][2] == pytest.approx(sent)


@pytest.mark.parametrize("name", list(FNS))
def test_no_group_is_identity_and_silent(name):
    x = torch.randn(2, 4, 4, requires_grad=True)
    counter = comm.CommCounter()
    with counter:
        y = FNS[name](x, None)
        y.sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))
    assert counter.calls() == 0


def _indivisible():
    group = dist.new_group([0, 1], group_desc="tp")
    try:
        comm.scatter_to_sequence_parallel_region(torch.zeros(1, 3, 4), group)
    except comm.SplitError as e:
        comm.all_reduce(torch.zeros(1), group=group)  # both ranks done with the group before exiting
        return str(e)


def test_indivisible_split_is_refused_with_numbers():
    msg = run_ranks(_indivisible, 2)[0]
    assert "size 3" in msg and "tensor-parallel size 2" in msg
