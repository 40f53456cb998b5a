"""What the planner is asked about: the layout and the training settings, checked up front."""

from __future__ import annotations

from dataclasses import dataclass

from ..dims import (
    compression_problem,
    interleaved_problem,
    sequence_parallel_problem,
    sequence_split_problem,
    stages_problem,
    topk_ratio_problem,
)
from ..memory import CHECKPOINTING
from ..pipeline.schedules import schedule_problem
from ..topology import world_size_mismatch
from ..zero.layout import ZeroConfigError
from ..zero.offload import check_offload
from . import memory as M
from .compute import ATTENTION
from .cp import check_cp
from .hardware import PlanError
from .shape import ModelShape


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    pp_layers: tuple[int, ...] | None = None
    cp: int = 1  # context parallel ranks per sequence (parallel/plan/cp.py)
    cp_impl: str = "ring"
    offload: str = "none"  # none | optimizer | optimizer+params (parallel/zero/offload.py)
    ep: int = 1  # expert parallel ranks inside dp (MoE models; parallel/plan/moe.py)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp


@dataclass(frozen=True)
class Training:
    global_batch: int
    micro_batch: int
    precision: str = "bf16"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    comm_dtype: str | None = None  # gradient collectives; default fp32 (parallel.zero.theory.grad_comm_dtype)
    overlap: bool = True
    compression: str = "none"  # none | topk
    topk_ratio: float = 0.01
    bucket_mb: float = 25.0
    attention: str = "flash"  # flash (the engine's SDPA) | unfused (scores materialised; plan.compute)
    zero_accumulate: str = "sharded"  # parallel.zero.theory.ZERO_ACCUMULATE (stages 2-3)
    grad_clip: float = 1.0  # train.grad_clip (0: off); clipping computes the norm on every step, read or not


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlanError(f"{name} must be a positive integer, got {v!r}")
    return v


def _refuse(problem: str | None) -> None:
    """Raise the one home's message (parallel.dims) as the planner's error."""
    if problem:
        raise PlanError(problem)


def check(shape: ModelShape, layout: Layout, training: Training, world_size: int | None = None) -> int:
    """Refuse what cannot run, naming the numbers; return the micro-batches per step per DP rank."""
    for name in ("dp", "pp", "tp", "vpp"):
        _positive(f"layout.{name}", getattr(layout, name))
    _positive("global_batch", training.global_batch)
    _positive("micro_batch", training.micro_batch)
    if world_size is not None and world_size != layout.world_size:
        raise PlanError(world_size_mismatch(world_size, layout.dp, layout.pp, layout.tp, layout.cp))
    shape.check_tp(layout.tp)
    check_cp(shape, layout.cp, layout.tp, layout.cp_impl)
    _refuse(stages_problem(layout.pp, layout.vpp, shape.n_layers))
    if layout.zero not in M.ZERO_STAGES:
        raise PlanError(f"zero={layout.zero!r} not in {M.ZERO_STAGES}")
    try:
        check_offload(layout.offload, layout.zero)  # the library's rule
    except ZeroConfigError as e:
        raise PlanError(str(e)) from None
    problem = schedule_problem(layout.schedule, layout.pp, layout.vpp)  # the library's rule
    if problem:
        raise PlanError(problem)
    if shape.arch not in ("gpt", "llama"):
        raise PlanError(f"arch {shape.arch!r} not in ('gpt', 'llama')")
    if training.checkpointing not in CHECKPOINTING:
        raise PlanError(f"activation checkpointing {training.checkpointing!r} not in {CHECKPOINTING}")
    if training.precision not in M.PRECISION_BYTES:
        raise PlanError(f"precision {training.precision!r} not in {sorted(M.PRECISION_BYTES)}")
    if layout.sequence_parallel:
        _refuse(sequence_parallel_problem(layout.tp) or sequence_split_problem(shape.seq_len, layout.tp, layout.cp))
    if not training.grad_clip >= 0 or training.grad_clip == float("inf"):
        raise PlanError(f"grad_clip must be a finite number ≥ 0 (0 disables clipping), got {training.grad_clip!r}")
    if training.attention not in ATTENTION:
        raise PlanError(f"attention {training.attention!r} not in {ATTENTION}")
    if training.compression not in ("none", "topk"):
        raise PlanError(f"compression {training.compression!r} not in ('none', 'topk')")
    _refuse(compression_problem(training.compression, layout.zero))
    if training.compression == "topk":
        _refuse(topk_ratio_problem(training.topk_ratio))
    per_step = training.micro_batch * layout.dp
    if training.global_batch % per_step:
        lo = max(1, training.global_batch // per_step) * per_step
        raise PlanError(
            f"global_batch {training.global_batch} is not a multiple of micro_batch "
            f"{training.micro_batch} × dp {layout.dp} = {per_step}; use {lo} or {lo + per_step}"
        )
    m = training.global_batch // per_step
    _refuse(interleaved_problem(layout.schedule, layout.pp, training.global_batch, training.micro_batch, layout.dp))
    return m
