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

Each rank's partial sum is fp32 row norms of 1024 elements summed in fp64 (:func:`local_sq_norm`),
so the norm of every layout equals the fp64 norm of its full gradient within ~1e-7 relative.
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


NORM_CHUNK = 1024  # elements per fp32 partial norm (≤ ~1e-7 relative even on bf16-valued gradients); summed in fp64


def local_sq_norm(grads: Sequence[torch.Tensor], ranges: Iterable[Sequence[tuple[int, int]]]) -> torch.Tensor:
    """Sum of squares of ``grad[a:b]`` over each grad's counted ranges: a 0-dim fp64 tensor on the grads' device.

    Accurate to ~1e-7 relative at any size, in the one pass over the gradients a norm takes: a
    range is read as rows of :data:`NORM_CHUNK` elements (a view), each row's norm reduced in fp32
    (``vector_norm(dim=1)``, one kernel per range: ≤ ~1e-7 relative per row, and the rows' errors
    average out), and those norms squared and summed in fp64 (25 k values per 25 M elements). Tails
    and short ranges go through one ``torch._foreach_norm``. (One fp32 norm over a whole range drifts
    as the range grows; docs/performance.md, issue 34.) Nothing is read on the host."""
    rows, short = [], []
    for g, rs in zip(grads, ranges):
        for a, b in rs:
            piece = g[a:b] if g.dtype == torch.float32 else g[a:b].float()
            whole = (b - a) // NORM_CHUNK * NORM_CHUNK
            if whole:
                rows.append(torch.linalg.vector_norm(piece[:whole].reshape(-1, NORM_CHUNK), dim=1))
            if whole < b - a:
                short.append(piece[whole:])
    if short:
        rows.append(torch.stack(torch._foreach_norm(short)))
    if not rows:
        return torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    return (torch.cat(rows) if len(rows) > 1 else rows[0]).double().square().sum()


def global_sq_norm(local_sq: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """``local_sq`` summed (``all_reduce`` SUM) over each group in turn: a 0-dim fp64 tensor on its device.

    The wire carries fp32 (a 4-byte scalar, what :mod:`parallel.plan` prices): each rank's exact partial
    is rounded once (~6e-8 relative) and the few partials summed, far inside the 1e-6 the norm keeps."""
    buf = local_sq.reshape(1).to(torch.float32, copy=True)
    for g in groups:
        comm.all_reduce(buf, group=g)
    return buf.double().reshape(())


def global_norm(local_sq: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """All-reduce ``local_sq`` (SUM) over each group in turn; return the square root.

    A 0-dim fp32 tensor on ``local_sq``'s device: nothing is read on the host
    (callers read it when they log it)."""
    return global_sq_norm(local_sq, groups).sqrt().float()


def clip_coefficient(norm: torch.Tensor, max_norm: float | None, eps: float = 1e-6) -> torch.Tensor | None:
    """What to multiply gradients by so that their norm is at most ``max_norm`` (≤ 1), on the device.

    None when there is no limit. A non-finite ``norm`` gives 0 (the step is skipped anyway)."""
    if max_norm is None:
        return None
    return (max_norm / (norm + eps)).clamp(max=1.0)
