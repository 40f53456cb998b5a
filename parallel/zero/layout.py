"""Where each parameter lives in ZeRO's flat buffers: pure arithmetic, no processes.

Parameters are packed, in a deterministic order, into *buckets*. A bucket is
one flat buffer holding whole parameters back to back, padded at the end to a
multiple of the data-parallel size ``dp`` so that it splits into ``dp`` equal,
contiguous shards; DP rank ``r`` owns shard ``r`` (``[r·s, (r+1)·s)`` with
``s = padded / dp``). Every bucket is the unit of one collective: one
all-reduce (stage 0), one reduce-scatter (stages 1–3), one all-gather
(parameters, stages 1–3).

A bucket never mixes

* parameters that want weight decay with ones that do not
  (:func:`parallel.params.wants_weight_decay`), so that every shard is a single
  tensor in a single optimizer parameter group and any elementwise torch
  optimizer (AdamW, SGD, ...) runs on it unchanged; nor
* parameters of different *units* (stage 3 gathers one unit, e.g. one
  transformer block, at a time; the engine gives units only at stage 3); nor
* parameters whose gradient needs one more reduction over another group
  (``extra_reduce``: "embedding" for a word embedding tied across pipeline
  stages, "tp" for a sequence-parallel parameter) with ones that do not: such a
  bucket's shard holds only those parameters, so the reduction can be applied to
  the shard without touching anything else.

Inside those classes a new bucket starts when the next parameter would push
the current one past ``bucket_bytes`` (a parameter larger than that gets a
bucket of its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .packing import class_index


class ZeroConfigError(ValueError):
    """A ZeRO setting that cannot work; the message names the numbers and the fix."""


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its bucket: ``flat[offset : offset + numel].view(shape)``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketLayout:
    """A flat buffer: its parameters, its padded size and how it splits over ``dp`` ranks."""

    index: int
    unit: int  # index into the units (the last index: parameters outside every unit)
    weight_decay: bool
    extra_reduce: str  # "" or the group the gradient is also summed over: "embedding", "tp"
    slots: tuple[ParamSlot, ...]
    numel: int  # parameters' elements, without padding
    padded_numel: int  # a multiple of dp
    dp: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.dp

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """``[start, end)`` of the flat buffer owned by ``dp_rank``."""
        if not 0 <= dp_rank < self.dp:
            raise ZeroConfigError(f"dp rank {dp_rank} outside 0..{self.dp - 1}")
        s = self.shard_numel
        return dp_rank * s, (dp_rank + 1) * s

    def overlaps(self, start: int, end: int):
        """Yield ``(slot, lo, hi)``: the part ``[lo, hi)`` of each slot inside ``[start, end)``."""
        for slot in self.slots:
            lo, hi = max(slot.offset, start), min(slot.end, end)
            if lo < hi:
                yield slot, lo, hi


def padded(numel: int, dp: int) -> int:
    """``numel`` rounded up to a multiple of ``dp``."""
    return -(-numel // dp) * dp


def pack(numels: Sequence[int], element_size: int, bucket_bytes: float) -> list[list[int]]:
    """Indices of ``numels`` packed in order into buckets of at most ``bucket_bytes``: a bucket
    closes when the next parameter would overflow it (a larger parameter gets its own).
    The one packing rule: :func:`plan_buckets` and the planner's
    :func:`parallel.plan.memory.zero_padded_numel` both use it."""
    buckets: list[list[int]] = []
    filled = 0
    for i, n in enumerate(numels):
        if not buckets or (filled + n) * element_size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += n
    return buckets


def plan_buckets(
    params: Sequence[tuple[str, tuple[int, ...], bool, int, str]],
    *,
    dp: int,
    bucket_bytes: int,
    element_size: int,
) -> list[BucketLayout]:
    """Pack parameters into buckets.

    ``params``: ``(name, shape, wants_weight_decay, unit, extra_reduce)`` in the
    order to pack them (the model's ``named_parameters`` order, grouped by unit).
    Buckets come out ordered by unit, then class (:data:`parallel.zero.packing.CLASSES`: weight
    decay before no weight decay, then ``extra_reduce``), then position.
    """
    if dp < 1:
        raise ZeroConfigError(f"dp must be ≥ 1, got {dp}")
    if bucket_bytes <= 0:
        raise ZeroConfigError(f"bucket size must be positive, got {bucket_bytes} bytes (set bucket_mb > 0)")
    by_class: dict[tuple[int, bool, str], list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape, wd, unit, extra in params:
        by_class.setdefault((unit, not wd, extra), []).append((name, tuple(shape)))
    buckets: list[BucketLayout] = []
    for (unit, no_wd, extra), members in sorted(by_class.items(), key=lambda kv: (kv[0][0], class_index(*kv[0][1:]))):
        numels = [math.prod(shape) for _, shape in members]
        for indices in pack(numels, element_size, bucket_bytes):
            slots, offset = [], 0
            for i in indices:
                slots.append(ParamSlot(members[i][0], members[i][1], offset, numels[i]))
                offset += numels[i]
            buckets.append(
                BucketLayout(
                    index=len(buckets),
                    unit=unit,
                    weight_decay=not no_wd,
                    extra_reduce=extra,
                    slots=tuple(slots),
                    numel=offset,
                    padded_numel=padded(offset, dp),
                    dp=dp,
                )
            )
    return buckets
