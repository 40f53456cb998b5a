"""The model as the planner sees it: sizes, the layer split, FLOPs. :class:`ModelShape` reads the numbers
of a GPT or Llama decoder from any config with those attributes, so ``parallel.plan`` never imports
``models``; :func:`layer_partition` is the pipeline split the trainer uses too."""

from __future__ import annotations

from dataclasses import dataclass, fields

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

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """The shape of any object carrying these attributes (e.g. ``models.config.ModelConfig``)."""
        return cfg if isinstance(cfg, cls) else cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, tp, self.vocab_multiple)

    def block_matmul_params(self) -> int:
        """Weights of one block's matmuls (q, k, v, o and the MLP), biases and norms excluded."""
        kv = self.n_kv_heads * self.head_dim
        mats = 3 if self.arch == "llama" else 2
        return self.d_model * (self.d_model + 2 * kv) + self.d_model**2 + mats * self.d_model * self.d_ff


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
    return 6 * n + 12 * shape.n_layers * shape.d_model * shape.seq_len


def model_tflops_per_device(tokens_per_s: float, shape: ModelShape, devices: int) -> float:
    """Model TFLOP/s each of ``devices`` achieves at ``tokens_per_s`` for the whole job (MFU = this / peak)."""
    return tokens_per_s * model_flops_per_token(shape) / devices / 1e12
