"""Autograd-aware tensor-parallel communication (Megatron's "f", "g" and friends).

Each function is a collective whose backward is its adjoint under Megatron's
conventions (a tensor is either replicated on every rank, a shard, or a partial
sum; a replicated loss counts once), so a layer written with them gets the
single-process gradients from ``loss.backward()``. All
traffic goes through :mod:`parallel.comm` and is counted under the group's label.
With ``group=None`` or a group of one rank every function is the identity (or a
plain copy) and communicates nothing.

Notation: ``X`` is the bytes of the function's *input* tensor, ``N`` the group
size; "bytes sent" is per rank, as :class:`~parallel.comm.CommCounter` counts.

* ``copy_to_tp_region`` ("f"): forward identity; backward all-reduce (X bytes).
* ``reduce_from_tp_region`` ("g"): forward all-reduce (X); backward identity.
* ``scatter_to_tp_region``: forward keeps this rank's last-dim chunk; backward
  all-gathers the gradient's last dim (output X).
* ``gather_from_tp_region``: forward all-gathers the last dim (output N·X);
  backward keeps this rank's chunk.
* ``scatter_to_sequence_parallel_region``: forward keeps this rank's sequence
  chunk; backward all-gathers the sequence (output X).
* ``gather_from_sequence_parallel_region``: forward all-gathers the sequence
  (output N·X); backward reduce-scatters the gradient (input N·X).
* ``reduce_scatter_to_sequence_parallel_region``: forward reduce-scatters along
  the sequence (input X); backward all-gathers the gradient (output X).

Bytes *sent* per rank follow :data:`parallel.comm.SENT_FRACTION`: ``2(N-1)/N`` of
the buffer for an all-reduce, ``(N-1)/N`` of the full buffer for an all-gather or
a reduce-scatter.

Sequence-parallel activations are ``[batch, seq, ...]``; the sequence is dim 1
(``SEQ_DIM``) and rank ``r`` holds positions ``[r·s/N, (r+1)·s/N)``.
An all-gather/reduce-scatter pair moves ``2 (N-1)/N`` of the full buffer, exactly
what the all-reduce it replaces moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C
from . import traceable

SEQ_DIM = 1


class SplitError(ValueError):
    """A tensor cannot be split evenly over the tensor-parallel group."""


def tp_world_size(group) -> int:
    """Ranks in ``group``; ``None`` means "no tensor parallelism" (1), not the world."""
    return 1 if group is None else C.group_size(group)


def tp_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(x: torch.Tensor, dim: int, n: int, what: str) -> None:
    if x.shape[dim] % n:
        raise SplitError(
            f"{what}: dim {dim} of a tensor of shape {tuple(x.shape)} has size {x.shape[dim]}, "
            f"not divisible by the tensor-parallel size {n}; make it a multiple of {n}"
        )


def split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    n = tp_world_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "split")
    return x.chunk(n, dim)[tp_rank(group)].contiguous()


def all_gather_along(x: torch.Tensor, dim: int, group, *, regather: bool = False) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all-gather of N·X bytes). ``regather``: this is a
    backward gathering again what its forward gathered (kept a transfer of its own when compiled:
    :func:`parallel.comm.traceable.all_gather_along`)."""
    n = tp_world_size(group)
    if n == 1:
        return x
    if traceable.tracing():  # under torch.compile: one opaque, counted node (parallel.comm.traceable)
        return torch.ops.gridtrain.all_gather_along(x, dim, group.group_name, n, regather)
    out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    C.all_gather(out, x.contiguous().view(-1), group=group)
    return torch.cat(out.view((n,) + tuple(x.shape)).unbind(0), dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk along ``dim`` (reduce-scatter of X)."""
    n = tp_world_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "reduce-scatter")
    if traceable.tracing():
        return torch.ops.gridtrain.reduce_scatter_along(x, dim, group.group_name, n)
    stacked = torch.stack(x.chunk(n, dim), 0)
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    C.reduce_scatter(out.view(-1), stacked.view(-1), group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the group, out of place (all-reduce of X)."""
    return _all_reduce(x, group, "sum")


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Elementwise maximum of ``x`` over the group, out of place (all-reduce of X)."""
    return _all_reduce(x, group, "max")


def _all_reduce(x: torch.Tensor, group, kind: str) -> torch.Tensor:
    if tp_world_size(group) == 1:
        return x
    if traceable.tracing():  # under torch.compile: one opaque, counted node (parallel.comm.traceable)
        return torch.ops.gridtrain.same_shape_collective(x, f"all_reduce_{kind}", group.group_name)
    out = x.contiguous().clone()
    C.all_reduce(out, group=group, op=C.ReduceOp.SUM if kind == "sum" else C.ReduceOp.MAX)
    return out


def all_to_all_chunks(x: torch.Tensor, group) -> torch.Tensor:
    """Out of place all-to-all of ``x``'s equal dim-0 chunks: chunk i goes to rank i (X bytes)."""
    if tp_world_size(group) == 1:
        return x
    if traceable.tracing():
        return torch.ops.gridtrain.same_shape_collective(x, "all_to_all_chunks", group.group_name)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    C.all_to_all(out, x.contiguous(), group=group)
    return out


def autograd_pair(name: str, forward, backward, dim: int | None = None) -> type[torch.autograd.Function]:
    """An autograd Function named ``name``: ``forward(x, [dim,] group)``, its gradient
    ``backward(grad, [dim,] group)`` (a collective and its adjoint)."""
    along = () if dim is None else (dim,)

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, *along, group)

    def bwd(ctx, grad):
        return backward(grad, *along, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


# each forward with its adjoint (the module docstring's table)
_CopyToRegion = autograd_pair("_CopyToRegion", lambda x, group: x.view_as(x), all_reduce_sum)
_ReduceFromRegion = autograd_pair("_ReduceFromRegion", all_reduce_sum, lambda grad, group: grad)
_ScatterLastDim = autograd_pair("_ScatterLastDim", split_along, all_gather_along, dim=-1)
_GatherLastDim = autograd_pair("_GatherLastDim", all_gather_along, split_along, dim=-1)
_ScatterSeq = autograd_pair("_ScatterSeq", split_along, all_gather_along, dim=SEQ_DIM)
_GatherSeq = autograd_pair("_GatherSeq", all_gather_along, reduce_scatter_along, dim=SEQ_DIM)
_ReduceScatterSeq = autograd_pair("_ReduceScatterSeq", reduce_scatter_along, all_gather_along, dim=SEQ_DIM)


def _apply(fn, x: torch.Tensor, group) -> torch.Tensor:
    return x if tp_world_size(group) == 1 else fn.apply(x, group)


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """ "f": identity forward; backward all-reduces the gradient (X bytes, 2(N-1)/N·X sent)."""
    return _apply(_CopyToRegion, x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """ "g": forward all-reduces the partial sums (X bytes, 2(N-1)/N·X sent); backward identity."""
    return _apply(_ReduceFromRegion, x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward keeps this rank's chunk of the last dim; backward all-gathers it (X bytes)."""
    if tp_world_size(group) > 1:
        _check_divisible(x, -1, tp_world_size(group), "scatter_to_tp_region")
    return _apply(_ScatterLastDim, x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward all-gathers the last dim (output N·X bytes); backward keeps own chunk."""
    return _apply(_GatherLastDim, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward keeps this rank's sequence chunk; backward all-gathers the sequence (X bytes)."""
    if tp_world_size(group) > 1:
        _check_divisible(x, SEQ_DIM, tp_world_size(group), "scatter_to_sequence_parallel_region")
    return _apply(_ScatterSeq, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward all-gathers the sequence (output N·X bytes); backward reduce-scatters (N·X)."""
    return _apply(_GatherSeq, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward reduce-scatters along the sequence (input X bytes); backward all-gathers (X)."""
    if tp_world_size(group) > 1:
        _check_divisible(x, SEQ_DIM, tp_world_size(group), "reduce_scatter_to_sequence_parallel_region")
    return _apply(_ReduceScatterSeq, x, group)
