"""A model given as pieces, and its pipeline chunks: what :meth:`parallel.engine.StepEngine.from_pieces`
and the recipe trainer's ``model.target`` take.

A model is ``first`` (e.g. the embedding), identical ``blocks``, ``last`` (e.g. the head) and a loss.
Chunks name the pieces by what they are in the whole model, not by their place in a stage:
``first.…``, ``blocks.<i>.…`` (``i`` the block's index in the whole model), ``last.…``. So a
checkpoint's keys (:meth:`parallel.engine.ModelChunks.global_names`) are the same for every pipeline
split, and ``init_parameters_(blocks[i], prefix=piece_prefix("blocks", i))`` draws each block from
the key a checkpoint stores it under.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .layers.init import check_distinct_init
from .pipeline.partition import partition_layers, stage_chunks


def piece_prefix(piece: str, index: int | None = None) -> str:
    """The name prefix of a piece in the whole model: ``first.``, ``blocks.<index>.`` or ``last.``."""
    return f"{piece}." if index is None else f"{piece}.{index}."


@dataclass
class ModelPieces:
    """A model as the engine splits it (module docstring).

    ``loss_fn(output, targets)``: one micro-batch's mean loss (last stage). ``activation_shape``: one
    micro-batch's activation between pipeline stages (None: the caller's default). ``embedding_cost`` and
    ``head_cost``: the first and last pieces' cost in blocks, for the pipeline split.
    ``flops_per_token``: training FLOPs (forward + backward) per token of the whole model, for MFU and the
    planner (None: unknown; the recipe's planner then counts them on ``meta``)."""

    first: nn.Module
    blocks: Sequence[nn.Module]
    last: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    activation_shape: Sequence[int] | None = None
    embedding_cost: float = 0.0
    head_cost: float = 0.0
    flops_per_token: float | None = None


class PiecesChunk(nn.Module):
    """One virtual stage's pieces, run in order: ``first`` (if held), ``blocks`` (a ``ModuleDict`` keyed by
    the blocks' indices in the whole model), ``last`` (if held). Iterating yields them in that order."""

    def __init__(self, first: nn.Module | None, blocks: dict[int, nn.Module], last: nn.Module | None):
        super().__init__()
        if first is not None:
            self.first = first
        self.blocks = nn.ModuleDict({str(i): b for i, b in blocks.items()})
        if last is not None:
            self.last = last

    def __iter__(self) -> Iterator[nn.Module]:
        if hasattr(self, "first"):
            yield self.first
        yield from self.blocks.values()
        if hasattr(self, "last"):
            yield self.last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self:
            x = piece(x)
        return x


def chunks_from_pieces(
    first: nn.Module,
    blocks: Sequence[nn.Module],
    last: nn.Module,
    *,
    pp: int,
    pp_rank: int,
    vpp: int = 1,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    pp_layers: Sequence[int] | None = None,
) -> list[nn.Module]:
    """Rank ``pp_rank``'s chunks (:class:`PiecesChunk`) of a model given as pieces. The blocks are split by
    :func:`~parallel.pipeline.partition.partition_layers` (cost-balanced: a block costs 1, the first and
    last pieces what the caller says; ``pp_layers``: the blocks of each rank); virtual stage 0 starts with
    ``first`` and the last one ends with ``last``. Chunk ``c`` is virtual stage ``c·pp + pp_rank``.

    Refuses pieces that :func:`~parallel.layers.init_parameters_` drew from the same keys (blocks
    initialised one by one without ``prefix``: they would all start identical)."""
    check_distinct_init(
        {piece_prefix("first"): first, piece_prefix("last"): last}
        | {piece_prefix("blocks", i): b for i, b in enumerate(blocks)}
    )
    ranges = partition_layers(
        len(blocks), pp, vpp=vpp, embedding_cost=embedding_cost, head_cost=head_cost, pp_layers=pp_layers
    )
    chunks = []
    for c, layers in enumerate(stage_chunks(ranges, pp, pp_rank)):
        virtual = c * pp + pp_rank
        held = {i: blocks[i] for i in layers}
        chunks.append(PiecesChunk(first if virtual == 0 else None, held, last if virtual == len(ranges) - 1 else None))
    return chunks
