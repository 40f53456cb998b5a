"""Bytes one rank holds: model states (:func:`parallel.zero.theory.model_state_bytes` on this rank's
parameters, padded as ZeRO's buckets pad them) and activations per layer and micro-batch, in the style
of Korthikanti et al. 2022 for this code base (no dropout; flash attention keeps a fp32 log-sum-exp,
not the scores). With s, b, h = d_model, k = kv width, f = d_ff, a = heads, e = compute-dtype bytes,
t = tp and t' = t with sequence parallelism (else 1), one layer saves:

=====================  ===============================================================
piece                  bytes
=====================  ===============================================================
norms (×2)             LayerNorm: input e·sbh/t' + fp32 mean, rstd 8·sb/t';
                       RMSNorm (fp32 math): fp32 input 4·sbh/t' + normalised e·sbh/t' + 4·sb/t',
                       compiled: input e·sbh/t' + 4·sb/t'
q/k/v, fc_in input     e·sbh/t' each (with SP the sequence chunk, gathered again in backward)
q, k, v, attention out e·sb(2h + 2k)/t, plus the fp32 log-sum-exp 4·b·a·s/t (MLA:
                       :func:`attention_activation_bytes`); compiled ``selective``: less the
                       output e·sb·H·v/t (o's input; H·v = h but for MLA)
MLP                    GELU: 2·e·sbf/t (its input and output); SwiGLU: 4·e·sbf/t, compiled 3·e·sbf/t
=====================  ===============================================================

``selective`` recomputes the attention core (its log-sum-exp is not stored); ``full`` stores only
each block's input (e·sbh/t') and, while one layer's backward runs, that layer's full activations.
On top, while one block's backward runs, its workspace (:func:`backward_workspace_bytes`: weight and
input gradients, sequence parallelism's re-gathered input), less what that backward has freed. A
pipeline chunk's output (e·sbh/t', the message it sends) is held per micro-batch until its backward
(:class:`parallel.pipeline.executor.PipelineExecutor` keeps it, :mod:`.stage` counts it).

``compiled`` (``train.compile``, :mod:`parallel.compile`): a block is one autograd node whose saved
tensors AOT autograd's partitioner picks (inductor's min-cut; ``aot_eager`` the same, and one of RoPE's tables).
It keeps what eager keeps except what it recomputes from a kept tensor in backward: RMSNorm its
input (e·sbh/t', not the fp32 copy) and rstd, not the normalised product; SwiGLU gate, up and their
product (3·e·sbf/t), not silu(gate); under ``selective`` q, k, v but not the core's output (the core
runs again in backward and o's weight gradient reads it); MLA's latent norms as RMSNorm
(:func:`.mla.mla_activation_bytes`). LayerNorm and GELU keep what eager keeps.
At tp = 1 the compiled loss keeps the logits (e·sbV) and two fp32 row statistics, not torch's fp32
log-softmax; the vocabulary-parallel one (tp > 1) keeps its fp32 softmax, as eager. The final norm is
eager. An MoE block runs as regions (the attention half as the dense block's, the router, the experts, the
shared experts; dispatch and combine eager): :func:`.moe.activation_bytes`. fp8 compiled as fp8 eager.

``fp8`` (``train.precision=fp8``, :mod:`parallel.layers.fp8_linear`): tensorwise keeps each linear's
input as the fp8 tensor its GEMM read (1 byte: q/k/v's and fc_in's inputs, the attention output's
and the MLP out's inputs), rowwise the bf16 inputs (its
backward re-casts them along the tokens), so it stores what bf16 stores. Weights are re-cast in
backward from the parameters, never stored; a cast's transient peak is :func:`fp8_cast_peak_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import zip_longest

from ..precision import FP8_BYTES
from ..zero import theory as zero_theory
from ..zero.layout import pack, padded
from ..zero.packing import CLASSES, EXTRA_REDUCE
from ..zero.policy import ZERO_STAGES
from .hardware import PlanError
from .mla import mla_activation_bytes
from .shape import ModelShape

PRECISION_BYTES = zero_theory.DTYPE_BYTES  # one home: bytes per element of each precision
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}  # fp32 tensors per parameter


Group = tuple[int, ...]  # per-rank element counts of the parameters of one ZeRO bucket class, in order


@dataclass(frozen=True)
class StageParams:
    """Parameters of one pipeline rank, as counted on the real model: ``numel`` on one TP rank, of them
    ``replicated`` over TP; ``full`` before TP sharding, of it ``tied_copy`` a tied embedding's second copy;
    ``shared_embedding`` the tied weight per TP rank. ``blocks`` (a ZeRO unit each) and ``root`` (the rest):
    per bucket class (:data:`parallel.zero.packing.CLASSES`) the sizes of its parameters, empty when
    unknown. ``expert`` of ``numel`` are MoE expert parameters (at ep = 1), in units ``expert_blocks``."""

    numel: int
    replicated: int = 0
    full: int = 0
    tied_copy: int = 0
    shared_embedding: int = 0
    blocks: tuple[tuple[Group, ...], ...] = ()
    root: tuple[Group, ...] = ((), ())
    expert: int = 0
    expert_blocks: tuple[tuple[Group, ...], ...] = ()

    def __add__(self, other: StageParams) -> StageParams:
        counts = (a + b for a, b in zip(self.counts(), other.counts()))
        root = tuple(a + b for a, b in zip_longest(self.root, other.root, fillvalue=()))
        experts = dict(expert=self.expert + other.expert, expert_blocks=self.expert_blocks + other.expert_blocks)
        return StageParams(*counts, blocks=self.blocks + other.blocks, root=root, **experts)

    def scaled(self, n: int) -> StageParams:
        """``n`` copies of a stage made of blocks only (its root must be empty)."""
        if any(self.root):
            raise ValueError("scaled() repeats blocks; this StageParams has parameters outside blocks")
        experts = dict(expert=self.expert * n, expert_blocks=self.expert_blocks * n)
        return StageParams(*(a * n for a in self.counts()), blocks=self.blocks * n, **experts)

    def counts(self) -> tuple[int, ...]:
        return (self.numel, self.replicated, self.full, self.tied_copy, self.shared_embedding)


@lru_cache(maxsize=4096)  # a search packs the same stages' groups for every layout it prices
def _bucket_sizes(group: Group, bucket_bytes: float, element_size: int) -> tuple[int, ...]:
    return tuple(sum(group[i] for i in bucket) for bucket in pack(group, element_size, bucket_bytes))


@lru_cache(maxsize=4096)  # the middle stages of a pipeline are alike
def zero_bucket_numels(
    params: StageParams, dp: int, bucket_bytes: float, element_size: int, per_unit: bool = True
) -> tuple[tuple[int, ...], ...] | None:
    """The padded elements of each of ZeRO's buckets on this rank, per unit (each block's, then the
    rest's; ``per_unit=False``: one unit), packed as :func:`parallel.zero.layout.plan_buckets` packs
    them (one bucket class at a time, padded to a multiple of ``dp``); None when the classes are unknown."""
    if not params.blocks and not any(params.root):
        return None
    units = params.blocks + (params.root,)
    if not per_unit:  # one unit: each class in the engine's order
        n_classes = max(len(unit) for unit in units)
        units = (tuple(tuple(n for unit in units if c < len(unit) for n in unit[c]) for c in range(n_classes)),)
    return tuple(
        tuple(padded(n, dp) for group in unit for n in _bucket_sizes(group, bucket_bytes, element_size))
        for unit in units
    )


def zero_padded_numel(
    params: StageParams, dp: int, bucket_bytes: float, element_size: int, per_unit: bool = True
) -> int:
    """Elements of ZeRO's flat buffers on this rank, padding included (the whole rank padded when
    the classes are unknown)."""
    numels = zero_bucket_numels(params, dp, bucket_bytes, element_size, per_unit)
    return padded(params.numel, dp) if numels is None else sum(map(sum, numels))


def zero_bucket_counts(
    params: StageParams, bucket_bytes: float, element_size: int, per_unit: bool = True
) -> tuple[int, ...] | None:
    """ZeRO's buckets (each one collective) on this rank per unit, as :func:`zero_bucket_numels`
    packs them; None when the classes are unknown."""
    numels = zero_bucket_numels(params, 1, bucket_bytes, element_size, per_unit)
    return None if numels is None else tuple(map(len, numels))


def zero_extra_reduce_counts(
    params: StageParams, bucket_bytes: float, element_size: int, per_unit: bool = True
) -> dict[str, int]:
    """ZeRO's buckets on this rank whose gradient is also all-reduced over another group (``"tp"``:
    sequence-parallel; ``"embedding"``: a tied embedding), per group: one collective per bucket."""
    units = [u for u in params.blocks + (params.root,) if len(u) == len(CLASSES)]
    if not per_unit:  # one unit: each class packed across units
        units = [tuple(tuple(n for u in units for n in u[c]) for c in range(len(CLASSES)))] if units else []
    out = {extra: 0 for extra in EXTRA_REDUCE if extra}
    for unit in units:
        for (_, extra), group in zip(CLASSES, unit):
            if extra:
                out[extra] += len(_bucket_sizes(group, bucket_bytes, element_size))
    return out


def zero_extra_reduce_numel(
    params: StageParams, dp: int, bucket_bytes: float, element_size: int, per_unit: bool = True, extra: str = "tp"
) -> int:
    """Elements of the buckets :func:`zero_extra_reduce_counts` counts for group ``extra``, each padded to a
    multiple of ``dp`` as ZeRO pads it (:func:`zero_bucket_numels`); the engine all-reduces their fp32 gradient
    (the ``1/dp`` shard once the optimizer is sharded). Classes unknown: the TP-replicated (``"tp"``) or tied
    embedding parameters, padded as one."""
    units = [u for u in params.blocks + (params.root,) if len(u) == len(CLASSES)]
    if not units:
        return padded(params.replicated if extra == "tp" else params.shared_embedding, dp)
    if not per_unit:
        units = [tuple(tuple(n for u in units for n in u[c]) for c in range(len(CLASSES)))]
    return sum(
        padded(n, dp)
        for unit in units
        for (_, cls), group in zip(CLASSES, unit)
        if cls == extra
        for n in _bucket_sizes(group, bucket_bytes, element_size)
    )


def comm_bytes(precision: str, comm_dtype: str | None) -> int:
    """Bytes per element of the gradient collectives (``comm.dtype``, default fp32)."""
    return PRECISION_BYTES[zero_theory.grad_comm_dtype(comm_dtype)]


def model_state_bytes(
    psi: int, zero: int, dp: int, precision: str = "bf16", optimizer: str = "adamw", offload: str = "none"
) -> dict:
    """Parameters, gradients, optimizer state one rank holds between steps (``total`` on the device,
    ``host`` what ``offload`` keeps in host memory); ``psi`` is padded to a multiple of ``dp`` first."""
    if zero not in ZERO_STAGES:
        raise PlanError(f"ZeRO stage {zero!r} not in {ZERO_STAGES}")
    if precision not in PRECISION_BYTES:
        raise PlanError(f"precision {precision!r} not in {sorted(PRECISION_BYTES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise PlanError(f"optimizer {optimizer!r} not in {sorted(OPTIMIZER_STATES)}")
    theory = zero_theory.model_state_bytes(
        padded(psi, dp), zero, dp, PRECISION_BYTES[precision], OPTIMIZER_STATES[optimizer], offload=offload
    )
    return {k: int(v) for k, v in theory.items()}  # exact: the padded count divides by dp


def norm_bytes(arch: str, sbh: float, sb: float, e: int, compiled: bool = False) -> float:
    """What one norm over ``sb`` tokens of width ``h`` saves (module table; ``sbh`` = sb·h)."""
    if arch == "llama":  # eager: fp32 input copy, normalised output, rstd; compiled: the input, rstd
        return (e if compiled else 4 + e) * sbh + 4 * sb
    return e * sbh + 8 * sb  # input, fp32 mean and rstd


def attention_activation_bytes(
    shape, sb: float, tp: int, e: int, checkpointing: str = "none", sp: int = 1, compiled: bool = False
) -> float:
    """What one layer's attention saves for ``sb`` tokens on one TP rank (a fused attention kernel,
    whose output is ``o_proj``'s input): q, k, v and the output (``H·qk, K·qk, K·v, H·v`` wide, split
    over tp); MLA's (``kv_lora_rank > 0``): :func:`.mla.mla_activation_bytes` (``sp``, ``compiled``)."""
    shape = ModelShape.of(shape)
    if shape.kv_lora_rank:
        return mla_activation_bytes(shape, sb, tp, e, checkpointing, sp, compiled)
    qk, v = shape.qk_v_head_dims
    return e * sb * (shape.n_heads + shape.n_kv_heads) * (qk + v) / tp


