"""Multi-head latent attention (DeepSeek-V2/V3) with heads split over the TP group.

Per token, ``x`` is compressed to a kv latent ``c_kv = norm(W_dkv·x)`` (``kv_lora_rank`` wide) and
a rotary key ``k_pe`` (``qk_rope_head_dim``, one for all heads), computed together by
``kv_a_proj``; ``kv_b_proj`` expands ``c_kv`` into each head's ``k_nope`` (``qk_nope_head_dim``)
and value (``v_head_dim``). Queries come from ``q_proj`` or, with ``q_lora_rank``, through their
own latent ``q_b_proj(norm(q_a_proj(x)))``; each head's query is ``[q_nope, rope(q_pe)]`` and its
key ``[k_nope, rope(k_pe)]``. ``rope_interleave`` (DeepSeek's checkpoints) reads the rotary
dimensions as interleaved pairs ``(x0, x1), (x2, x3) …``; they are de-interleaved before the
rotate-half rotation, which is the same rotation. Softmax scale ``mscale²/√(nope + rope)``, where
``mscale`` is 1 unless YaRN rope scaling gives ``mscale_all_dim`` (DeepSeek's rule:
:func:`~.attention.rope_softmax_mscale`).

**Tensor parallelism.** The down-projections (``q_a_proj``, ``kv_a_proj``) and their norms are
replicated on every TP rank (their outputs are small); the up-projections (``q_proj`` /
``q_b_proj``, ``kv_b_proj``) are column-parallel by heads and ``o_proj`` row-parallel. Each rank
computes the latents of the same tokens; the up-projections' "f" all-reduces the latents'
gradients in backward (``q_lora_rank + kv_lora_rank`` wide, less than ``d_model``) and one more
all-reduces ``k_pe``'s, so the replicated weights and ``x`` get the full gradient on every rank.
Forward: one all-reduce of the output ``[b, s, d]`` (``o_proj``).

**Sequence parallelism.** The input is this rank's ``s/N`` tokens; the down-projections and their
norms run on them (their weights, replicated, are marked ``sequence_parallel``: each rank's gradient
covers its tokens only, and :func:`~.norm.reduce_sequence_parallel_grads` sums them over TP, as for
the block's norms). The up-projections all-gather the narrow latents along the sequence (not
``x``: ``q_lora_rank + kv_lora_rank + qk_rope_head_dim`` wide instead of ``d_model``) and
reduce-scatter their gradients; ``o_proj`` reduce-scatters its output.

**Context parallelism** (``cp_group``, ``cp_impl``: :mod:`.ring_attention`'s layout and kernels). The
input is this rank's ``s/cp`` tokens (chunks ``r`` and ``2·cp−1−r``); everything up to the attention
core is per token, so it runs on them unchanged. The decoupled rotary parts turn at the tokens' global
positions (:func:`~.ring_attention.cp_positions`; packed documents: their in-document positions,
``DocumentMask.local``), ``k_pe`` is expanded to this rank's heads, and q ``[b, h, s/cp, nope+rope]``,
k (the same width) and v (``v_head_dim`` wide) go to :func:`~.ring_attention.context_parallel_attention`
at this layer's scale: Ulysses all-to-alls them to whole sequences of ``h/(tp·cp)`` heads (the heads per
TP rank must divide by cp), the ring circulates K|V (``nope + rope + v`` wide per head). Both take
packed documents' masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import comm
from ..params import mark_sequence_parallel
from .attention import apply_rotary, rope_softmax_mscale, rotary_cos_sin
from .documents import DocumentMask, document_attention
from .linear import ColumnParallelLinear, LayerConfigError, RowParallelLinear, divide
from .norm import RMSNorm
from .ring_attention import check_cp_impl, check_ulysses_heads, context_parallel_attention, cp_positions


def _replicated_linear(d_in: int, d_out: int, bias: bool, sequence_parallel: bool, **kw) -> nn.Linear:
    """A down-projection, whole on every TP rank; under sequence parallelism its gradient is partial."""
    linear = nn.Linear(d_in, d_out, bias=bias, **kw)
    if sequence_parallel:
        for p in linear.parameters():
            mark_sequence_parallel(p)
    return linear


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA, ``n_heads/N`` heads per TP rank; see the module docstring.

    Communication on ``tp_group`` per forward + backward: forward one all-reduce of the output
    activation ``A``; backward all-reduces of the latents' and ``k_pe``'s gradients
    (``(q_lora_rank + kv_lora_rank + qk_rope_head_dim)/d_model · A``; with ``q_lora_rank=None``
    the query's input gradient ``A`` instead of its latent's). Sequence-parallel: the same widths
    all-gathered forward and reduce-scattered backward (the latents with ``k_pe``, or ``x`` for a plain
    q projection, each collective its own), and the output reduce-scattered forward, all-gathered backward.
    Context-parallel: on ``cp_group``, the attention core's (:func:`~.ring_attention.ring_bytes`,
    :func:`~.ring_attention.ulysses_bytes` with ``v_head_dim``; kv heads = this rank's heads)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        rope_interleave: bool = True,
        bias: bool = False,
        tp_group=None,
        sequence_parallel: bool = False,
        cp_group=None,
        cp_impl: str = "ring",
        recompute_core: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if qk_rope_head_dim % 2:
            raise LayerConfigError(f"qk_rope_head_dim must be even for rotary embeddings, got {qk_rope_head_dim}")
        tp, cp = comm.tp_world_size(tp_group), comm.tp_world_size(cp_group)
        self.local_heads = divide(n_heads, tp, "n_heads")
        check_cp_impl(cp_impl)
        if cp > 1 and cp_impl == "alltoall":  # k carries every head (k_pe expanded): kv heads = heads
            check_ulysses_heads(n_heads, n_heads, cp, tp)
        self.cp_group, self.cp, self.cp_impl = cp_group, cp, cp_impl
        self.tp_group, self.n_heads, self.q_lora_rank, self.kv_lora_rank = tp_group, n_heads, q_lora_rank, kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_theta, self.rope_scaling, self.rope_interleave = rope_theta, rope_scaling, rope_interleave
        mscale = rope_softmax_mscale(rope_scaling)
        self.scale = mscale * mscale / (qk_nope_head_dim + qk_rope_head_dim) ** 0.5
        self.recompute_core = recompute_core
        self.sequence_parallel = sp = sequence_parallel and tp > 1
        kw = dict(device=device, dtype=dtype)
        col = dict(tp_group=tp_group, bias=False, sequence_parallel=sp, **kw)
        qk = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank:
            self.q_a_proj = _replicated_linear(d_model, q_lora_rank, bias, sp, **kw)
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps, sequence_parallel=sp, **kw)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, qk, **col)
        else:
            self.q_proj = ColumnParallelLinear(d_model, qk, **col)
        self.kv_a_proj = _replicated_linear(d_model, kv_lora_rank + qk_rope_head_dim, bias, sp, **kw)
        self.kv_a_norm = RMSNorm(kv_lora_rank, norm_eps, sequence_parallel=sp, **kw)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), **col)
        self.o_proj = RowParallelLinear(n_heads * v_head_dim, d_model, **col | {"bias": bias})

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:  # pairs (x0, x1), (x2, x3) …: evens then odds is rotate-half's layout
            t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
        return apply_rotary(t, cos, sin)

    def core(
        self, q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, documents: DocumentMask | None = None
    ) -> torch.Tensor:
        """``q`` ``[b, h, s, nope+rope]``, ``kv`` ``[b, h, s, nope+v]``, ``k_pe`` ``[b, 1, s, rope]`` →
        ``[b, s, h·v]`` (rotary on the rope parts, then causal SDPA at this layer's scale; context-parallel:
        this rank's ``s`` tokens at their global positions, attending over the whole sequence). ``documents``
        (packed windows, :mod:`.documents`): rotary positions restart at each document and attention is
        document-causal."""
        b, h, s, _ = q.shape
        cos, sin = rotary_cos_sin(s * self.cp, self.rope_dim, self.rope_theta, q.device, self.rope_scaling)
        if documents is not None:  # [b, 1, s, rope]: each token's position in its document
            cos, sin = cos[documents.local][:, None], sin[documents.local][:, None]
        elif self.cp > 1:  # this rank's tokens sit at their global positions
            pos = cp_positions(s * self.cp, self.cp, comm.tp_rank(self.cp_group), q.device)
            cos, sin = cos[pos], sin[pos]
        q_pe, k_pe = self._rotate(q[..., self.nope :], cos, sin), self._rotate(k_pe, cos, sin)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, h, s, self.rope_dim)], dim=-1)
        if q.device.type == "meta" and self.v_dim != q.shape[-1]:  # torch's meta SDPA gives q's width: pad v
            v = F.pad(v, (0, q.shape[-1] - self.v_dim)) if self.v_dim < q.shape[-1] else v
        if self.cp > 1:
            out = context_parallel_attention(
                q, k, v, self.cp_group, impl=self.cp_impl, scale=self.scale, documents=documents
            )[..., : self.v_dim]
        elif documents is not None:
            out = document_attention(q, k, v, documents, scale=self.scale)[..., : self.v_dim]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)[..., : self.v_dim]
        return out.transpose(1, 2).reshape(b, s, h * self.v_dim)

    def forward(self, x: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        """``x`` ``[b, s, d]`` (this cp rank's ``s/cp`` tokens; sequence-parallel: ``s/(cp·tp)``);
        ``documents``: see :meth:`core`."""
        if x.dim() != 3:
            raise LayerConfigError(f"MultiHeadLatentAttention: expected [batch, seq, d_model], got {tuple(x.shape)}")
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        c_kv, k_pe = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv))
        b, s, _ = q.shape  # this cp rank's whole part (sequence-parallel: the up-projections gathered it)
        if self.sequence_parallel:  # gathered; backward reduce-scatters: each rank's heads add to its gradient
            k_pe = comm.gather_from_sequence_parallel_region(k_pe, self.tp_group)
        else:
            k_pe = comm.copy_to_tp_region(k_pe, self.tp_group)  # each rank's heads add to its gradient
        q = q.view(b, s, self.local_heads, -1).transpose(1, 2)
        kv = kv.view(b, s, self.local_heads, -1).transpose(1, 2)
        k_pe = k_pe.unsqueeze(1)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, kv, k_pe, documents, use_reentrant=False)
        else:
            out = self.core(q, kv, k_pe, documents)
        return self.o_proj(out)
