"""Token-id range checks, done once on the host batch before it moves to the device.

The vocabulary-parallel layers (:class:`~parallel.layers.VocabParallelEmbedding`,
:func:`~parallel.layers.vocab_parallel_cross_entropy`) do not check their ids:
on a GPU a range check inside ``forward`` is a device→host read per micro-batch,
which stalls the stream. An id outside ``[0, vocab_size)`` is silently wrong there
(a zero embedding row or a zero target logit with TP > 1; an indexing error with
TP = 1), so whoever feeds them checks the batch here first, on the CPU tensors
the data loader produced: no device, no synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .linear import LayerConfigError

INTEGER_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.uint16, torch.uint32)
"""The id dtypes :func:`check_token_ids` accepts."""


def check_token_ids(
    ids: torch.Tensor, vocab_size: int, *, what: str = "token ids", ignore_index: int | None = None
) -> None:
    """Refuse ``ids`` (integers, any shape) with a value outside ``[0, vocab_size)``.

    ``ignore_index`` (targets): entries equal to it are allowed. Meant for host
    (CPU) tensors; on a device tensor it would synchronise, which is what this
    helper exists to avoid, so that is refused too.
    """
    if ids.dtype not in INTEGER_DTYPES:
        raise LayerConfigError(f"{what} must be integers, got {ids.dtype}")
    if ids.device.type != "cpu":
        raise LayerConfigError(f"check {what} on the host batch (a CPU tensor), not on {ids.device}")
    kept = ids.numpy()  # host memory: numpy reads it, no tensor read
    if ignore_index is not None:
        kept = kept[kept != ignore_index]
    if not kept.size:
        return
    lo, hi = int(kept.min()), int(kept.max())
    if lo < 0 or hi >= vocab_size:
        aside = f" (ignore_index {ignore_index} aside)" if ignore_index is not None else ""
        raise LayerConfigError(f"{what} span [{lo}, {hi}]{aside}, outside the vocabulary [0, {vocab_size})")


def check_token_ids_together(named: Sequence[tuple[torch.Tensor, str]], vocab_size: int) -> None:
    """:func:`check_token_ids` on every ``(ids, what)`` of ``named``, in order, with the same
    refusals and messages, but one min/max over all of them together (a step's micro-batch
    inputs and targets in one pass).

    Only when that joint range is outside ``[0, vocab_size)`` (or a tensor is not an integer
    host tensor) are the tensors checked one by one, to name the first bad one."""
    if named and all(ids.device.type == "cpu" and ids.dtype in INTEGER_DTYPES for ids, _ in named):
        together = np.concatenate([ids.numpy().ravel() for ids, _ in named])  # host memory, no tensor read
        if not together.size or (int(together.min()) >= 0 and int(together.max()) < vocab_size):
            return
    for ids, what in named:
        check_token_ids(ids, vocab_size, what=what)