def layer_activation_bytes(
    shape,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    checkpointing: str = "none",
    precision: str = "bf16",
    fp8: str | None = None,
    compiled: bool = False,
) -> float:
    """Bytes one transformer layer stores per micro-batch on one TP rank (module table; ``fp8`` the
    recipe of ``train.precision=fp8``, its inputs 1 byte at tensorwise; ``compiled``: the block compiled)."""
    e = PRECISION_BYTES[precision]
    x8 = FP8_BYTES if fp8 == "tensorwise" else None
    s, b, h = shape.seq_len, micro_batch, shape.d_model
    sp = tp if sequence_parallel else 1
    sbh, sb = s * b * h, s * b
    if checkpointing == "full":
        return e * sbh / sp
    norms = 2 * norm_bytes(shape.arch, sbh, sb, e, compiled) / sp
    linear_inputs = 2 * (x8 or e) * sbh / sp
    attention = attention_activation_bytes(shape, sb, tp, e, checkpointing, sp, compiled)
    o_input = sb * shape.n_heads * ModelShape.of(shape).qk_v_head_dims[1] / tp
    if x8:  # o's input in fp8
        attention -= (e - x8) * o_input
    if compiled and checkpointing == "selective":
        attention -= (x8 or e) * o_input  # o's input: the core runs again in backward
    lse = 4 * b * shape.n_heads * s / tp if checkpointing == "none" else 0.0
    return norms + linear_inputs + attention + lse + _mlp_bytes(shape, sb, tp, e, x8, compiled)


