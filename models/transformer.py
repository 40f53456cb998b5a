"""GPT and Llama decoders as pipeline stages built from :mod:`parallel.layers`.

A stage holds a contiguous range of the model's blocks, plus the embedding if it
is the first pipeline stage and the final norm + output head if it is the last.
Parameter names are global and layout-independent (``blocks.<i>.attn.q_proj.weight``
with the *global* block index ``i``; ``tok_embed.weight``; ``lm_head.weight``), so
checkpoints and Hugging Face weights map onto any tp / pp split.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel import comm
from parallel.dims import sequence_split_problem
from parallel.layers import (
    ColumnParallelLinear,
    DocumentMask,
    LayerNorm,
    MoELayer,
    MultiHeadLatentAttention,
    ParallelMLP,
    ParallelSelfAttention,
    RMSNorm,
    VocabParallelEmbedding,
    check_cp_seq_len,
    cp_positions,
    cp_slice,
    document_kernel,
    gather_full_tensor,
    init_parameters_,
    mark_vocab_rows,
    mean_token_cross_entropy,
)
from parallel.params import mark_init_key, mark_sequence_parallel, mark_shared_embedding

from .config import CHECKPOINTING, ModelConfig, ModelConfigError


def multi_head_latent_attention(d_model: int, n_heads: int, n_kv_heads: int, *, cfg: ModelConfig, **kw):
    """DeepSeek's attention for ``cfg`` (``parallel.layers.mla``), built from the block's arguments."""
    for unused in ("bias", "o_bias", "head_dim", "qk_norm_eps", "rope"):
        kw.pop(unused)
    return MultiHeadLatentAttention(
        d_model,
        n_heads,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=cfg.rope_interleave,
        norm_eps=cfg.norm_eps,
        bias=cfg.bias("qkv"),
        **kw,
    )


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Its TP traffic per forward + backward is the attention's plus the MLP's: two
    all-reduces of the activation forward and two backward (or, sequence-parallel,
    two all-gathers + two reduce-scatters each way).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp_group=None,
        sequence_parallel=False,
        cp_group=None,
        cp_impl="ring",
        device=None,
        dtype=None,
        layer=0,
        ep_group=None,
    ):
        super().__init__()
        llama = cfg.arch == "llama"
        kw = dict(device=device, dtype=dtype)
        norm = RMSNorm if llama else LayerNorm
        self.attn_norm = norm(cfg.d_model, cfg.norm_eps, sequence_parallel=sequence_parallel, **kw)
        self.attn = (multi_head_latent_attention if cfg.mla else ParallelSelfAttention)(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            bias=cfg.bias("qkv"),
            o_bias=cfg.bias("o"),
            head_dim=cfg.head_dim,
            qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
            rope=llama,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling(),
            cp_group=cp_group,
            cp_impl=cp_impl,
            **kw,
            **({"cfg": cfg} if cfg.mla else {}),
        )
        self.mlp_norm = norm(cfg.d_model, cfg.norm_eps, sequence_parallel=sequence_parallel, **kw)
        if cfg.is_moe_layer(layer):  # experts instead of the MLP (parallel/layers/moe.py)
            self.mlp = MoELayer(
                cfg.d_model, cfg.moe_config(), ep_group=ep_group, tp_group=tp_group,
                sequence_parallel=sequence_parallel, cp_group=cp_group, **kw,
            )  # fmt: skip
            return
        self.mlp = ParallelMLP(
            cfg.d_model,
            cfg.d_ff,
            activation="swiglu" if llama else "gelu",
            bias=cfg.bias("mlp"),
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            **kw,
        )

    def attention_half(
        self, x: torch.Tensor, documents: DocumentMask | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + attn(norm(x)), mlp_norm of that)``: the residual stream after attention and the MLP's
        input (one compiled region of an MoE block: the norm's backward sums into the residual's gradient
        inside the graph, in eager's order)."""
        x = x + self.attn(self.attn_norm(x), documents)
        return x, self.mlp_norm(x)

    def forward(self, x: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        x, h = self.attention_half(x, documents)
        return x + self.mlp(h)


class TransformerStage(nn.Module):
    """Blocks ``layers`` of the model, with the embedding and/or head if asked (see module doc).

    ``forward(x)``: token ids ``[b, s]`` if ``has_embedding`` else hidden ``[b, s, d]``
    (``[b, s/tp, d]`` with sequence parallelism); returns hidden, or, if ``has_head``,
    vocabulary-parallel logits ``[b, s, V_padded/tp]`` whose padding columns are
    ``finfo.min`` (they never win). ``loss(logits, targets)``: mean token cross-entropy.

    TP traffic of a whole model (one stage with embedding, ``L`` blocks and head) per
    forward + loss + backward, bytes sent per rank on ``tp_group`` (``N`` ranks, ring
    factor ``ρ = (N-1)/N``, ``A`` = bytes of the activation ``[b, s, d]``, ``T = b·s``):
    ``ρ·A·(2 + 8·L + 2) + 2ρ·12·T`` — embedding 2ρA, each block 8ρA (two all-reduces
    each way, or their all-gather/reduce-scatter halves), head input 2ρA, cross-entropy
    2ρ·12T. Sequence parallelism adds one all-gather of ``A`` in backward per column-parallel
    input (the input is saved as a sequence chunk and gathered again): 2ρA per block and ρA for
    the head. ``full`` checkpointing
    recomputes each block's forward up to the last tensor backward needs (torch's
    non-reentrant checkpoint skips the final reduction): 2ρA more per block, 3ρA with
    sequence parallelism. ``reduce_sequence_parallel_grads`` is extra.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp_group=None,
        sequence_parallel=False,
        layers: range | None = None,
        has_embedding=True,
        has_head=True,
        cp_group=None,
        cp_impl="ring",
        device="cpu",
        dtype=torch.float32,
        ep_group=None,
    ):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        self.cp_group, self.cp_size = cp_group, comm.tp_world_size(cp_group)  # context parallel: s/cp tokens
        self.cp_impl = cp_impl
        check_cp_seq_len(cfg.seq_len, self.cp_size)
        cfg.validate(tp=tp)
        layers = range(cfg.n_layers) if layers is None else layers
        if len(layers) and (layers.step != 1 or layers.start < 0 or layers.stop > cfg.n_layers):
            raise ModelConfigError(
                f"layers {layers} must be a contiguous range inside [0, {cfg.n_layers}) (n_layers {cfg.n_layers})"
            )
        self.cfg, self.tp_group, self.tp_size = cfg, tp_group, tp
        self.sequence_parallel = sequence_parallel and tp > 1
        self.layers, self.has_embedding, self.has_head = layers, has_embedding, has_head
        self.padded_vocab = cfg.padded_vocab(tp)
        kw = dict(device=device, dtype=dtype)
        sp = self.sequence_parallel
        if has_embedding:
            self.tok_embed = VocabParallelEmbedding(
                self.padded_vocab, cfg.d_model, tp_group=tp_group, vocab_size=cfg.vocab_size, sequence_parallel=sp, **kw
            )
            if cfg.arch == "gpt":
                self.pos_embed = nn.Embedding(cfg.seq_len, cfg.d_model, **kw)
                if sp:
                    mark_sequence_parallel(self.pos_embed.weight)
        self.blocks = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    cfg,
                    tp_group=tp_group,
                    sequence_parallel=sp,
                    cp_group=cp_group,
                    cp_impl=cp_impl,
                    layer=i,
                    ep_group=ep_group,
                    **kw,
                )
                for i in layers
            }
        )
        if has_head:
            norm = RMSNorm if cfg.arch == "llama" else LayerNorm
            self.norm_f = norm(cfg.d_model, cfg.norm_eps, sequence_parallel=sp, **kw)
            self.lm_head = ColumnParallelLinear(
                cfg.d_model, self.padded_vocab, tp_group=tp_group, bias=False, sequence_parallel=sp, **kw
            )
            mark_vocab_rows(self.lm_head.weight, cfg.vocab_size)
            if cfg.tie_embeddings and has_embedding:
                self.lm_head.weight = self.tok_embed.weight
            elif cfg.tie_embeddings:
                mark_init_key(self.lm_head.weight, "tok_embed.weight")
                mark_shared_embedding(self.lm_head.weight)
        if cfg.tie_embeddings and has_embedding and not has_head:
            mark_shared_embedding(self.tok_embed.weight)
        self.activation_checkpointing = cfg.activation_checkpointing

    def _apply(self, fn, recurse=True):
        """Device/dtype moves that make new Parameters (``to_empty`` from ``meta``) keep the
        layout marks and the embedding tie."""
        marks = {name: dict(p.__dict__) for name, p in self.named_parameters()}
        out = super()._apply(fn, recurse)
        if self.cfg.tie_embeddings and self.has_embedding and self.has_head:
            self.lm_head.weight = self.tok_embed.weight
        for name, p in self.named_parameters():
            for key, value in marks.get(name, {}).items():
                setattr(p, key, value)
        return out

    # activation checkpointing ---------------------------------------------------
    @property
    def activation_checkpointing(self) -> str:
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: str) -> None:
        """``none``; ``selective``: attention cores recomputed; ``full``: whole blocks recomputed."""
        if mode not in CHECKPOINTING:
            raise ModelConfigError(f"activation_checkpointing {mode!r} not in {CHECKPOINTING}")
        self._checkpointing = mode
        for block in self.blocks.values():
            block.attn.recompute_core = mode == "selective"

    # forward ----------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if ids.dim() != 2:
            raise ModelConfigError(f"first stage expects token ids [batch, seq], got shape {tuple(ids.shape)}")
        s = ids.shape[1]
        if s * self.cp_size > self.cfg.seq_len:
            raise ModelConfigError(
                f"sequence length {s} × cp {self.cp_size} exceeds the model's seq_len {self.cfg.seq_len}"
            )
        split = sequence_split_problem(s, self.tp_size) if self.sequence_parallel else None  # parallel.dims
        if split:
            raise ModelConfigError(split)
        h = self.tok_embed(ids)
        if self.cfg.arch == "gpt":
            local = h.shape[1]
            start = comm.tp_rank(self.tp_group) * local if self.sequence_parallel else 0
            pos = torch.arange(start, start + local, device=ids.device)
            if positions is not None:  # packed documents: this rank's tokens' positions in their documents
                pos = positions[:, start : start + local]
            elif self.cp_size > 1:  # global positions of this cp rank's load-balanced tokens
                pos = cp_positions(s * self.cp_size, self.cp_size, comm.tp_rank(self.cp_group), ids.device)[pos]
            h = h + self.pos_embed(pos)
        return h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm_f(h))
        local_v = logits.shape[-1]
        start = comm.tp_rank(self.tp_group) * local_v
        if start + local_v > self.cfg.vocab_size:
            pad = torch.arange(start, start + local_v, device=logits.device) >= self.cfg.vocab_size
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        return logits

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` ``[b, s]`` (the whole window, on every stage and every cp rank): packed
        documents, each token's position in its document (:mod:`parallel.layers.documents`); attention
        is then document-causal and rotary / learned positions restart at each document."""
        documents = None
        if positions is not None:  # one mask for every block of this stage; this cp rank's positions
            documents = DocumentMask(positions, cp_slice(positions, self.cp_size, comm.tp_rank(self.cp_group)))
            if self.cp_size == 1 or self.cp_impl != "ring":  # the ring masks by ids, block by block
                documents.prepare(document_kernel(positions.device.type, self.cfg.qk_head_dim))
        if self.has_embedding:
            h = self._embed(x, None if documents is None else documents.local)
        else:
            if x.dim() != 3 or x.shape[-1] != self.cfg.d_model:
                raise ModelConfigError(
                    f"stage without embedding expects hidden [batch, seq, {self.cfg.d_model}], got {tuple(x.shape)}"
                )
            h = x
        for block in self.blocks.values():
            if self._checkpointing == "full" and torch.is_grad_enabled():
                h = checkpoint(block, h, documents, use_reentrant=False)
            else:
                h = block(h, documents)
        return self._head(h) if self.has_head else h

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy over vocabulary-parallel ``logits`` (see
        :func:`~parallel.layers.vocab_parallel_cross_entropy` for its communication)."""
        if not self.has_head:
            raise ModelConfigError("loss() needs the stage that holds the head (has_head=True)")
        group = self.tp_group if self.tp_size > 1 else None  # one rank: no group lookups per micro-batch
        return mean_token_cross_entropy(logits, targets, group, vocab_size=self.cfg.vocab_size)


def init_rule(cfg: ModelConfig):
    """GPT-2's initialisation: normal(0, init_std), residual output projections scaled by
    ``1/sqrt(2·n_layers)``, biases zero, norm weights one."""
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def rule(name: str, p: nn.Parameter) -> tuple:
        if name.endswith("bias"):
            return ("zeros",)
        if p.dim() == 1:
            return ("ones",)
        if name.endswith(("o_proj.weight", "fc_out.weight", "down_proj.weight", "experts.down_proj", "experts.fc_out")):
            return ("normal", residual_std)
        return ("normal", cfg.init_std)

    return rule


def build_model(
    cfg: ModelConfig,
    *,
    tp_group=None,
    sequence_parallel: bool = False,
    layers: range | None = None,
    has_embedding: bool = True,
    has_head: bool = True,
    cp_group=None,
    cp_impl: str = "ring",
    device="cpu",
    dtype=torch.float32,
    seed: int = 0,
    ep_group=None,
) -> TransformerStage:
    """Build (and, unless on ``meta``, initialise) one stage of the model; see :class:`TransformerStage`.

    Initialisation is layout-independent (:func:`parallel.layers.init_parameters_`): same
    ``seed`` and ``cfg`` give the same gathered weights for any tp and any ``layers`` split.
    The stage is built on ``meta`` and then materialised, so the layers' own default
    initialisation is skipped (no double work, torch's generator untouched). No communication.
    """
    stage = TransformerStage(
        cfg,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        layers=layers,
        has_embedding=has_embedding,
        has_head=has_head,
        cp_group=cp_group,
        cp_impl=cp_impl,
        device="meta",
        dtype=dtype,
        ep_group=ep_group,
    )
    if torch.device(device).type != "meta":
        stage.to_empty(device=device)
        init_parameters_(stage, seed=seed, tp_group=tp_group, rule=init_rule(cfg))
        for _, buf in stage.named_buffers():  # DeepSeek's router bias starts at zero
            buf.zero_()
    return stage


def gather_full_state_dict(
    stage: nn.Module, tp_group=None, *, grads: bool = False, ep_group=None
) -> dict[str, torch.Tensor]:
    """Full (unsharded, vocabulary padding removed) parameters by name, on every TP (and EP) rank.

    ``grads=True`` gathers the gradients instead (absent ones are skipped). One
    all-gather per sharded tensor on ``tp_group`` (output = its full bytes), and one more on
    ``ep_group`` per expert tensor split over ep (every global expert).
    """
    out = {}
    for name, p in stage.named_parameters():
        if grads and p.grad is None:
            continue
        out[name] = gather_full_tensor(p, tp_group, data=p.grad if grads else None, ep_group=ep_group)
    return out
