"""Where a rank's pieces sit in the global tensors: pure arithmetic, no processes.

A checkpoint addresses every tensor by its *global* name and shape (the
unsharded parameter, vocabulary padding removed). A rank holds pieces of it:
tensor parallelism gives it a block of the global tensor (``tp_rank``-th slice
along ``tp_shard_dim``), and ZeRO gives it a *flat range* of that block (its
shard of a flat bucket). A flat range of a row-major tensor is not a box, but
it is a short list of boxes, each contiguous in memory:
:func:`flat_range_boxes` cuts it into a partial leading row, whole rows, and a
partial trailing row (recursively, for more dimensions). Each box then gets
global offsets (:func:`to_global`), which is what
``torch.distributed.checkpoint`` needs to write it and, later, to find the
overlap with whatever boxes another layout asks for: resharding is DCP's
chunk-overlap reading, given correct boxes.

    >>> flat_range_boxes((3, 4), 2, 11)
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported where a checkpoint is written or read
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked; the message names what and the fix."""


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Cut the row-major flat range ``[start, end)`` of a tensor of ``shape`` into boxes.

    The boxes come in memory order and each is contiguous, so box ``i`` is
    ``flat[start + sum(numel of boxes before i) : ...].view(sizes_i)``.
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise CheckpointError(f"flat range [{start}, {end}) outside a tensor of shape {shape} ({numel} elements)")
    return _boxes(shape, start, end)


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)

    def one_row(a: int, b: int) -> list[Box]:
        r = a // inner
        return [((r, *o), (1, *s)) for o, s in _boxes(shape[1:], a - r * inner, b - r * inner)]

    lo, hi = -(-start // inner) * inner, end // inner * inner  # first and last whole-row boundary
    if lo > hi:  # inside a single row
        return one_row(start, end)
    out = one_row(start, lo) if start < lo else []
    if lo < hi:
        out.append(((lo // inner, *rest), ((hi - lo) // inner, *shape[1:])))
    if hi < end:
        out += one_row(hi, end)
    return out


@dataclass(frozen=True)
class Placement:
    """How one rank's local tensor sits in the global tensor.

    The local tensor is the block starting at ``offsets``; the global tensor
    has ``global_shape``, which may be smaller than the blocks' union (a
    vocabulary padded for TP: rows ``≥ global_shape[0]`` are padding and are
    neither saved nor loaded).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def tp_placement(
    local_shape: Sequence[int], shard_dim: int | None, tp_rank: int, tp_size: int, rows: int | None = None
) -> Placement:
    """The placement of a TP shard: block ``tp_rank`` along ``shard_dim`` (None: replicated).

    ``rows``: the real number of rows along dim 0 when the rest is padding (vocabulary).
    """
    shape = list(int(d) for d in local_shape)
    offsets = [0] * len(shape)
    if shard_dim is not None and tp_size > 1:
        offsets[shard_dim] = tp_rank * shape[shard_dim]
        shape[shard_dim] *= tp_size
    if rows is not None:
        if rows > shape[0]:
            raise CheckpointError(f"{rows} real rows but the tensor has only {shape[0]}")
        shape[0] = rows
    return Placement(tuple(shape), tuple(offsets))


def to_global(box: Box, placement: Placement) -> Box | None:
    """A local box in global coordinates, cut at the global shape (None if all padding).

    Only dim 0 may be cut (see :class:`Placement`); a cut keeps a leading part of
    the box, which stays contiguous in memory.
    """
    offsets = tuple(o + p for o, p in zip(box[0], placement.offsets))
    sizes = list(box[1])
    for d, (o, s, g) in enumerate(zip(offsets, sizes, placement.global_shape)):
        if o + s > g:
            if d != 0:
                raise CheckpointError(
                    f"box {box} at {offsets} leaves the global shape {placement.global_shape} "
                    f"along dim {d}; only dim 0 (vocabulary rows) may be padding"
                )
            sizes[0] = max(0, g - o)
    if any(s == 0 for s in sizes):
        return None
    return offsets, tuple(sizes)


class Chunked:
    """This rank's pieces of one global tensor: ``{global offsets: local view}``."""

    def __init__(self, global_shape: tuple[int, ...], dtype: torch.dtype):
        self.global_shape = torch.Size(global_shape)
        self.dtype = dtype
        self.pieces: dict[torch.Size, torch.Tensor] = {}

    def add(self, offsets, view: torch.Tensor) -> None:
        self.pieces[torch.Size(offsets)] = view

    def chunks(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self.pieces.items()]

    def write_items(self, fqn: str) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, c.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=c, properties=props, size=self.global_shape),
            )
            for c in self.chunks()
        ]

    def piece(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[torch.Size(index.offset)]
