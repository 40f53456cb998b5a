"""Top-K gradient sparsification with error feedback (stage 0).

Per bucket, each rank adds the residual it kept from earlier steps to its
fresh gradient, keeps the ``k = ceil(ratio · numel)`` entries of largest
magnitude, and all-gathers their values and int32 indices; every rank then
sums the ``dp`` sparse contributions into a dense gradient. What was not sent
stays in the residual and is added next step (error feedback), so no gradient
is lost, only delayed.

``k`` is the same on every rank, so the all-gather has equal sizes (gloo
cannot all-gather unequal ones). Values and indices travel as one byte buffer
(one collective per bucket).

Cost and savings, per bucket of ``n`` elements of ``b`` bytes, ``N`` ranks:

* dense all-reduce sends ``2 (N-1)/N · n · b`` bytes per rank;
* top-k all-gather sends ``(N-1) · k · (b + 4)`` bytes per rank
  (:func:`topk_sent_bytes`); it grows with ``N`` (every rank receives every
  rank's entries), so top-k pays off while ``N · ratio · (b+4)/b < 2``;
* memory: one fp32 residual per bucket (``4 n`` bytes per rank) plus the
  gathered buffer ``N · k · (b + 4)`` bytes of scratch.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..dims import topk_ratio_problem
from .layout import ZeroConfigError

COMPRESSIONS = ("none", "topk")  # the one home of the names (config: comm.compression)
INDEX_BYTES = 4  # each kept entry travels with its int32 index


def topk_count(numel: int, ratio: float) -> int:
    """Entries kept per bucket: ``ceil(ratio · numel)``, at least 1."""
    if topk_ratio_problem(ratio):  # the rule's one home: parallel.dims
        raise ZeroConfigError(topk_ratio_problem(ratio))
    return max(1, math.ceil(ratio * numel))


def topk_sent_bytes(numel: int, ratio: float, dp: int, value_bytes: int) -> float:
    """Bytes one rank sends for one bucket (ring all-gather of values + int32 indices)."""
    return (dp - 1) * topk_count(numel, ratio) * (value_bytes + INDEX_BYTES)


class TopKCompressor:
    """The error-feedback state of one bucket and its compress/exchange/expand step."""

    def __init__(self, numel: int, ratio: float, value_dtype: torch.dtype, device=None):
        self.numel = numel
        self.k = topk_count(numel, ratio)
        self.value_dtype = value_dtype
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)

    def _packed_bytes(self) -> int:
        return self.k * (torch.finfo(self.value_dtype).bits // 8 + 4)

    def start(self, grad: torch.Tensor, group) -> tuple[object, torch.Tensor]:
        """Compress ``grad`` (flat, this rank's sum of micro-batch gradients) and launch the gather.

        Returns ``(handle, gathered)``; pass both to :meth:`finish` once the
        handle is waited on. The residual is updated here: what is sent is
        removed from it.
        """
        acc = self.residual.add_(grad[: self.numel].float())
        indices = acc.abs().topk(self.k, sorted=False).indices
        values = acc[indices].to(self.value_dtype)
        # subtract exactly what the others will receive (after rounding to value_dtype)
        acc.index_add_(0, indices, -values.float())
        packed = torch.cat([values.view(torch.uint8), indices.to(torch.int32).view(torch.uint8)])
        n = comm.group_size(group)
        gathered = torch.empty(n * packed.numel(), dtype=torch.uint8, device=packed.device)
        handle = comm.all_gather(gathered, packed, group=group, async_op=True)
        return handle, gathered

    def finish(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Write the sum of every rank's sparse contribution into ``out`` (flat, dense)."""
        per_rank = gathered.view(-1, self._packed_bytes())
        vbytes = self.k * (torch.finfo(self.value_dtype).bits // 8)
        values = per_rank[:, :vbytes].contiguous().view(self.value_dtype).reshape(-1)
        indices = per_rank[:, vbytes:].contiguous().view(torch.int32).reshape(-1).long()
        out.zero_()  # the sparse sum's zeros are its result (not a memset before accumulating)
        out[: self.numel].index_add_(0, indices, values.float())
