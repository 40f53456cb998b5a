"""Cross-entropy over vocabulary-parallel logits, without gathering them.

Rank ``r`` holds logits ``[..., V/N]`` for vocabulary ids ``[r·V/N, (r+1)·V/N)``.
The loss per token is ``logsumexp(z) - z[target]``; both parts are assembled with
two all-reduces of per-token scalars, never of the logits:

1. all-reduce MAX of the local maxima (``T·4`` bytes for ``T`` tokens, fp32),
2. all-reduce SUM of ``[Σ exp(z - max), z[target] - max]`` (``2·T·4`` bytes).

Backward computes ``softmax(z) - onehot(target)`` on the local slice: no
communication. Columns ``≥ vocab_size`` (vocabulary padding) are excluded: they
never win and never count. Targets equal to ``ignore_index`` give loss 0 and no
gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from .linear import LayerConfigError

CE_MAX_BYTES_PER_TOKEN = 4
"""Payload per token of the vocabulary-parallel cross-entropy's first forward all-reduce: the fp32 max."""
CE_SUMS_BYTES_PER_TOKEN = 8
"""Payload per token of its second: the fp32 sum of exponentials with the target logit."""
CE_ALL_REDUCE_BYTES_PER_TOKEN = CE_MAX_BYTES_PER_TOKEN + CE_SUMS_BYTES_PER_TOKEN
"""Payload of both forward all-reduces per token (two calls per micro-batch)."""


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, ignore_index):
        local_v = logits.shape[-1]
        start = comm.tp_rank(group) * local_v
        z = logits.float()
        if vocab_size is not None and start + local_v > vocab_size:
            pad = torch.arange(start, start + local_v, device=z.device) >= vocab_size
            z = z.masked_fill(pad, float("-inf"))
        zmax = z.amax(dim=-1)
        zmax = comm.all_reduce_max(zmax, group)  # out of place (traceable: parallel.comm.traceable)
        z = z - zmax.unsqueeze(-1)
        exp = z.exp()
        ignored = targets == ignore_index
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < local_v) & ~ignored
        picked = z.gather(-1, local_t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(dim=-1), picked])
        sums = comm.all_reduce_sum(sums, group)
        sum_exp, target_z = sums
        loss = (sum_exp.log() - target_z).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignored = ctx.saved_tensors
        grad = softmax
        # - onehot(target) on the rank owning the target's column: a masked scatter, no host read
        grad.scatter_add_(-1, local_t.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad = grad * grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token loss ``[...]`` from this rank's logits ``[..., V_padded/N]`` and full targets ``[...]``.

    Communication on ``tp_group``: forward one all-reduce MAX of ``T·4`` bytes and one
    all-reduce SUM of ``2·T·4`` bytes (``T`` = number of tokens); backward none.
    ``vocab_size``: the real vocabulary; logits columns at or beyond it are padding.
    Targets are not range-checked here (that would read the device every micro-batch):
    check the host batch with :func:`~parallel.layers.tokens.check_token_ids`.
    """
    tp = comm.tp_world_size(tp_group)
    _check_shapes(logits, targets, tp, vocab_size)
    if tp == 1:  # one rank holds every column: PyTorch's fused kernel
        return _fused(logits, targets, vocab_size, ignore_index, "none").view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, tp_group, vocab_size, ignore_index)


def mean_token_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(...).mean()``: the mean over *every* token, an ignored
    one counting as a zero loss (the same at every tp; ``F.cross_entropy``'s own mean would
    divide by the non-ignored count). Communication as :func:`vocab_parallel_cross_entropy`.

    At tp=1 one fused kernel sums the per-token losses, then one division by the token
    count (no per-token loss tensor, no ``mean`` and its backward's expand)."""
    tp = comm.tp_world_size(tp_group)
    if tp == 1:
        _check_shapes(logits, targets, tp, vocab_size)
        return _fused(logits, targets, vocab_size, ignore_index, "sum") / targets.numel()
    return vocab_parallel_cross_entropy(
        logits, targets, tp_group, vocab_size=vocab_size, ignore_index=ignore_index
    ).mean()


def _check_shapes(logits: torch.Tensor, targets: torch.Tensor, tp: int, vocab_size: int | None) -> None:
    """Refuse targets whose shape is not the logits' without the vocab dim, and a ``vocab_size``
    beyond the logits columns over all TP ranks (``LayerConfigError``; shapes only, no device read)."""
    if logits.shape[:-1] != targets.shape:
        raise LayerConfigError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets "
            f"{tuple(targets.shape)} disagree; targets must be logits' shape without the vocab dim"
        )
    full_v = logits.shape[-1] * tp
    if vocab_size is not None and vocab_size > full_v:
        raise LayerConfigError(f"vocab_size {vocab_size} exceeds the {full_v} logits columns over all ranks")


def _fused(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None, ignore_index: int, reduction: str):
    """PyTorch's fused cross-entropy over all of ``logits``' columns below ``vocab_size`` (tp=1)."""
    z = logits.float()
    if vocab_size is not None and vocab_size < z.shape[-1]:  # padding columns only: a full slice would
        z = z[..., :vocab_size]  # still cost its backward a zero-filled copy of the logits' gradient
    return F.cross_entropy(
        z.reshape(-1, z.shape[-1]), targets.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )
