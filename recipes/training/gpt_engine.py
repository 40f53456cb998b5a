"""The GPT of a recipe as a :class:`~parallel.engine.StepEngine`: this rank's chunks, the
optimizer, the schedule and the ZeRO settings, all read from the config."""

from __future__ import annotations

import torch

from models.compiled import compile_stage
from models.transformer import build_model
from parallel.engine import StepEngine
from parallel.groups import ParallelGroups
from parallel.layers.moe import MoELayer
from parallel.pipeline.partition import stage_chunks
from parallel.pipeline.schedules import build_schedule
from parallel.plan.shape import ModelShape, layer_partition
from parallel.precision import base_precision
from parallel.zero import ZeroConfig

from ..config import Layout, RecipeConfig

#: device types with a fused AdamW kernel (on CPU 7× faster than foreach at 3.3 M parameters, torch 2.13)
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def optimizer_factory(rc: RecipeConfig, device: torch.device):
    """``factory(param_groups)`` building ``rc.optim``'s optimizer: fused AdamW where torch has the
    kernel (CUDA and, since torch 2.4, CPU; on the dry run's ``meta`` tensors the same kernel, as a GPU
    rank steps: :func:`_fused_on_meta`), foreach elsewhere."""
    o = rc.optim
    # one kernel for all tensors (None: foreach). Offloaded, the optimizer steps host shards: torch's
    # fused CPU AdamW (vectorised, multi-threaded), which FUSED_ADAMW_DEVICES includes
    fused = True if device.type in FUSED_ADAMW_DEVICES else None

    def factory(param_groups):
        if o.name == "sgd":
            return torch.optim.SGD(param_groups, lr=o.lr, weight_decay=o.weight_decay)
        opt = torch.optim.AdamW(
            param_groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=fused
        )
        # offloaded, the step is the host's (its state outside the dry run's device memory: zero/offload.py)
        return _fused_on_meta(opt) if device.type == "meta" and rc.parallel.offload == "none" else opt

    return factory


def _fused_on_meta(opt: torch.optim.AdamW) -> torch.optim.AdamW:
    """The dry run's AdamW steps with the fused kernel a GPU rank runs (``torch._fused_adamw_`` has a
    meta implementation that allocates nothing), not foreach's, whose temporaries (a square root and a
    quotient per parameter) a CUDA step never holds. torch's constructor and its first step refuse
    ``meta`` for ``fused``, so the groups are switched after construction and each parameter's state is
    created here as that first step would: the two moments zeroed like the parameter, and ``step`` an
    fp32 scalar — on the host, which the fused kernel accepts, so it counts real steps (a GPU rank keeps
    it on the device: 4 bytes per parameter tensor, not priced)."""
    opt._step_supports_amp_scaling = True  # as torch's constructor sets it for fused: the on-device skip path
    for group in opt.param_groups:
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
    return opt


def zero_config(rc: RecipeConfig) -> ZeroConfig:
    """ZeRO's settings from ``rc`` (the GPT's engine and a ``model.target`` model's alike)."""
    p, t, cm = rc.parallel, rc.train, rc.comm
    return ZeroConfig(
        stage=p.zero,
        precision=base_precision(t.precision),  # fp8 keeps bf16 parameters (parallel.precision)
        comm_dtype=cm.dtype,
        bucket_mb=cm.bucket_mb,
        overlap=cm.overlap,
        grad_clip=t.grad_clip or None,
        compression=cm.compression,
        topk_ratio=cm.topk_ratio,
        offload=p.offload,
        accumulate=p.zero_accumulate,
    )


def build_gpt_engine(
    rc: RecipeConfig, layout: Layout, g: ParallelGroups, device: torch.device, dtype: torch.dtype
) -> tuple[list[range], StepEngine]:
    """The layer split (the planner's, so its per-stage predictions describe this very run)
    and this rank's GPT chunks in a step engine."""
    p, mc, t, dims = rc.parallel, layout.model, rc.train, layout.dims
    ranges = layer_partition(ModelShape.of(mc), p.pp, p.vpp, p.pp_layers)
    chunks = [
        build_model(
            mc,
            tp_group=g.tp,
            sequence_parallel=p.sequence_parallel,
            layers=layers,
            has_embedding=c * p.pp + g.pp_rank == 0,
            has_head=c * p.pp + g.pp_rank == len(ranges) - 1,
            cp_group=g.cp,
            cp_impl=p.cp_impl,
            device=device,
            dtype=torch.float32,
            seed=t.seed,
            ep_group=g.ep,
        )
        for c, layers in enumerate(stage_chunks(ranges, p.pp, g.pp_rank))
    ]
    if t.compile:  # before the engine takes the loss and ZeRO its hooks: they stay outside the graphs
        for chunk in chunks:
            compile_stage(chunk, t.compile_backend)
    zero = zero_config(rc)
    engine = StepEngine(
        chunks,
        build_schedule(p.pp_schedule, p.pp, layout.grad_accum, p.vpp)[g.pp_rank],
        loss_fn=chunks[-1].loss,  # used on the last virtual stage only, which holds the head
        zero=zero,
        optimizer_factory=optimizer_factory(rc, device),
        dp_group=getattr(g, dims.dense_grad_group),  # averaged over dp × cp: the mean over all tokens
        pp_group=g.pp,
        tp_group=g.tp,
        embedding_group=g.embedding,
        clip_groups=[g.pp],
        expert_group=getattr(g, dims.expert_grad_group),  # the ranks holding the same experts (dp/ep × cp)
        ep_group=g.ep,
        units=[b for ch in chunks for b in ch.blocks.values()],
        activation_shape=dims.activation_shape(layout.micro_batch, mc.d_model),  # cp's and SP's local slice
        compute_dtype=dtype,
        sequence_parallel=dims.sp_enabled,
    )
    for m in (m for ch in chunks for m in ch.modules() if isinstance(m, MoELayer)):
        m.aux_loss_scale = 1 / layout.grad_accum  # like the main loss: the mean over the step's micro-batches
    return ranges, engine
