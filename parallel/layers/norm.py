"""LayerNorm and RMSNorm whose weights know whether they live in a sequence-parallel region.

The weights are replicated on every TP rank (no ``tp_shard_dim``) and excluded from
weight decay. With ``sequence_parallel`` each rank normalises only its sequence
chunk, so its weight gradient is a partial sum: the weights are marked
``sequence_parallel`` and :func:`reduce_sequence_parallel_grads` (one all-reduce on
the TP group) completes them before the optimizer step. No communication here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..params import is_sequence_parallel, mark_no_weight_decay, mark_sequence_parallel


def _mark(p: nn.Parameter, sequence_parallel: bool) -> nn.Parameter:
    mark_no_weight_decay(p)
    return mark_sequence_parallel(p) if sequence_parallel else p


class LayerNorm(nn.Module):
    """``F.layer_norm`` over the last dim with weight and bias (GPT)."""

    def __init__(self, dim: int, eps: float = 1e-5, *, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = _mark(nn.Parameter(torch.ones(dim, device=device, dtype=dtype)), sequence_parallel)
        self.bias = _mark(nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)), sequence_parallel)

    def reset_parameters(self) -> None:
        """Weight one, bias zero (as at construction)."""
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight``, computed in fp32 (Llama)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = _mark(nn.Parameter(torch.ones(dim, device=device, dtype=dtype)), sequence_parallel)

    def reset_parameters(self) -> None:
        """Weight one (as at construction)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype)
        return y * self.weight


def reduce_sequence_parallel_grads(module: nn.Module, tp_group) -> int:
    """Sum over ``tp_group`` the gradients of ``module``'s ``sequence_parallel`` parameters.

    One all-reduce of all those gradients flattened together (their total bytes ``G``;
    ``2(N-1)/N·G`` sent). Call it after backward, once per step (after the last
    micro-batch), before clipping or the optimizer. Returns the number of gradients reduced.
    """
    grads = [p.grad for p in module.parameters() if is_sequence_parallel(p) and p.grad is not None]
    if not grads or comm.tp_world_size(tp_group) == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)
