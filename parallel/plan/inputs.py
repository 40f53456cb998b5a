"""What the planner is asked about (the resolved layout and the training settings), checked up front,
and :class:`Setup`, what pricing a step reads of them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..dims import LayoutError, ParallelDims, interleaved_problem, topk_ratio_problem, world_size_mismatch
from ..memory import CHECKPOINTING
from ..pipeline.transfers import transfer_split
from ..precision import FP8_RECIPES
from ..zero.compression import COMPRESSIONS
from ..zero.policy import ZERO_STAGES
from . import memory as M
from . import moe as MoE
from .compute import ATTENTION, colocated
from .cp import local_shape
from .hardware import Hardware, PlanError
from .result import ParamCounter
from .shape import ModelShape

#: the planner prices the resolved layout itself; its model facts may be left out (:func:`resolve`)
Layout = ParallelDims


@dataclass(frozen=True)
class Training:
    global_batch: int
    micro_batch: int
    precision: str = "bf16"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    comm_dtype: str | None = None  # gradient collectives; default fp32 (parallel.zero.theory.grad_comm_dtype)
    overlap: bool = True
    topk_ratio: float = 0.01  # Top-K's share, when the layout's compression is topk
    bucket_mb: float = 25.0
    attention: str = "flash"  # flash (the engine's SDPA) | unfused (scores materialised; plan.compute)
    grad_clip: float = 1.0  # train.grad_clip (0: off); clipping computes the norm on every step, read or not
    fp8: str | None = None  # train.precision=fp8: the blocks' linears' recipe (tensorwise | rowwise); precision bf16
    compiled: bool = False  # train.compile through AOT autograd (inductor, aot_eager): blocks and loss as compiled


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlanError(f"{name} must be a positive integer, got {v!r}")
    return v


def _refuse(problem: str | None) -> None:
    """Raise the one home's message (parallel.dims) as the planner's error."""
    if problem:
        raise PlanError(problem)


def resolve(shape, layout: ParallelDims | None = None, **fields) -> ParallelDims:
    """``layout`` (or a layout of ``fields``; both: ``layout`` with ``fields`` changed) with the model
    facts of ``shape`` (any object with a ``ModelConfig``'s fields), so that every rule of
    :class:`~parallel.dims.ParallelDims` is checked; a refusal is a :class:`PlanError` in the rule's words."""
    facts = {k: getattr(shape, k) for k in ("seq_len", "n_heads", "n_kv_heads", "n_layers", "d_ff")}
    facts["moe_experts"] = getattr(shape, "moe_experts", 0)
    try:
        return ParallelDims(**{**(dataclasses.asdict(layout) if layout else {}), **fields, **facts})
    except LayoutError as e:
        raise PlanError(str(e)) from None


def check(shape, layout: ParallelDims, training: Training, world_size: int | None = None) -> tuple[ParallelDims, int]:
    """Refuse what cannot run, naming the numbers; return the layout resolved for ``shape``
    (:func:`resolve`) and the micro-batches per step per DP rank."""
    _positive("global_batch", training.global_batch)
    _positive("micro_batch", training.micro_batch)
    if world_size is not None and world_size != layout.world_size:
        raise PlanError(world_size_mismatch(world_size, layout.dp, layout.pp, layout.tp, layout.cp))
    dims = resolve(shape, layout)
    MoE.check_ep(MoE.moe_shape(shape), dims.dp, dims.ep, dims.sp_enabled, dims.cp)
    if dims.zero not in ZERO_STAGES:
        raise PlanError(f"zero={dims.zero!r} not in {ZERO_STAGES}")
    if shape.arch not in ("gpt", "llama"):
        raise PlanError(f"arch {shape.arch!r} not in ('gpt', 'llama')")
    if training.checkpointing not in CHECKPOINTING:
        raise PlanError(f"activation checkpointing {training.checkpointing!r} not in {CHECKPOINTING}")
    if training.precision not in M.PRECISION_BYTES:
        raise PlanError(f"precision {training.precision!r} not in {sorted(M.PRECISION_BYTES)}")
    if training.fp8 is not None and (training.fp8 not in FP8_RECIPES or training.precision != "bf16"):
        raise PlanError(
            f"fp8={training.fp8!r} with precision {training.precision!r}: fp8 is a bf16 run whose linears use one "
            f"of {FP8_RECIPES}; pass precision='bf16'"
        )
    if not training.grad_clip >= 0 or training.grad_clip == float("inf"):
        raise PlanError(f"grad_clip must be a finite number ≥ 0 (0 disables clipping), got {training.grad_clip!r}")
    if training.attention not in ATTENTION:
        raise PlanError(f"attention {training.attention!r} not in {ATTENTION}")
    if dims.compression not in COMPRESSIONS:
        raise PlanError(f"compression {dims.compression!r} not in {COMPRESSIONS}")
    if dims.compression_enabled:
        _refuse(topk_ratio_problem(training.topk_ratio))
    per_step = training.micro_batch * dims.dp
    if training.global_batch % per_step:
        lo = max(1, training.global_batch // per_step) * per_step
        raise PlanError(
            f"global_batch {training.global_batch} is not a multiple of micro_batch "
            f"{training.micro_batch} × dp {dims.dp} = {per_step}; use {lo} or {lo + per_step}"
        )
    _refuse(interleaved_problem(dims.schedule, dims.pp, training.global_batch, training.micro_batch, dims.dp))
    return dims, training.global_batch // per_step


class Setup:
    """What pricing a step reads: the checked inputs, and what follows from them."""

    def __init__(self, shape, layout: ParallelDims, tr: Training, hw: Hardware, count: ParamCounter, world_size=None):
        self.dims, self.m = check(shape, layout, tr, world_size)  # the resolved layout; micro-batches per step
        dims = self.dims
        self.moe = MoE.moe_shape(shape)  # MoE models: experts over ep, all-to-all, active FLOPs (plan/moe.py)
        self.shape = ModelShape.of(shape)
        self.local = local_shape(self.shape, dims.cp)  # what one cp rank holds of each sample (plan/cp.py)
        self.tr, self.hw, self.count = tr, hw, count
        self.colocated = min(dims.world_size, hw.gpus_per_node)  # ranks one host runs at once
        self.work_hw = colocated(hw, self.colocated)  # compute as a rank sees it, its host's others busy
        self.zdp = dims.group_size(dims.dense_grad_group)  # ranks the dense parameters' ZeRO shards span
        self.edp = dims.group_size(dims.expert_grad_group)  # ranks the experts' ZeRO shards span
        self.e = M.PRECISION_BYTES[tr.precision]  # parameter bytes
        self.c = M.comm_bytes(tr.precision, tr.comm_dtype)  # gradient bytes on the wire
        self.act_msg = float(self.e * math.prod(dims.activation_shape(tr.micro_batch, self.shape.d_model)))
        # TP shares of a pipeline transfer (scatter-gather without SP): 1/split over PP, one TP all-gather
        self.transfer_split = transfer_split(dims.tp, dims.sp_enabled)
        self.bucket = tr.bucket_mb * 2**20  # bucket bytes
        self.peak_flops = self.work_hw.peak_flops(tr.precision) * self.work_hw.efficiency  # large GEMMs (cp's ring)
