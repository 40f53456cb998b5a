"""How a parameter tells the rest of gridtrain how it is laid out.

Layers mark their parameters; ZeRO, gradient clipping, checkpointing and the
pipeline read the marks. Marks are plain attributes on the ``nn.Parameter`` so
they survive ``.to()`` and ``named_parameters()``.

* ``tp_shard_dim``: the dimension along which a parameter is split across the
  tensor-parallel group (``ColumnParallelLinear.weight`` → 0,
  ``RowParallelLinear.weight`` → 1, ``VocabParallelEmbedding.weight`` → 0).
  Absent: the parameter is replicated on every TP rank (norms, row-parallel
  bias), so a global gradient norm must count it once, not ``tp`` times.
* ``sequence_parallel``: a replicated parameter used inside a sequence-parallel
  region: each TP rank sees only its slice of the sequence, so its gradient
  must be all-reduced over the TP group before the optimizer step.
* ``shared_embedding``: the word-embedding weight that is tied with the output
  head; when pipeline parallel puts them on different stages its gradient is
  all-reduced over the embedding group (first + last stage).
* ``no_weight_decay``: excluded from weight decay (biases, norm weights).
"""

from __future__ import annotations

import torch


def mark_tp_sharded(param: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    param.tp_shard_dim = dim
    return param


def tp_shard_dim(param: torch.Tensor) -> int | None:
    """The TP split dimension, or None for a parameter replicated across TP."""
    return getattr(param, "tp_shard_dim", None)


def is_tp_replicated(param: torch.Tensor) -> bool:
    return tp_shard_dim(param) is None


def mark_sequence_parallel(param: torch.nn.Parameter) -> torch.nn.Parameter:
    param.sequence_parallel = True
    return param


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "sequence_parallel", False))


def mark_shared_embedding(param: torch.nn.Parameter) -> torch.nn.Parameter:
    param.shared_embedding = True
    return param


def is_shared_embedding(param: torch.Tensor) -> bool:
    return bool(getattr(param, "shared_embedding", False))


def mark_no_weight_decay(param: torch.nn.Parameter) -> torch.nn.Parameter:
    param.no_weight_decay = True
    return param


def wants_weight_decay(param: torch.Tensor) -> bool:
    return not getattr(param, "no_weight_decay", False)
