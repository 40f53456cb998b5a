"""Typed model configuration and the named sizes (GPT-2/3 family, Llama)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parallel.dims import tp_split_problem
from parallel.layers.attention import ROPE_TYPES
from parallel.layers.embedding import padded_vocab_size
from parallel.layers.moe import MoEConfig, MoEConfigError
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
    rope_type: str = "default"  # default | linear | llama3 (parallel.layers.attention.ROPE_TYPES)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192

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
        )

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

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
            self.attn_head_dim is not None or self.d_model % self.n_heads == 0,
            f"d_model {self.d_model} is not divisible by n_heads {self.n_heads} (or give attn_head_dim)",
        )
        need(
            self.head_dim % 2 == 0 or self.arch != "llama",
            f"rotary embeddings need an even head_dim, got {self.head_dim}",
        )
        need(self.rope_type in ROPE_TYPES, f"rope_type {self.rope_type!r} not in {ROPE_TYPES}")
        need(self.rope_factor > 0, f"rope_factor must be > 0, got {self.rope_factor}")
        need(not self.qk_norm or self.arch == "llama", "qk_norm needs arch llama (RMSNorm)")
        need(
            self.n_heads % self.n_kv_heads == 0,
            f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}",
        )
        split = tp_split_problem(self.n_heads, self.n_kv_heads, self.d_ff, tp)  # the one home: parallel.dims
        need(split is None, split)
        if self.moe_experts:
            need(self.moe_every >= 1, f"moe_every must be ≥ 1, got {self.moe_every}")
            try:
                self.moe_config().check()
            except MoEConfigError as e:
                raise ModelConfigError(str(e)) from None
        return self


LLAMA31_ROPE = dict(
    rope_type="llama3",
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_position=8192,
)
# Llama 3.1 8B; the 70B differs only in its sizes
LLAMA3_8B = ModelConfig(
    arch="llama",
    n_layers=32,
    d_model=4096,
    n_heads=32,
    n_kv_heads=8,
    d_ff=14336,
    vocab_size=128256,
    seq_len=8192,
    tie_embeddings=False,
    rope_theta=500000.0,
    **LLAMA31_ROPE,
)
PRESETS: dict[str, ModelConfig] = {
    # trains on a CPU in minutes on bytes (vocab 256)
    "gpt_tiny": ModelConfig(arch="gpt", n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128),
    "llama_tiny": ModelConfig(
        arch="llama",
        n_layers=4,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        d_ff=352,
        vocab_size=256,
        seq_len=128,
        tie_embeddings=False,
        norm_eps=1e-6,
    ),
    "gpt2": ModelConfig(arch="gpt", n_layers=12, d_model=768, n_heads=12, vocab_size=50257, seq_len=1024),
    "gpt3_175b": ModelConfig(arch="gpt", n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048),
    "llama_7b": ModelConfig(
        arch="llama",
        n_layers=32,
        d_model=4096,
        n_heads=32,
        n_kv_heads=32,
        d_ff=11008,
        vocab_size=32000,
        seq_len=4096,
        tie_embeddings=False,
        norm_eps=1e-6,
    ),
    # tests: Mixtral's shape in miniature (odd sizes on purpose)
    "mixtral_tiny": ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=48,
        n_heads=4,
        n_kv_heads=2,
        d_ff=40,
        vocab_size=256,
        seq_len=32,
        tie_embeddings=False,
        moe_experts=4,
        moe_top_k=2,
        moe_aux_loss_weight=0.02,
    ),
    # Llama 3.1 (rope scaling to 128k; the published 8B and 70B shapes), Qwen3 dense (QK-norm, head_dim 128)
    "llama3_8b": LLAMA3_8B,
    "llama3_70b": LLAMA3_8B.replace(n_layers=80, d_model=8192, n_heads=64, d_ff=28672),
    "qwen3_tiny": ModelConfig(
        arch="llama",
        n_layers=4,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        attn_head_dim=48,
        d_ff=352,
        vocab_size=256,
        seq_len=128,
        qk_norm=True,
        norm_eps=1e-6,
        rope_theta=1e6,
    ),
    "qwen3_8b": ModelConfig(
        arch="llama",
        n_layers=36,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        attn_head_dim=128,
        d_ff=12288,
        vocab_size=151936,
        seq_len=32768,
        tie_embeddings=False,
        qk_norm=True,
        norm_eps=1e-6,
        rope_theta=1e6,
    ),
    "qwen3_30b_a3b": ModelConfig(
        arch="llama",
        n_layers=48,
        d_model=2048,
        n_heads=32,
        n_kv_heads=4,
        attn_head_dim=128,
        d_ff=6144,
        vocab_size=151936,
        seq_len=32768,
        tie_embeddings=False,
        qk_norm=True,
        norm_eps=1e-6,
        rope_theta=1e6,
        moe_experts=128,
        moe_top_k=8,
        moe_d_ff=768,
        moe_aux_loss_weight=0.001,
    ),
    # Mixtral-8x7B (46.7B parameters, 12.9B active per token); the planner's MoE reference
    "mixtral_8x7b": ModelConfig(
        arch="llama",
        n_layers=32,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        vocab_size=32000,
        seq_len=4096,
        tie_embeddings=False,
        rope_theta=1e6,
        moe_experts=8,
        moe_top_k=2,
        moe_aux_loss_weight=0.02,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named size (``gpt_tiny``, ``llama_tiny``, ``gpt2``, ``gpt3_175b``, ``llama_7b``), optionally changed."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
