"""Typed model configuration (GPT, Llama, Qwen, Mixtral, DeepSeek-V3); the named sizes are in :mod:`models.presets`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parallel.dims import tp_split_problem
from parallel.layers.attention import ROPE_TYPES
from parallel.layers.embedding import padded_vocab_size
from parallel.layers.moe import MoEConfig, MoEConfigError
from parallel.layers.moe_routing import SCORE_FUNCS
from parallel.memory import CHECKPOINTING

ARCHS = ("gpt", "llama")
BIAS_FIELDS = ("qkv_bias", "o_bias", "mlp_bias")


class ModelConfigError(ValueError):
    """A model configuration that cannot be built (or not with this tp)."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a GPT (learned positions, LayerNorm, GELU, biases) or Llama
    (RoPE, RMSNorm, SwiGLU, GQA, no biases) decoder.

    ``n_kv_heads`` defaults to ``n_heads`` and ``d_ff`` to ``4·d_model`` (GPT) or
    Llama's ``multiple_of``-rounded ``8/3·d_model``. The vocabulary is padded to a
    multiple of ``vocab_multiple · tp`` (:meth:`padded_vocab`).

    Mixture of experts (docs/moe.md): ``moe_experts > 0`` replaces the MLP of every
    ``moe_every``-th block from block ``moe_first_dense`` on (blocks ``i ≥ moe_first_dense`` with
    ``(i + 1) % moe_every == 0``) by a
    :class:`~parallel.layers.moe.MoELayer` of experts of width ``moe_d_ff`` (default ``d_ff``).

    DeepSeek-V3: ``kv_lora_rank > 0`` makes attention multi-head latent attention
    (:mod:`parallel.layers.mla`; ``n_kv_heads`` and ``attn_head_dim`` then unused), and
    ``moe_score="sigmoid"`` its router (group-limited choice, a selection bias moved by
    ``moe_bias_update_rate`` after each optimizer step; docs/moe.md).
    """

    arch: str = "gpt"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    vocab_size: int = 256
    seq_len: int = 128
    tie_embeddings: bool = True
    activation_checkpointing: str = "none"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    vocab_multiple: int = 128
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_d_ff: int | None = None
    moe_shared_experts: int = 0
    moe_capacity_factor: float | None = None
    moe_aux_loss_weight: float = 0.01
    moe_z_loss_weight: float = 0.0
    moe_first_dense: int = 0  # the first blocks keep their MLP (Qwen3-MoE's mlp_only_layers, DeepSeek's first_k_dense)
    moe_normalize_top_k: bool = True  # top-k weights renormalised to sum 1 (Mixtral); False: Qwen3-MoE's default
    # Llama 3.1+, Qwen2, Qwen3 (None: the arch's default, GPT with biases, Llama without)
    attn_head_dim: int | None = None  # None: d_model / n_heads
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_type: str = "default"  # default | linear | llama3 | yarn (parallel.layers.attention.ROPE_TYPES)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_position: int = 8192  # llama3, yarn
    rope_beta_fast: float = 32.0  # yarn (transformers' names without the rope_ prefix)
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0  # 0: unset (DeepSeek-V3 sets mscale and mscale_all_dim)
    rope_mscale_all_dim: float = 0.0  # MLA's softmax scale takes its yarn_mscale twice
    rope_attention_factor: float = 0.0  # 0: derived from factor (and the mscales)
    rope_truncate: bool = True
    # DeepSeek-V3 (models/deepseek.py): multi-head latent attention when kv_lora_rank > 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: a plain q projection (HF's q_lora_rank=None)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # the rotary dims of MLA are interleaved pairs (DeepSeek's checkpoints)
    # … and its router: sigmoid scores, group-limited choice, aux-loss-free selection bias
    moe_score: str = "softmax"  # softmax | sigmoid
    moe_groups: int = 1  # HF's n_group
    moe_topk_groups: int = 1  # HF's topk_group
    moe_routed_scale: float = 1.0  # HF's routed_scaling_factor
    moe_bias_update_rate: float = 0.0  # aux-loss-free balancing's step (DeepSeek-V3: 0.001); 0: the bias stays
    moe_seq_aux_loss_weight: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (its α: 0.0001)

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", self._default_d_ff())
        for field in BIAS_FIELDS:  # the arch's default: GPT with biases, Llama without
            if getattr(self, field) is None:
                object.__setattr__(self, field, self.arch == "gpt")

    def _default_d_ff(self) -> int:
        if self.arch == "llama":
            hidden = int(2 * 4 * self.d_model / 3)
            return 256 * -(-hidden // 256)
        return 4 * self.d_model

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` has experts instead of an MLP."""
        return self.moe_experts > 0 and i >= self.moe_first_dense and (i + 1) % self.moe_every == 0

    def moe_config(self) -> MoEConfig:
        """The :class:`MoEConfig` of this model's MoE blocks (SwiGLU without biases for llama, GELU with)."""
        llama = self.arch == "llama"
        return MoEConfig(
            num_experts=self.moe_experts,
            d_ff=self.moe_d_ff or self.d_ff,
            top_k=self.moe_top_k,
            activation="swiglu" if llama else "gelu",
            bias=not llama,
            num_shared_experts=self.moe_shared_experts,
            capacity_factor=self.moe_capacity_factor,
            aux_loss_weight=self.moe_aux_loss_weight,
            z_loss_weight=self.moe_z_loss_weight,
            normalize_top_k=self.moe_normalize_top_k,
            score_func=self.moe_score,
            n_group=self.moe_groups,
            topk_group=self.moe_topk_groups,
            routed_scaling_factor=self.moe_routed_scale,
            bias_update_rate=self.moe_bias_update_rate,
            seq_aux_loss_weight=self.moe_seq_aux_loss_weight,
        )

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def qk_head_dim(self) -> int:
        """The width of one head's ``q·kᵀ`` (MLA: its non-rotary plus rotary parts)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    def bias(self, which: str) -> bool:
        """Whether the ``qkv`` / ``o`` / ``mlp`` projections carry biases."""
        return bool(getattr(self, f"{which}_bias"))

    def rope_scaling(self) -> dict | None:
        """The rotary frequency scaling :func:`parallel.layers.attention.rope_inv_freq` takes (None: plain)."""
        if self.rope_type == "default":
            return None
        return {
            "type": self.rope_type,
            "factor": self.rope_factor,
            "low_freq_factor": self.rope_low_freq_factor,
            "high_freq_factor": self.rope_high_freq_factor,
            "original_max_position": self.rope_original_max_position,
            **(self._yarn_scaling() if self.rope_type == "yarn" else {}),
        }

    def _yarn_scaling(self) -> dict:
        return {
            "beta_fast": self.rope_beta_fast,
            "beta_slow": self.rope_beta_slow,
            "mscale": self.rope_mscale,
            "mscale_all_dim": self.rope_mscale_all_dim,
            "attention_factor": self.rope_attention_factor,
            "truncate": self.rope_truncate,
        }

    def padded_vocab(self, tp: int = 1) -> int:
        return padded_vocab_size(self.vocab_size, tp, self.vocab_multiple)  # one home: parallel.layers

    def replace(self, **changes) -> ModelConfig:
        """A changed copy. Sizes this config derived (``d_ff`` from ``d_model``, ``n_kv_heads``
        from ``n_heads``) are derived again from the new values unless given too, so
        ``preset("gpt_tiny", d_model=256)`` has ``d_ff`` 1024, not the preset's 512."""
        if "d_ff" not in changes and self.d_ff == self._default_d_ff():
            changes["d_ff"] = None
        if "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None
        for field in BIAS_FIELDS:
            if field not in changes and getattr(self, field) == (self.arch == "gpt"):
                changes[field] = None
        return dataclasses.replace(self, **changes)

    def validate(self, tp: int = 1) -> ModelConfig:
        """Raise :class:`ModelConfigError` naming the numbers if this config cannot run at ``tp``."""

        def need(ok: bool, msg: str):
            if not ok:
                raise ModelConfigError(msg)

        need(self.arch in ARCHS, f"arch {self.arch!r} not in {ARCHS}")
        need(
            self.activation_checkpointing in CHECKPOINTING,
            f"activation_checkpointing {self.activation_checkpointing!r} not in {CHECKPOINTING}",
        )
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"):
            need(getattr(self, field) >= 1, f"{field} must be ≥ 1, got {getattr(self, field)}")
        need(tp >= 1, f"tp must be ≥ 1, got {tp}")
        need(
            self.attn_head_dim is not None or self.mla or self.d_model % self.n_heads == 0,
            f"d_model {self.d_model} is not divisible by n_heads {self.n_heads} (or give attn_head_dim)",
        )
        need(
            self.head_dim % 2 == 0 or self.arch != "llama" or self.mla,
            f"rotary embeddings need an even head_dim, got {self.head_dim}",
        )
        need(self.rope_type in ROPE_TYPES, f"rope_type {self.rope_type!r} not in {ROPE_TYPES}")
        need(self.rope_factor > 0, f"rope_factor must be > 0, got {self.rope_factor}")
        need(
            self.rope_original_max_position >= 1,
            f"rope_original_max_position must be ≥ 1, got {self.rope_original_max_position}",
        )
        need(not self.qk_norm or self.arch == "llama", "qk_norm needs arch llama (RMSNorm)")
        need(
            self.n_heads % self.n_kv_heads == 0,
            f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}",
        )
        split = tp_split_problem(self.n_heads, self.n_kv_heads, self.d_ff, tp)  # the one home: parallel.dims
        need(split is None, split)
        if self.mla:
            need(self.arch == "llama", "multi-head latent attention (kv_lora_rank > 0) needs arch llama")
            dims = {k: getattr(self, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
            need(min(dims.values()) >= 1, f"multi-head latent attention needs {dims} all ≥ 1")
            need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.moe_experts:
            need(self.moe_every >= 1, f"moe_every must be ≥ 1, got {self.moe_every}")
            self._validate_deepseek_router(need)
            try:
                self.moe_config().check()
            except MoEConfigError as e:
                raise ModelConfigError(str(e)) from None
        return self

    def _validate_deepseek_router(self, need) -> None:
        E, k, G, g = self.moe_experts, self.moe_top_k, self.moe_groups, self.moe_topk_groups
        if not 1 <= k <= E:
            return  # the layer's own check names top_k
        need(self.moe_score in SCORE_FUNCS, f"moe_score {self.moe_score!r} not in {SCORE_FUNCS}")
        need(
            G >= 1 and E % G == 0 and (G == 1 or E // G >= 2),
            f"moe_groups={G} must split moe_experts={E} into equal groups of ≥ 2 experts; "
            f"choose among {[1] + [d for d in range(2, E // 2 + 1) if E % d == 0]}",
        )
        need(
            1 <= g <= G and g * (E // G) >= k,
            f"moe_topk_groups={g} must be in [1, moe_groups={G}] and hold ≥ moe_top_k={k} experts ({E // G} per group)",
        )
        need(
            not self.moe_bias_update_rate or self.moe_score == "sigmoid",
            f"moe_bias_update_rate={self.moe_bias_update_rate} (aux-loss-free balancing) needs moe_score=sigmoid",
        )


from .presets import PRESETS, preset  # noqa: E402, F401 (the named sizes: models/presets.py)
