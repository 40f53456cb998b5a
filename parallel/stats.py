"""What a step leaves on the device and how it is read (:class:`PendingLoss`, :func:`read_stats`): the
loss's reductions issued only on read steps, and every device value read in one host read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import comm

READ_KEYS = ("loss", "grad_norm", "skipped")  # the values a step leaves on the device unless read


class PendingLoss:
    """A step's loss before its reductions: what an unread step leaves in its record.

    It holds this rank's mean micro-batch loss, the loss scale already removed (meaningful
    on the last pipeline stage only), and what turns it into the global-batch mean. :meth:`reduce` issues, once,
    the collectives an unread step skipped: the ``broadcast`` of the last stage's
    value over ``pp_group`` (:meth:`PipelineExecutor.share_loss
    <parallel.pipeline.executor.PipelineExecutor.share_loss>`), then an ``all_reduce``
    (sum) over ``dp_group``, divided by ``dp``: 4 bytes each, the
    same as a read step sends. Every rank of both groups must reduce the same steps,
    in the same order (the trainer decides which steps it reads from the step number
    alone); the result is a device tensor, cached, so reading a record twice issues
    nothing more. No host read here.
    """

    def __init__(
        self,
        local: torch.Tensor,
        *,
        share: Callable[[torch.Tensor], None],
        dp_group: dist.ProcessGroup | None,
        dp: int,
    ):
        self._local, self._share, self._dp_group, self._dp = local, share, dp_group, dp
        self._value: torch.Tensor | None = None

    @property
    def reduced(self) -> bool:
        """Whether :meth:`reduce` has run (its collectives are issued)."""
        return self._value is not None

    def reduce(self) -> torch.Tensor:
        """The global-batch mean loss (a 0-d fp32 device tensor); the collectives on the first call only."""
        if self._value is None:
            loss = self._local.detach().float()
            self._share(loss)  # the last stage's value to every stage (in place)
            comm.all_reduce(loss, group=self._dp_group)  # sum over the DP replicas
            self._value = loss / self._dp if self._dp > 1 else loss
            self._local = self._share = None  # type: ignore[assignment]
        return self._value


def reduce_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with a :class:`PendingLoss` replaced by its reduced device tensor: the read's
    collectives without its host read (a dry run's values do not exist). Collective over the
    step's DP and PP groups when the loss is pending (see :class:`PendingLoss`)."""
    pending = {k: v.reduce() for k in READ_KEYS if isinstance(v := stats.get(k), PendingLoss)}
    return dict(stats, **pending) if pending else stats


def read_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with its device values (:data:`READ_KEYS`) read as Python numbers: one host read.
    A pending loss is reduced first (:func:`reduce_stats`: collective, on every rank of the step's
    groups at the same step)."""
    stats = reduce_stats(stats)
    keys = [k for k in READ_KEYS if torch.is_tensor(stats.get(k))]
    every = stats.get("rank_times")  # StepEngine.step's gather: read in the same host read
    if not keys and not torch.is_tensor(every):
        return stats
    every = every.float() if torch.is_tensor(every) else None
    values = torch.cat([stats[k].detach().float().reshape(1) for k in keys] + ([every] if every is not None else []))
    values = values.tolist()
    out = dict(stats, **dict(zip(keys, values)))
    if every is not None:
        out["rank_times"] = values[len(keys) :]
    if "skipped" in keys:
        out["skipped"] = bool(out["skipped"])
    return out