def mlp_activation_bytes(arch: str, rows: float, width: float, e: int, compiled: bool = False) -> float:
    """What one MLP of hidden ``width`` saves over ``rows`` tokens (its input aside): GELU its input and
    output; SwiGLU gate, up, their product and, not ``compiled``, the activation ``silu(gate)``."""
    return (2 if arch != "llama" else 3 if compiled else 4) * e * rows * width


def _mlp_bytes(shape, sb: float, tp: int, e: int, x8: int | None = None, compiled: bool = False) -> float:
    """The dense MLP's saved activations (:func:`mlp_activation_bytes`), the MLP out's input in fp8 when ``x8``."""
    mlp = mlp_activation_bytes(shape.arch, sb, shape.d_ff / tp, e, compiled)
    return mlp - (e - x8) * sb * shape.d_ff / tp if x8 else mlp


def backward_workspace_bytes(
    shape,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "bf16",
    fp8: str | None = None,
    compiled: bool = False,
) -> float:
    """The transient peak of one block's backward above what the block stores, on one TP rank.

    A column-parallel layer's backward (:mod:`parallel.layers.linear`) of output width ``W`` per rank
    holds at its weight-gradient GEMM: the incoming gradients ``e·sbW``, the weight gradients
    ``e·hW`` (until the ZeRO hook adds them into the fp32 buffer), the full-sequence input gradient
    ``e·sbh``; with sequence parallelism also the re-gathered input twice (the gather's buffer and its
    concatenation), the stacked input gradient the reduce-scatter reads (``3·e·sbh``) and its chunk
    ``e·sbh/t``. The layers after it have run their backward, so their saved tensors are freed: for the
    MLP's input layer (``W`` = d_ff/t, SwiGLU 2·d_ff/t) the MLP's activations, for q/k/v
    (``W = (H·qk + K·(qk + v))/t``) the MLP's and the attention core's (flash: ``dq, dk, dv`` are the
    incoming gradients; an unfused kernel's scores are not priced). The peak is the larger of the two.
    The same for every recomputation mode: under ``full`` it comes on top of the recomputed layer's
    activations (:func:`recompute_peak_bytes`), whose MLP and attention pieces are the ones freed.
    MoE layers are priced as dense ones here; a ``compiled`` block as eager, less its MLP's smaller saving."""
    shape = ModelShape.of(shape)
    e = PRECISION_BYTES[precision]
    x8 = FP8_BYTES if fp8 == "tensorwise" else None
    sb, h = shape.seq_len * micro_batch, shape.d_model
    gathers = 3 * e * sb * h + e * sb * h / tp if sequence_parallel and tp > 1 else 0.0

    def column(width: float) -> float:
        return e * sb * width + e * h * width + e * sb * h + gathers

    qk, v = shape.qk_v_head_dims
    mlp_saved = _mlp_bytes(shape, sb, tp, e, x8, compiled)
    mlp = column((2 if shape.arch == "llama" else 1) * shape.d_ff / tp) - mlp_saved
    qkv = column((shape.n_heads * qk + shape.n_kv_heads * (qk + v)) / tp)
    attention = qkv - mlp_saved - attention_activation_bytes(shape, sb, tp, e)
    return max(mlp, attention, 0.0)


