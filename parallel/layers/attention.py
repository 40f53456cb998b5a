"""Self-attention with heads split over the TP group: causal (decoders) or not (encoders, ViT), with an
optional attention mask; GQA and RoPE optional."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import comm
from .documents import DocumentMask, document_attention
from .linear import ColumnParallelLinear, LayerConfigError, RowParallelLinear, divide
from .norm import RMSNorm
from .ring_attention import check_cp_impl, check_ulysses_heads, context_parallel_attention, cp_positions

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1·mscale·ln(factor) + 1`` (1 for ``factor ≤ 1``; the paper's Eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies ``cos`` and ``sin`` by (1 for every other kind): ``attention_factor`` if given,
    else ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when both are set (DeepSeek),
    else ``yarn_mscale(factor)``."""
    if (scaling or {}).get("type") != "yarn":
        return 1.0
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if scaling.get("attention_factor"):
        return scaling["attention_factor"]
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_softmax_mscale(scaling: dict | None) -> float:
    """The factor multi-head latent attention's softmax scale takes twice under rope scaling (DeepSeek's
    rule, transformers' ``yarn_apply_mscale``): ``yarn_mscale(factor, mscale_all_dim)`` when
    ``mscale_all_dim`` is set, else 1."""
    if not (scaling or {}).get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])


