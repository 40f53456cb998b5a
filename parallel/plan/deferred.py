"""What a micro-batch holds between zero-bubble's B and W (:mod:`parallel.pipeline.split_backward`):
the inputs of each weight's GEMM and the gradients of its output, not the activations it stored."""

from __future__ import annotations

from .memory import PRECISION_BYTES, norm_bytes
from .shape import ModelShape


def deferred_stage_bytes(
    shape,
    micro_batch: int,
    n_layers: int,
    *,
    has_head: bool,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "bf16",
) -> float:
    """What one micro-batch leaves on a chunk of ``n_layers`` dense GPT layers (LayerNorm, GELU, biases)
    between its zero-bubble B and W (:mod:`parallel.pipeline.split_backward`), checkpointing none.

    W computes each weight's gradient from the layer's input and the gradient of its output, so B
    keeps both and frees the rest as it goes (q, k, v, the log-sum-exp, GELU's input, the loss's
    softmax): per norm its input, mean and rstd and its output gradient (``e·sbh/t'`` each); per
    column layer (q/k/v of width ``W = (H·qk + K·(qk + v))/t``, the MLP's input, ``d_ff/t``, and the
    head's ``V/t``) its input ``e·sbh/t'`` and output gradient ``e·sbW``, except under sequence
    parallelism, whose fused matmul computes the weight gradient in B and hands over ``e·(h + 1)·W``
    instead; per row layer (the attention's and the MLP's out) its input (``e·sb·H·v/t``,
    ``e·sb·d_ff/t``) and output gradient ``e·sbh``, the full sequence, plus under sequence parallelism
    the gradient its bias reads, the sequence chunk's ``e·sbh/t`` (without, it is the same tensor)."""
    shape = ModelShape.of(shape)
    e = PRECISION_BYTES[precision]
    sb, h = shape.seq_len * micro_batch, shape.d_model
    fused = sequence_parallel and tp > 1
    sp = tp if fused else 1
    norm = norm_bytes(shape.arch, sb * h, sb, e) / sp + e * sb * h / sp

    def column(width: float, bias: bool = True) -> float:
        return e * (h + bias) * width if fused else e * sb * h / sp + e * sb * width

    def row(width: float) -> float:
        return e * sb * width + e * sb * h + (e * sb * h / sp if fused else 0.0)

    qk, v = shape.qk_v_head_dims
    qkv = (shape.n_heads * qk + shape.n_kv_heads * (qk + v)) / tp
    layer = 2 * norm + column(qkv) + column(shape.d_ff / tp) + row(shape.n_heads * v / tp) + row(shape.d_ff / tp)
    head = norm + column(shape.padded_vocab(tp) / tp, bias=False)
    return n_layers * layer + (head if has_head else 0.0)


def compiled_deferred_bytes(block_params: float, precision: str = "bf16") -> float:
    """What one micro-batch leaves on a chunk of ``torch.compile``'d blocks between its zero-bubble B and
    W: a compiled block is one autograd node whose backward computes its weight gradients in B whatever
    autograd asks, and B keeps them until W (:func:`parallel.pipeline.split_backward.backward_input`),
    freeing what the node saved: ``e`` bytes per parameter of the chunk's blocks."""
    return PRECISION_BYTES[precision] * block_params