def fp8_cast_peak_bytes(shape, micro_batch: int, *, tp: int = 1) -> float:
    """The largest transient of one fp8 cast (``x.float() · scale``, clamped, then fp8: 4 + 4 + 1 bytes
    per element) over a block's operands on one TP rank: its largest weight or GEMM input/output."""
    s, b, h, f = shape.seq_len, micro_batch, shape.d_model, shape.d_ff
    mlp_in = (2 if shape.arch == "llama" else 1) * f
    return 9 * max(h * mlp_in / tp, s * b * max(h, f / tp))


def head_activation_bytes(
    shape,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "bf16",
    compiled: bool = False,
) -> float:
    """The last stage's extra: final norm, the head's input (with SP its sequence chunk), the
    fp32 softmax over this rank's ``V/t`` vocabulary columns that the cross-entropy keeps; a ``compiled``
    loss at tp = 1 the logits and two fp32 statistics per token instead (module table)."""
    e = PRECISION_BYTES[precision]
    s, b, h = shape.seq_len, micro_batch, shape.d_model
    sp = tp if sequence_parallel else 1
    loss = loss_stored_bytes(shape, micro_batch, tp=tp, precision=precision, compiled=compiled)
    return (norm_bytes(shape.arch, s * b * h, s * b, e) + e * s * b * h) / sp + loss


