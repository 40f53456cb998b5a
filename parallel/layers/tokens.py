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

import torch

from .linear import LayerConfigError


def check_token_ids(
    ids: torch.Tensor, vocab_size: int, *, what: str = "token ids", ignore_index: int | None = None
) -> None:
    """Refuse ``ids`` (integers, any shape) with a value outside ``[0, vocab_size)``.

    ``ignore_index`` (targets): entries equal to it are allowed. Meant for host
    (CPU) tensors; on a device tensor it would synchronise, which is what this
    helper exists to avoid, so that is refused too.
    """
    if ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.uint16, torch.uint32):
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
