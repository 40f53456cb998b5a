"""The model as the planner sees it: sizes, the layer split, FLOPs. :class:`ModelShape` reads the numbers
of a GPT or Llama decoder from any config with those attributes, so ``parallel.plan`` never imports
``models``; :func:`layer_partition` is the pipeline split the trainer uses too."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from ..layers.embedding import padded_vocab_size
from ..pipeline.partition import partition_layers
from .hardware import PlanError


@dataclass(frozen=True)
class ModelShape:
    arch: str  # gpt (LayerNorm, GELU MLP) | llama (RMSNorm, SwiGLU MLP)
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool = True
    vocab_multiple: int = 128
    attn_head_dim: int | None = None  # None: d_model / n_heads
    # multi-head latent attention (DeepSeek-V3) when kv_lora_rank > 0 (parallel.layers.mla)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """The shape of any object carrying these attributes (e.g. ``models.config.ModelConfig``;
        those with defaults may be absent)."""
        if isinstance(cfg, cls):
            return cfg
        return cls(
            **{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name) or f.default is MISSING}
        )

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def qk_v_head_dims(self) -> tuple[int, int]:
        """Each head's query/key and value widths (MLA: nope + rope and v_head_dim)."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    @property
    def attention_kv_heads(self) -> int:
        """The heads of the k and v attention reads (MLA: every head, its shared rotary key expanded)."""
        return self.n_heads if self.kv_lora_rank else self.n_kv_heads

    def attention_matmul_params(self) -> int:
        """Weights of one block's attention matmuls (biases and norms excluded): q, k, v, o; or MLA's
        q (down + up, or one projection), kv down (with the shared rotary key), kv up and o."""
        d, H = self.d_model, self.n_heads
        qk, v = self.qk_v_head_dims
        if not self.kv_lora_rank:
            return d * H * qk + 2 * d * self.n_kv_heads * qk + H * v * d
        q = self.q_lora_rank * (d + H * qk) if self.q_lora_rank else d * H * qk
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * H * (self.qk_nope_head_dim + v)
        return q + kv + H * v * d

    def attention_core_flops_per_token(self) -> float:
        """One block's attention scores and mixing, forward + backward, per token: ``6·s·H·(qk + v)``
        (PaLM's ``12·s·d`` when both head widths are ``d / H``; causal masking not discounted)."""
        qk, v = self.qk_v_head_dims
        return 6 * self.seq_len * self.n_heads * (qk + v)

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, tp, self.vocab_multiple)

    def block_matmul_params(self) -> int:
        """Weights of one block's matmuls (attention and the MLP), biases and norms excluded."""
        mats = 3 if self.arch == "llama" else 2
        return self.attention_matmul_params() + mats * self.d_model * self.d_ff


def layer_costs(shape: ModelShape) -> dict[str, float]:
    """Costs the partitioner balances, in units of one block: the embedding is a lookup
    (1/L), the head a ``V×d`` matmul against a block's ≈12·d² weights."""
    d = shape.d_model
    return {
        "layer_cost": 1.0,
        "embedding_cost": 1.0 / max(1, shape.n_layers),
        "head_cost": shape.vocab_size * d / (12 * d * d + 1),
    }


def layer_partition(shape: ModelShape, pp: int, vpp: int = 1, pp_layers=None) -> list[range]:
    """Layer ranges per virtual stage (see :func:`parallel.pipeline.partition.partition_layers`)."""
    try:
        return partition_layers(shape.n_layers, pp, vpp=vpp, pp_layers=pp_layers, **layer_costs(shape))
    except ValueError as e:
        raise PlanError(str(e)) from None


def model_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token without recomputation (PaLM's 6·N + 12·L·d·s; the MFU numerator) of any config."""
    shape = ModelShape.of(shape)
    n = shape.n_layers * shape.block_matmul_params() + shape.vocab_size * shape.d_model
    return 6 * n + shape.n_layers * shape.attention_core_flops_per_token()


def model_tflops_per_device(tokens_per_s: float, shape: ModelShape, devices: int) -> float:
    """Model TFLOP/s each of ``devices`` achieves at ``tokens_per_s`` for the whole job (MFU = this / peak)."""
    return tflops_per_device(tokens_per_s, model_flops_per_token(shape), devices)


def tflops_per_device(tokens_per_s: float, flops_per_token: float, devices: int) -> float:
    """TFLOP/s each of ``devices`` achieves at ``tokens_per_s`` for a model of ``flops_per_token`` (training)."""
    return tokens_per_s * flops_per_token / devices / 1e12
