"""Tensor-parallel layers: ordinary ``nn.Module``s that take their TP process group.

With ``tp_group=None`` (or a group of one rank) every layer is the plain
single-device layer and communicates nothing. Each class's docstring states the
collectives it issues forward and backward, on which group, and their bytes.
Parameters carry :mod:`parallel.params` marks (TP split dim, sequence-parallel,
no weight decay); :func:`init_parameters_` initialises them independently of the
layout, and :func:`gather_full_tensor` reassembles a sharded one.
"""

from .attention import ParallelSelfAttention, apply_rotary, check_heads, rotary_cos_sin
from .cross_entropy import mean_token_cross_entropy, vocab_parallel_cross_entropy
from .documents import DocumentMask, document_attention, document_ids, document_kernel
from .embedding import VocabParallelEmbedding, mark_vocab_rows, padded_vocab_size
from .fp8 import Fp8Recipe
from .init import gather_full_tensor, init_parameters_, init_tensor_shard_
from .linear import ColumnParallelLinear, LayerConfigError, RowParallelLinear, divide, enable_fp8
from .mla import MultiHeadLatentAttention
from .mlp import ParallelMLP
from .moe import MoEConfig, MoEConfigError, MoELayer, update_router_bias_
from .norm import LayerNorm, RMSNorm, reduce_sequence_parallel_grads
from .ring_attention import (
    check_cp_seq_len,
    check_ulysses_heads,
    context_parallel_attention,
    cp_chunks,
    cp_positions,
    cp_slice,
    ring_attention,
)
from .tokens import check_token_ids, check_token_ids_together
from .ulysses import ulysses_attention

__all__ = [
    "ColumnParallelLinear",
    "DocumentMask",
    "Fp8Recipe",
    "LayerConfigError",
    "LayerNorm",
    "MoEConfig",
    "MoEConfigError",
    "MoELayer",
    "MultiHeadLatentAttention",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_rotary",
    "check_cp_seq_len",
    "check_heads",
    "check_ulysses_heads",
    "context_parallel_attention",
    "cp_chunks",
    "cp_positions",
    "cp_slice",
    "check_token_ids",
    "check_token_ids_together",
    "divide",
    "document_attention",
    "document_ids",
    "document_kernel",
    "enable_fp8",
    "gather_full_tensor",
    "init_parameters_",
    "init_tensor_shard_",
    "mark_vocab_rows",
    "padded_vocab_size",
    "reduce_sequence_parallel_grads",
    "ring_attention",
    "rotary_cos_sin",
    "ulysses_attention",
    "update_router_bias_",
    "mean_token_cross_entropy",
    "vocab_parallel_cross_entropy",
]