def loss_stored_bytes(
    shape, micro_batch: int, *, tp: int = 1, precision: str = "bf16", compiled: bool = False
) -> float:
    """What the cross-entropy keeps for backward over this rank's ``V/t`` columns: the fp32 softmax, or
    a ``compiled`` loss at tp = 1 the logits and two fp32 statistics per token (module table)."""
    sb, vocab = shape.seq_len * micro_batch, shape.padded_vocab(tp)
    return PRECISION_BYTES[precision] * sb * vocab + 8 * sb if compiled and tp == 1 else 4 * sb * vocab / tp


def loss_temporary_bytes(shape, micro_batch: int, *, tp: int = 1, precision: str = "bf16") -> float:
    """The last stage's transient peak in the loss over the ``N = b·s·V/t`` logits, above what it
    stores: ``(e + 4)·N`` at tp > 1 (the vocabulary-parallel cross-entropy's forward), else PyTorch's
    fused cross-entropy's backward ``8·N`` (or its forward's fp32 copy, when larger)."""
    e = PRECISION_BYTES[precision]
    vocab = shape.padded_vocab(tp)
    n = micro_batch * shape.seq_len * vocab / tp
    return (e + 4 if tp > 1 else max(e + 4 * (e != 4), 8)) * n


def embedding_activation_bytes(shape, micro_batch: int) -> float:
    """The first stage's extra: the int64 token ids the embedding's backward reads."""
    return 8 * shape.seq_len * micro_batch


def stage_activation_bytes(
    shape,
    micro_batch: int,
    n_layers: int,
    *,
    has_embedding: bool,
    has_head: bool,
    tp: int = 1,
    sequence_parallel: bool = False,
    checkpointing: str = "none",
    precision: str = "bf16",
    fp8: str | None = None,
    compiled: bool = False,
) -> float:
    """What one micro-batch leaves stored on a chunk of ``n_layers`` layers until its backward."""
    kw = dict(tp=tp, sequence_parallel=sequence_parallel, precision=precision, compiled=compiled)
    layer = layer_activation_bytes(shape, micro_batch, checkpointing=checkpointing, fp8=fp8, **kw)
    total = n_layers * layer
    if has_head:
        total += head_activation_bytes(shape, micro_batch, **kw)
    if has_embedding:
        total += embedding_activation_bytes(shape, micro_batch)
    return total


def recompute_peak_bytes(shape, micro_batch: int, *, checkpointing: str, **kw) -> float:
    """Transient bytes of one layer's recomputation during backward (``full`` only)."""
    if checkpointing != "full":
        return 0.0
    return layer_activation_bytes(shape, micro_batch, checkpointing="none", **kw)
