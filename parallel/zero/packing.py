"""Which bucket class a parameter belongs to, and what buckets hold while reduced: the rules the
engine follows and the planner prices, in one place.

A ZeRO bucket never mixes parameters of different *classes* (:mod:`parallel.zero.layout`): with
and without weight decay (each shard is one tensor in one optimizer group), and with a different
``extra_reduce`` (a tied embedding's gradient is also summed over the embedding group, a
sequence-parallel parameter's over the TP group: the extra all-reduce acts on a shard holding only
them). :func:`bucket_class` decides the class from the parameter's marks; the engine
(:class:`parallel.zero.engine.ZeroDataParallel`) packs by it, and the planner counts a model's
parameters into the same classes (:data:`CLASSES` is their packing order), so both count the same
buckets, hence the same collectives.

:func:`reduction_buffer_bytes` is what stages 2–3 hold for gradients in flight: the engine keeps
at most :data:`~parallel.overlap.REDUCTIONS_IN_FLIGHT` bucket reduce-scatters in flight
(``ZeroDataParallel._reduce``), but launches the new one before waiting for the oldest, so
``REDUCTIONS_IN_FLIGHT + 1`` are pending right after a launch, each holding its full gradient in the
wire dtype and the reduced shard it lands in.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..overlap import REDUCTIONS_IN_FLIGHT
from ..params import is_sequence_parallel, is_shared_embedding, wants_weight_decay
from ..precision import DTYPE_BYTES

EXTRA_REDUCE = ("", "embedding", "tp")  # the group a gradient is also summed over ("" = none)
# every class, in the order the engine packs them inside a unit: weight decay first, then extra_reduce
CLASSES: tuple[tuple[bool, str], ...] = tuple((no_wd, extra) for no_wd in (False, True) for extra in EXTRA_REDUCE)


def extra_reduce(p: nn.Parameter, sequence_parallel: bool | None = None) -> str:
    """The group ``p``'s gradient is also summed over after the DP reduction: ``"embedding"`` for a
    word embedding tied across pipeline stages, ``"tp"`` for a sequence-parallel parameter (norms,
    row-parallel biases, positions: replicated over TP), else ``""``.

    ``sequence_parallel``: whether ``p`` is sequence-parallel; None reads its mark
    (:func:`parallel.params.is_sequence_parallel`, the engine). The planner counts a model built
    at tp = 1, where the layers mark nothing, and passes what tp > 1 with sequence parallelism marks:
    every parameter replicated over TP (the layers mark exactly those, an MoE layer's router and
    experts included)."""
    sp = is_sequence_parallel(p) if sequence_parallel is None else sequence_parallel
    return "embedding" if is_shared_embedding(p) else "tp" if sp else ""


def bucket_class(p: nn.Parameter, sequence_parallel: bool | None = None) -> tuple[bool, str]:
    """``(no_weight_decay, extra_reduce)``: parameters share a bucket only within one class;
    classes are packed in :data:`CLASSES` order (``sequence_parallel``: :func:`extra_reduce`)."""
    return (not wants_weight_decay(p), extra_reduce(p, sequence_parallel))


def class_index(no_weight_decay: bool, extra: str) -> int:
    """The packing position of the class ``(no_weight_decay, extra)`` in :data:`CLASSES`."""
    return CLASSES.index((no_weight_decay, extra))


def reduction_buffer_bytes(
    padded_numels: Sequence[int],
    comm_bytes: int,
    dp: int | Sequence[int],
    sends_accumulator: bool = False,
    overlap: bool = True,
) -> int:
    """Bytes stages 2–3 hold for gradient reductions in flight: the largest
    ``REDUCTIONS_IN_FLIGHT + 1`` of the buckets (``padded_numels``: the engine launches a bucket's
    reduce-scatter before it waits for the oldest of the :data:`REDUCTIONS_IN_FLIGHT` pending), each
    as its full gradient in the wire dtype (``comm_bytes`` per element) plus the shard the reduce-scatter writes (``1/dp`` of it).
    ``sends_accumulator``: the full gradient sent is the fp32 accumulation buffer itself (unsharded
    accumulation in an fp32 wire dtype, counted apart by
    :func:`parallel.zero.theory.accumulation_grad_bytes`): only the shard is extra.
    An upper bound: the engine launches buckets in backward order and waits for the oldest.
    ``overlap=False``: every bucket's full gradient is held until the end of backward (the ``.grad``
    the hooks leave, then each bucket's wire copy as ``ZeroDataParallel._end_of_backward`` launches
    it; the reductions themselves stay capped at ``REDUCTIONS_IN_FLIGHT + 1``): counted as every
    bucket's held bytes, which stands in for those gradients (equal when the wire dtype is the
    parameters').
    ``dp``: the group each bucket is reduce-scattered over, one for all or one per bucket (an MoE
    expert's bucket is padded over and sharded by expert DP, ``dp / ep``)."""
    groups = [dp] * len(padded_numels) if isinstance(dp, int) else list(dp)
    held = [(0 if sends_accumulator else n * comm_bytes) + n // g * comm_bytes for n, g in zip(padded_numels, groups)]
    return sum(sorted(held, reverse=True)[: REDUCTIONS_IN_FLIGHT + 1 if overlap else None])


def comm_copy_bytes(padded_numels: Sequence[int], comm_bytes: int) -> int:
    """Bytes stages 0–1 hold for their gradients' wire copies: the engine
    (:meth:`parallel.zero.bucket.FlatBucket.launch_reduction`) sends a bucket's fp32 gradient
    (``flat_grad``) as is when the wire dtype is fp32, else a copy in the wire dtype; stages 0–1
    launch every bucket at the last backward and wait only in ``step()`` (no in-flight cap), so
    every bucket's copy (``padded_numels``, ``comm_bytes`` per element) lives until then."""
    return 0 if comm_bytes == DTYPE_BYTES["fp32"] else sum(padded_numels) * comm_bytes
