"""The global gradient norm over DP shards, TP shards and pipeline stages.

Each rank sums the squares of the gradient elements it is responsible for,
and one scalar ``all_reduce`` (SUM, 4 bytes payload) per group adds the
partial sums up:

* over the DP group when the gradient is sharded (ZeRO stages 1–3; at stage
  0 every DP rank holds the whole, identical reduced gradient);
* over the TP group, where parameters replicated across TP (no
  ``tp_shard_dim`` mark: norms, row-parallel biases) are counted on TP rank 0
  only, so they enter the norm once — as in Megatron-LM;
* over any further groups the caller names (the pipeline group: each stage
  holds different layers).

An inf or NaN anywhere makes the sum non-finite on every rank, which is how
a step is skipped everywhere at once (fp16 overflow).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .. import comm
from ..params import is_tp_replicated


def counted_ranges(bucket_layout, lo: int, hi: int, params, count_replicated: bool) -> list[tuple[int, int]]:
    """Ranges ``[a, b)`` of the local range ``[lo, hi)`` (0-based in it) that enter the norm.

    Adjacent ranges are merged, so a bucket whose slots all count is one range (one norm).
    """
    out: list[tuple[int, int]] = []
    for slot, a, b in bucket_layout.overlaps(lo, hi):
        p = params[bucket_layout.slots.index(slot)]
        if count_replicated or not is_tp_replicated(p):
            if out and out[-1][1] == a - lo:
                out[-1] = (out[-1][0], b - lo)
            else:
                out.append((a - lo, b - lo))
    return out


def local_sq_norm(grads: Sequence[torch.Tensor], ranges: Iterable[Sequence[tuple[int, int]]]) -> torch.Tensor:
    """Sum of squares of ``grad[a:b]`` over each grad's counted ranges, in fp32, on the grads' device.

    One fused reduction: ``torch._foreach_norm`` over the ranges (views, no copies; one
    kernel launch per dtype/device on a GPU), then the squares of those norms summed."""
    pieces = [g[a:b] for g, rs in zip(grads, ranges) for a, b in rs]
    if not pieces:
        return torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    norms = torch._foreach_norm([t if t.dtype == torch.float32 else t.float() for t in pieces])
    return torch.stack(norms).square().sum()


def global_norm(local_sq: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """All-reduce ``local_sq`` (SUM) over each group in turn; return the square root.

    A 0-dim fp32 tensor on ``local_sq``'s device: nothing is read on the host
    (callers read it when they log it)."""
    buf = local_sq.reshape(1).clone()
    for g in groups:
        comm.all_reduce(buf, group=g)
    return buf.sqrt().reshape(())


def clip_coefficient(norm: torch.Tensor, max_norm: float | None, eps: float = 1e-6) -> torch.Tensor | None:
    """What to multiply gradients by so that their norm is at most ``max_norm`` (≤ 1), on the device.

    None when there is no limit. A non-finite ``norm`` gives 0 (the step is skipped anyway)."""
    if max_norm is None:
        return None
    return (max_norm / (norm + eps)).clamp(max=1.0)
