"""Causal self-attention with heads split over the TP group (GQA and RoPE optional)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import comm
from .linear import ColumnParallelLinear, LayerConfigError, RowParallelLinear, divide
from .ring_attention import check_cp_impl, check_ulysses_heads, context_parallel_attention, cp_positions


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[seq_len, head_dim]`` in fp32 (Llama / HF "rotate-half" layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, h, s, hd]`` by position: ``x·cos + rotate_half(x)·sin``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def check_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Refuse head counts the TP layout cannot split (kv heads are never replicated)."""
    if n_heads % n_kv_heads:
        raise LayerConfigError(
            f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}; "
            f"grouped-query attention needs each kv head to serve the same number of query heads"
        )
    if n_kv_heads < tp:
        raise LayerConfigError(
            f"n_kv_heads {n_kv_heads} < tensor-parallel size {tp}: gridtrain splits kv heads "
            f"over TP ranks and does not replicate them; use tp ≤ {n_kv_heads} or more kv heads"
        )
    divide(n_heads, tp, "n_heads")
    divide(n_kv_heads, tp, "n_kv_heads")


class ParallelSelfAttention(nn.Module):
    """Causal multi-head / grouped-query attention, ``n_heads/N`` query heads per rank.

    ``q_proj``, ``k_proj``, ``v_proj`` are column-parallel (rank ``r`` owns query heads
    ``[r·H/N, (r+1)·H/N)`` and kv heads ``[r·K/N, (r+1)·K/N)``, so every query head
    finds its kv head locally); ``o_proj`` is row-parallel. The core is
    ``F.scaled_dot_product_attention(is_causal=True)``; ``rope`` applies rotary
    embeddings to q and k (theta ``rope_theta``). ``recompute_core`` (selective
    activation checkpointing) keeps only q, k, v and recomputes the attention
    core in backward. ``n_kv_heads < N`` is refused (kv heads are not replicated).

    Communication on ``tp_group`` (``A`` = bytes of the full activation ``[b, s, d]``),
    per forward + backward: plain: one all-reduce of A forward (``o_proj``) and one
    backward (the q/k/v input gradient); sequence-parallel: all-gather + reduce-scatter
    of A forward, the same two backward. q, k and v share one input collective.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        tp_group=None,
        sequence_parallel: bool = False,
        bias: bool = True,
        rope: bool = False,
        rope_theta: float = 10000.0,
        recompute_core: bool = False,
        cp_group=None,
        cp_impl: str = "ring",
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        cp = comm.tp_world_size(cp_group)  # None or one rank: no context parallelism
        check_cp_impl(cp_impl)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads:
            raise LayerConfigError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        head_dim = d_model // n_heads
        check_heads(n_heads, n_kv_heads, tp)
        if cp > 1 and cp_impl == "alltoall":
            check_ulysses_heads(n_heads, n_kv_heads, cp, tp)
        self.cp_group, self.cp, self.cp_impl = cp_group, cp, cp_impl
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.local_heads, self.local_kv_heads = n_heads // tp, n_kv_heads // tp
        self.rope, self.rope_theta, self.recompute_core = rope, rope_theta, recompute_core
        col = dict(tp_group=tp_group, bias=bias, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.q_proj = ColumnParallelLinear(d_model, n_heads * head_dim, **col)
        self.k_proj = ColumnParallelLinear(d_model, n_kv_heads * head_dim, **col)
        self.v_proj = ColumnParallelLinear(d_model, n_kv_heads * head_dim, **col)
        self.o_proj = RowParallelLinear(n_heads * head_dim, d_model, **col)

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, self.head_dim).transpose(1, 2)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rotary (if any) + causal SDPA on local heads; ``[b, s, local_heads·hd]``."""
        b, _, s, _ = q.shape
        if self.rope:
            cos, sin = rotary_cos_sin(s * self.cp, self.head_dim, self.rope_theta, q.device)
            if self.cp > 1:  # this rank's tokens sit at their global positions
                pos = cp_positions(s * self.cp, self.cp, comm.tp_rank(self.cp_group), q.device)
                cos, sin = cos[pos], sin[pos]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.cp > 1:
            out = context_parallel_attention(q, k, v, self.cp_group, impl=self.cp_impl, causal=True)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=self.local_heads != self.local_kv_heads
            )
        return out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise LayerConfigError(f"ParallelSelfAttention: expected [batch, seq, d_model], got {tuple(x.shape)}")
        q, k, v = ColumnParallelLinear.shared_forward(x, self.q_proj, self.k_proj, self.v_proj)
        q = self._heads(q, self.local_heads)
        k, v = self._heads(k, self.local_kv_heads), self._heads(v, self.local_kv_heads)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            out = self.core(q, k, v)
        return self.o_proj(out)
