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
* ``vocab_size``: rows ``≥ vocab_size`` of the gathered parameter are vocabulary padding
  (the embedding and the head; :func:`mark_vocab_rows`, read by initialisation, checkpoints
  and HF export, which drop or zero the padding).
* ``init_key``: the name whose initial values this parameter takes, when it is a second copy of
  another one (the head of a tied embedding on a stage without the embedding); initialisation and
  checkpoints key it by that name (:func:`init_key`).
* ``drawn_as``: ``(seed, key)`` a parameter's values were drawn from by
  :func:`parallel.layers.init_parameters_`; two pieces of one model drawn alike are refused
  (:func:`parallel.layers.init.check_distinct_init`).
* ``expert_shard``: a mixture-of-experts expert's parameter (:mod:`parallel.layers.moe`), stacked
  over experts along dim 0, each ep rank holding its slice of the global experts, so it is data-parallel over the ``edp`` group, not ``dp``, and a global
  gradient norm sums it over ``ep`` too.

Every reader goes through the accessors below, never ``getattr`` with the attribute's name.
See docs/architecture.md for where each mark is consumed.
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


def mark_vocab_rows(param: torch.nn.Parameter, vocab_size: int) -> torch.nn.Parameter:
    """Record that rows ``≥ vocab_size`` of the (gathered) ``param`` are padding."""
    param.vocab_size = vocab_size
    return param


def vocab_rows(param: torch.Tensor) -> int | None:
    """The real vocabulary rows of ``param`` (the rest are padding), or None if unmarked."""
    return getattr(param, "vocab_size", None)


def mark_init_key(param: torch.nn.Parameter, key: str) -> torch.nn.Parameter:
    """Make ``param`` take the initial values (and checkpoint key) of parameter ``key``."""
    param.init_key = key
    return param


def init_key(param: torch.Tensor, default: str | None = None) -> str | None:
    """The name ``param`` is initialised and checkpointed under: its mark, else ``default``."""
    return getattr(param, "init_key", None) or default


def mark_expert(param: torch.nn.Parameter, ep_rank: int = 0, ep_size: int = 1) -> torch.nn.Parameter:
    """Mark an MoE expert parameter whose dim 0 is this ep rank's slice (rank ``ep_rank`` of ``ep_size``)
    of the global experts."""
    param.expert_shard = (ep_rank, ep_size)
    return param


def expert_shard(param: torch.Tensor) -> tuple[int, int] | None:
    """``(ep_rank, ep_size)`` of an MoE expert parameter (split over ep along dim 0), else None."""
    return getattr(param, "expert_shard", None)


def is_expert(param: torch.Tensor) -> bool:
    """True for an MoE expert's parameter (sharded over ep, data-parallel over edp)."""
    return expert_shard(param) is not None


def mark_drawn_as(param: torch.nn.Parameter, seed: int, key: str) -> torch.nn.Parameter:
    """Record that ``param``'s values were drawn from ``(seed, key)`` (layout-independent initialisation)."""
    param.drawn_as = (seed, key)
    return param


def drawn_as(param: torch.Tensor) -> tuple[int, str] | None:
    """The ``(seed, key)`` ``param`` was drawn from by ``init_parameters_``, or None."""
    return getattr(param, "drawn_as", None)
