"""Counted collectives that ``torch.compile`` can trace: registered custom ops.

Dynamo cannot trace our collectives' Python (the byte counter, the flight recorder, the
profiler ranges, gloo's transport), so each out-of-place collective of :mod:`.autograd` is
also a ``torch.library.custom_op`` in the ``gridtrain`` namespace: a compiled graph holds
one opaque node per collective, whose eager body is the counted call itself (so bytes,
flight-recorder entries and timings are recorded exactly as in eager mode, once per call),
and whose fake implementation gives the output's shape without communicating. The group
travels by name (``group.group_name``, a string a graph can hold) and is resolved with
``torch.distributed``'s own registry when the node runs; its size is passed as an integer
so the fake implementation needs no group. :func:`tracing` tells the callers when to use
them: only while dynamo traces, so eager runs keep their direct calls.
"""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group


def tracing() -> bool:
    """Whether dynamo is tracing the caller now (then collectives go through the custom ops)."""
    return torch.compiler.is_compiling()


def _group(name: str):
    return _resolve_process_group(name)


@torch.library.custom_op("gridtrain::same_shape_collective", mutates_args=())
def same_shape_collective(x: torch.Tensor, kind: str, group_name: str) -> torch.Tensor:
    """A collective whose output has ``x``'s shape, out of place and counted: ``kind`` is
    ``all_reduce_sum`` (the sum over the group), ``all_reduce_max`` or ``all_to_all_chunks`` (equal dim-0 chunks
    exchanged), the functions of :mod:`.autograd` of those names."""
    from . import autograd

    return getattr(autograd, kind)(x, _group(group_name))


@same_shape_collective.register_fake
def _(x, kind, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("gridtrain::all_gather_along", mutates_args=())
def all_gather_along(x: torch.Tensor, dim: int, group_name: str, size: int, regather: bool) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (:func:`.autograd.all_gather_along`, counted).

    ``regather``: a backward's second gather of a tensor its forward gathered (sequence parallelism
    saves the chunk, not the whole). Only marks the call: the graph passes merge identical pure calls,
    so without it the two transfers would become one and the gathered tensor be kept for backward
    (N× the memory Megatron's choice frees)."""
    from .autograd import all_gather_along as eager

    return eager(x, dim, _group(group_name))


@all_gather_along.register_fake
def _(x, dim, group_name, size, regather):
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_empty(shape)


@torch.library.custom_op("gridtrain::reduce_scatter_along", mutates_args=())
def reduce_scatter_along(x: torch.Tensor, dim: int, group_name: str, size: int) -> torch.Tensor:
    """The sum over ranks of ``x``, this rank's chunk along ``dim`` (:func:`.autograd.reduce_scatter_along`)."""
    from .autograd import reduce_scatter_along as eager

    return eager(x, dim, _group(group_name))


@reduce_scatter_along.register_fake
def _(x, dim, group_name, size):
    shape = list(x.shape)
    shape[dim] //= size
    return x.new_empty(shape)
