"""Vocabulary-parallel embedding: the (padded) vocabulary's rows split over TP ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..params import mark_tp_sharded, mark_vocab_rows
from .init import reset_default_
from .linear import LayerConfigError, divide


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple · tp`` (Megatron's padding).

    The padded rows are zero and never win: the cross-entropy and the model's head
    mask every column ``≥ vocab_size``.
    """
    step = multiple * tp
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows ``[r·V/N, (r+1)·V/N)`` of the ``[V, d]`` table on rank ``r``.

    ``num_embeddings`` is the padded vocabulary (divisible by the TP size);
    ``vocab_size`` (default: the same) is the real one: ids must lie in
    ``[0, vocab_size)``; ``forward`` does not check that (a check would read the
    device every micro-batch): check the host batch with
    :func:`~parallel.layers.tokens.check_token_ids` before it moves. Each rank looks up the ids it owns, writes zeros for the
    others, and the partial results are summed.

    Communication on ``tp_group`` (``Y`` = bytes of the output ``[b, s, d]``):
    forward all-reduce (Y bytes), or with ``sequence_parallel`` a reduce-scatter
    along the sequence (Y bytes in, ``[b, s/N, d]`` out); backward: none, or the
    all-gather of the gradient (Y bytes) with ``sequence_parallel``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group=None,
        vocab_size: int | None = None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size
        if self.vocab_size > num_embeddings:
            raise LayerConfigError(
                f"VocabParallelEmbedding: vocab_size {self.vocab_size} exceeds the table's "
                f"{num_embeddings} rows; pad the table to at least the vocabulary"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size, self.sequence_parallel = tp_group, tp, sequence_parallel
        rows = divide(num_embeddings, tp, "VocabParallelEmbedding num_embeddings (padded vocab)")
        self.vocab_start = comm.tp_rank(tp_group) * rows
        self.vocab_end = self.vocab_start + rows
        weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        self.weight = mark_vocab_rows(mark_tp_sharded(weight, 0), self.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``torch.nn.Embedding``'s ``N(0, 1)``, the full table the same for every tp, padding rows
        zero (:func:`~parallel.layers.init.reset_default_`); no-op on ``meta``."""
        reset_default_(self.weight, self.tp_group, std=1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise LayerConfigError(f"VocabParallelEmbedding: token ids must be integers, got {ids.dtype}")
        if self.tp_size == 1:  # the whole table here: nothing to mask, nothing to reduce (group sizes are fixed)
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return comm.reduce_from_tp_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (vocab {self.vocab_size}), {self.embedding_dim}, "
            f"rows [{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )
