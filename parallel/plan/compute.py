"""Compute time of one micro-batch on one rank, from the shapes of the work it does: a GEMM
``[M, K] × [K, N]`` takes ``2MKN / (peak · efficiency)`` plus streaming its operands at HBM bandwidth
(backward: two per forward GEMM); flash attention (SDPA) ``4·b·s²·d/t`` FLOPs forward, half of them done
(causal), at ``peak · attention_efficiency``, backward 2.5× (``"unfused"``: Megatron-LM 2021's batched
GEMMs and softmax over the scores); elementwise work its bytes at HBM bandwidth; the profile's host
costs (:class:`~.hardware.HostCosts`, none on a GPU) per block, micro-batch and step, a third forward.
Ranks sharing a host (:func:`colocated`) compute ``1 + colocated_slowdown · (k − 1)`` times slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..precision import FP8, FP8_BYTES
from .hardware import Hardware, host_costs
from .shape import ModelShape


def gemm_seconds(m: float, k: float, n: float, hw: Hardware, precision: str, batch: float = 1.0) -> float:
    """Seconds of ``batch`` GEMMs ``[m, k] × [k, n]`` (module docstring); ``fp8``: at the fp8 peak, its
    operands one byte each (the output's 2 bytes counted as one more operand byte: bf16 out)."""
    e = 4 if precision == "fp32" else FP8_BYTES if precision == FP8 else 2
    flops = 2.0 * batch * m * k * n
    return flops / (hw.peak_flops(precision) * hw.efficiency) + batch * e * (m * k + k * n + m * n) / hw.hbm_bytes_per_s


def elementwise_bytes(shape, tokens: float, tp: int, sequence_parallel: bool, e: int, compiled: bool = False) -> float:
    """HBM bytes one block's forward elementwise work moves, in elements of ``e`` bytes: two norms (read,
    write: 2 each) and two residual adds (read 2, write 1) on the ``[T, d]`` activation (split by ``t``
    under sequence parallelism), the MLP activation on ``[T, d_ff/t]`` (GELU 2; SwiGLU 3: gate and up
    read, their product written). ``compiled`` (``train.compile``, one graph per block): the first residual
    add fuses into the second norm, one kernel that reads the residual and the attention's output and
    writes the norm's output (3; the sum is not written: the last add reads both again, 4), the first
    norm 2: 9 per ``[T, d]`` element instead of 10; the activation as above (one kernel either way). The
    norms' statistics and weights, RoPE and the biases (in the GEMMs) are left out either way."""
    d, f = shape.d_model, shape.d_ff
    sp = tp if sequence_parallel else 1
    norms_residuals = (2 + 3 + 4 if compiled else 2 * 2 + 2 * 3) * tokens * d / sp
    activation = (3 if shape.arch == "llama" else 2) * tokens * f / tp
    return e * (norms_residuals + activation)


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one micro-batch through one block: matmuls, attention core, elementwise."""

    gemm: float
    attention: float
    elementwise: float
    attention_backward: float = 0.0
    column_gemm: float = 0.0  # the column-parallel layers' share of ``gemm`` (q/k/v, MLP in)

    @property
    def forward(self) -> float:
        return self.gemm + self.attention + self.elementwise

    @property
    def backward(self) -> float:
        return 2 * self.gemm + self.attention_backward + 2 * self.elementwise


ATTENTION = ("flash", "unfused")


def fp8_cast_elements(shape, tokens: float, tp: int) -> float:
    """Elements one block's forward casts to fp8 on one TP rank: each linear's input and weight
    (backward casts as many again: the output gradients and the re-cast weights)."""
    d, t, kv = shape.d_model, tp, shape.n_kv_heads * shape.head_dim
    mlp_in = (2 if shape.arch == "llama" else 1) * shape.d_ff
    inputs = tokens * (2 * d + d / t + shape.d_ff / t)  # q/k/v's and MLP in's (shared), o's, MLP out's
    weights = d * (d + 2 * kv + mlp_in + d + shape.d_ff) / t
    return inputs + weights


#: HBM bytes an fp8 cast moves per element: read 2 (bf16), write 1 (the amax pass reads 2 more)
FP8_CAST_BYTES = 5


def layer_time(
    shape,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    hw: Hardware,
    precision: str,
    attention: str = "flash",
    fp8: str | None = None,
    compiled: bool = False,
) -> LayerTime:
    """One block's forward pieces on one TP rank (module docstring); ``fp8`` (a recipe): its four linears'
    GEMMs at :func:`gemm_seconds`'s fp8 rate and their casts (:func:`fp8_cast_elements`) elementwise, compiled
    or not; ``compiled``: its norms and residual adds fused (:func:`elementwise_bytes`)."""
    e = 4 if precision == "fp32" else 2
    T, d, t = micro_batch * shape.seq_len, shape.d_model, tp
    mlp_in = (2 if shape.arch == "llama" else 1) * shape.d_ff
    lin = FP8 if fp8 else precision
    attn_in, attn_out = attention_gemm_seconds(shape, T, t, hw, lin)
    column = attn_in + gemm_seconds(T, d, mlp_in / t, hw, lin)  # MLP in (SwiGLU: gate and up)
    gemm = column + attn_out + gemm_seconds(T, shape.d_ff / t, d, hw, lin)  # attention out, MLP out
    s, heads = shape.seq_len, micro_batch * shape.n_heads / t
    qk, v = ModelShape.of(shape).qk_v_head_dims
    if attention == "flash":  # 2·b·s²·H·(qk + v) FLOPs forward (4·b·s²·d for plain heads), half done (causal)
        flops = 2 * micro_batch * s**2 * shape.n_heads * (qk + v) / t / 2
        attn = flops / (hw.peak_flops(precision) * hw.attention_efficiency)
        attn_bwd = 2.5 * attn
    else:
        bmm = gemm_seconds(s, qk, s, hw, precision, heads) + gemm_seconds(s, s, v, hw, precision, heads)
        scores = heads * s * s * (4 * e + 1) / hw.hbm_bytes_per_s
        attn, attn_bwd = bmm + scores, 2 * bmm + 2.5 * scores
    elementwise = elementwise_bytes(shape, T, t, sequence_parallel, e, compiled) / hw.hbm_bytes_per_s
    if fp8:
        elementwise += FP8_CAST_BYTES * fp8_cast_elements(shape, T, t) / hw.hbm_bytes_per_s
    elementwise += host_costs(hw).block_overhead_us * 1e-6 / 3  # host cost per block: a third forward, two backward
    return LayerTime(gemm, attn, elementwise, attn_bwd, column)


def attention_gemm_seconds(shape, T: float, t: int, hw: Hardware, precision: str) -> tuple[float, float]:
    """(input projections, output projection) seconds of one block's attention for ``T`` tokens on one
    TP rank: q, k, v column-parallel; MLA's down-projections replicated (every TP rank computes them),
    its up-projections column-parallel; the output projection row-parallel."""
    shape = ModelShape.of(shape)
    d, H = shape.d_model, shape.n_heads
    qk, v = shape.qk_v_head_dims
    out = gemm_seconds(T, H * v / t, d, hw, precision)
    if not shape.kv_lora_rank:
        return gemm_seconds(T, d, (H * qk + 2 * shape.n_kv_heads * qk) / t, hw, precision), out
    kv_down, kv_up = shape.kv_lora_rank + shape.qk_rope_head_dim, H * (shape.qk_nope_head_dim + v) / t
    q = (
        gemm_seconds(T, d, shape.q_lora_rank, hw, precision)
        + gemm_seconds(T, shape.q_lora_rank, H * qk / t, hw, precision)
        if shape.q_lora_rank
        else gemm_seconds(T, d, H * qk / t, hw, precision)
    )
    kv = gemm_seconds(T, d, kv_down, hw, precision) + gemm_seconds(T, shape.kv_lora_rank, kv_up, hw, precision)
    return q + kv, out


def head_time(shape, micro_batch: int, tp: int, hw: Hardware, precision: str) -> LayerTime:
    """The head's matmul over this rank's ``V/t`` columns, the cross-entropy's fp32 passes (≈ 12 bytes
    per logit) and the profile's ``microbatch_overhead_us``."""
    T, V = micro_batch * shape.seq_len, shape.padded_vocab(tp) / tp
    gemm = gemm_seconds(T, shape.d_model, V, hw, precision)
    fixed = host_costs(hw).microbatch_overhead_us * 1e-6 / 3  # host cost: a third forward, two backward
    return LayerTime(gemm, 0.0, 12 * T * V / hw.hbm_bytes_per_s + fixed, 0.0)