def _yarn_extrapolated(head_dim: int, theta: float, scaling: dict, device) -> torch.Tensor:
    """Per frequency, 1 where YaRN keeps it (more than ``beta_fast`` turns over ``original_max_position``),
    0 where it interpolates (fewer than ``beta_slow``), a linear ramp over the dimensions in between."""

    def dim_of(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in the original window
        return head_dim * math.log(scaling["original_max_position"] / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    return 1 - ramp


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """The rotary inverse frequencies ``θ^(-2i/hd)`` (fp32, ``[hd/2]``), scaled for long context:
    ``linear`` divides them all by ``factor``; ``llama3`` (Llama 3.1+) divides those whose wavelength
    exceeds ``original_max_position / low_freq_factor`` by ``factor``, keeps those shorter than
    ``original_max_position / high_freq_factor``, and blends linearly in between; ``yarn`` (Qwen3,
    DeepSeek-V3) blends the same two by dimension (:func:`_yarn_extrapolated`, ``beta_fast`` / ``beta_slow``
    turns) and scales ``cos``/``sin`` by :func:`rope_attention_factor` (in :func:`rotary_cos_sin`)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    kind = (scaling or {}).get("type", "default")
    if kind == "default":
        return inv
    if kind not in ROPE_TYPES:
        raise LayerConfigError(f"rope scaling {kind!r} not in {ROPE_TYPES}")
    factor = scaling["factor"]
    if kind == "linear":
        return inv / factor
    if kind == "yarn":
        keep = _yarn_extrapolated(head_dim, theta, scaling, device)
        return inv / factor * (1 - keep) + inv * keep
    low, high, original = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_position"]
    wavelength = 2 * torch.pi / inv
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    return (1 - blend) * inv / factor + blend * inv


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device=None, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[seq_len, head_dim]`` in fp32 (Llama / HF "rotate-half" layout);
    ``scaling``: :func:`rope_inv_freq`'s (YaRN's :func:`rope_attention_factor` multiplies both)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
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
    """Multi-head / grouped-query attention, ``n_heads/N`` query heads per rank; causal unless
    ``causal=False`` (an encoder's or a ViT's: every token sees every token).

    ``q_proj``, ``k_proj``, ``v_proj`` are column-parallel (rank ``r`` owns query heads
    ``[r·H/N, (r+1)·H/N)`` and kv heads ``[r·K/N, (r+1)·K/N)``, so every query head
    finds its kv head locally); ``o_proj`` is row-parallel. The core is
    ``F.scaled_dot_product_attention`` (``is_causal=causal``; with ``attn_mask`` the mask, and the
    causal one too when ``causal``); ``rope`` applies rotary
    embeddings to q and k (theta ``rope_theta``). ``recompute_core`` (selective
    activation checkpointing) keeps only q, k, v and recomputes the attention
    core in backward. ``n_kv_heads < N`` is refused (kv heads are not replicated), and so are
    ``causal=False`` with context parallelism or packed documents (both are causal only).

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
        rope_scaling: dict | None = None,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        recompute_core: bool = False,
        cp_group=None,
        cp_impl: str = "ring",
        causal: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        cp = comm.tp_world_size(cp_group)  # None or one rank: no context parallelism
        check_cp_impl(cp_impl)
        if not causal and cp > 1:
            raise LayerConfigError(
                f"ParallelSelfAttention(causal=False) with context parallelism (cp {cp}): ring and Ulysses "
                "attention are causal only; use cp=1"
            )
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None and d_model % n_heads:
            raise LayerConfigError(f"d_model {d_model} is not divisible by n_heads {n_heads} (or give head_dim)")
        head_dim = head_dim or d_model // n_heads
        check_heads(n_heads, n_kv_heads, tp)
        if cp > 1 and cp_impl == "alltoall":
            check_ulysses_heads(n_heads, n_kv_heads, cp, tp)
        self.cp_group, self.cp, self.cp_impl = cp_group, cp, cp_impl
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.local_heads, self.local_kv_heads = n_heads // tp, n_kv_heads // tp
        self.rope, self.rope_theta, self.rope_scaling = rope, rope_theta, rope_scaling
        self.recompute_core, self.causal = recompute_core, causal
        col = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        qkv = dict(col, bias=bias if qkv_bias is None else qkv_bias)
        self.q_proj = ColumnParallelLinear(d_model, n_heads * head_dim, **qkv)
        self.k_proj = ColumnParallelLinear(d_model, n_kv_heads * head_dim, **qkv)
        self.v_proj = ColumnParallelLinear(d_model, n_kv_heads * head_dim, **qkv)
        self.o_proj = RowParallelLinear(n_heads * head_dim, d_model, **col, bias=bias if o_bias is None else o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:  # one weight over every head: each TP rank's gradient covers its heads only
            norm = dict(sequence_parallel=tp > 1, device=device, dtype=dtype)
            self.q_norm, self.k_norm = RMSNorm(head_dim, qk_norm_eps, **norm), RMSNorm(head_dim, qk_norm_eps, **norm)

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, self.head_dim).transpose(1, 2)

    def core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: DocumentMask | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotary (if any) + SDPA on local heads; ``[b, s, local_heads·hd]``. ``documents``
        (packed windows, :mod:`.documents`): rotary positions restart at each document and attention
        is document-causal (under context parallelism too: ring or Ulysses). ``attn_mask``: see :meth:`forward`."""
        b, _, s, _ = q.shape
        if self.rope:
            cos, sin = rotary_cos_sin(s * self.cp, self.head_dim, self.rope_theta, q.device, self.rope_scaling)
            if documents is not None:  # [b, 1, s, hd]: each token's position in its document
                cos, sin = cos[documents.local][:, None], sin[documents.local][:, None]
            elif self.cp > 1:  # this rank's tokens sit at their global positions
                pos = cp_positions(s * self.cp, self.cp, comm.tp_rank(self.cp_group), q.device)
                cos, sin = cos[pos], sin[pos]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.cp > 1:
            out = context_parallel_attention(q, k, v, self.cp_group, impl=self.cp_impl, documents=documents)
        elif documents is not None:
            out = document_attention(q, k, v, documents)
        else:
            gqa = self.local_heads != self.local_kv_heads
            if attn_mask is not None and self.causal:  # SDPA takes one of the two: the causal part joins the mask
                attn_mask = with_causal(attn_mask, s)
            causal = self.causal and attn_mask is None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)

    def forward(
        self, x: torch.Tensor, documents: DocumentMask | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` ``[b, s, d]`` (``[b, s/tp, d]`` sequence-parallel); ``documents``: see :meth:`core`.

        ``attn_mask``: SDPA's, over the *full* sequence and broadcast over the heads: boolean (True: the
        query attends to the key) or additive float, of shape ``[s, s]``, ``[b, 1, s, s]`` or ``[b, 1, 1, s]``
        (a padding mask: ``keep[:, None, None, :]`` for ``keep`` ``[b, s]``, True at real tokens). Refused
        with ``documents`` or context parallelism. Communicates nothing beyond the class's collectives."""
        if x.dim() != 3:
            raise LayerConfigError(f"ParallelSelfAttention: expected [batch, seq, d_model], got {tuple(x.shape)}")
        if attn_mask is not None and (documents is not None or self.cp > 1):
            raise LayerConfigError(
                "ParallelSelfAttention: attn_mask with packed documents or context parallelism (cp "
                f"{self.cp}) is not supported; documents carry their own mask, and cp attention is causal only"
            )
        if documents is not None and not self.causal:
            raise LayerConfigError(
                "ParallelSelfAttention(causal=False) with packed documents: their attention is causal"
            )
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] != 1:
            raise LayerConfigError(
                f"ParallelSelfAttention: attn_mask {tuple(attn_mask.shape)} must broadcast over the heads "
                "(dim 1 of size 1): each tensor-parallel rank holds only some of them"
            )
        q, k, v = ColumnParallelLinear.shared_forward(x, self.q_proj, self.k_proj, self.v_proj)
        q = self._heads(q, self.local_heads)
        k, v = self._heads(k, self.local_kv_heads), self._heads(v, self.local_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, documents, attn_mask, use_reentrant=False)
        else:
            out = self.core(q, k, v, documents, attn_mask)
        return self.o_proj(out)


def with_causal(attn_mask: torch.Tensor, s: int) -> torch.Tensor:
    """``attn_mask`` (SDPA's: boolean keep, or additive float) with the causal mask of ``s`` tokens joined."""
    lower = torch.ones(s, s, dtype=torch.bool, device=attn_mask.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & lower
    return attn_mask.masked_fill(~lower, float("-inf"))