#: HBM bytes per parameter of an AdamW step on fp32 masters: read and write the master, m and v (24),
#: read the fp32 gradient (4), write the 16-bit copy (2)
ADAMW_BYTES_PER_PARAM = 30


def optimizer_seconds(params_per_rank: float, hw: Hardware) -> float:
    """The optimizer step on this rank's (sharded) parameters: memory-bound."""
    return ADAMW_BYTES_PER_PARAM * params_per_rank / hw.hbm_bytes_per_s


def colocated_factor(hw: Hardware, ranks_on_host: int) -> float:
    """How much slower a busy rank computes with ``ranks_on_host`` ranks of one host busy:
    ``1 + colocated_slowdown · (k − 1)``."""
    return 1.0 + host_costs(hw).colocated_slowdown * max(0, ranks_on_host - 1)


def colocated(hw: Hardware, ranks_on_host: int) -> Hardware:
    """``hw`` as each of ``ranks_on_host`` busy ranks of one host sees it: peak FLOP/s and memory
    bandwidth divided by :func:`colocated_factor`, the host costs multiplied by it (not communication)."""
    f = colocated_factor(hw, ranks_on_host)
    if f == 1.0:
        return hw
    h = hw.host
    return hw.replace(
        peak_tflops_16=hw.peak_tflops_16 / f,
        peak_tflops_32=hw.peak_tflops_32 / f,
        peak_tflops_8=hw.peak_tflops_8 / f,
        hbm_gbps=hw.hbm_gbps / f,
        block_overhead_us=h.block_overhead_us * f,
        microbatch_overhead_us=h.microbatch_overhead_us * f,
        step_overhead_us=h.step_overhead_us * f,
    )


def step_overhead_seconds(hw: Hardware) -> float:
    """The step's fixed host cost beyond its work (``HostCosts.step_overhead_us``): once per step."""
    return host_costs(hw).step_overhead_us * 1e-6
