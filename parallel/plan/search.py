"""``mode=recommend``: the layouts that fit a device count, ranked by predicted throughput.

Searched: tp among the divisors of the heads that fit inside a node (docs/architecture.md:
TP stays inside a node), pp among the divisors of the rest up to the layer
count, dp the remainder, ZeRO 0–3, micro-batches, checkpointing; sequence
parallelism whenever tp > 1; context parallelism (cp, inside the node beside tp) where each
rank keeps at least 1,024 tokens (:func:`parallel.plan.cp.cp_choices`); for MoE models, ep among the
divisors of dp that divide the experts (:func:`parallel.plan.moe.ep_choices`; no sequence parallelism:
MoE layers refuse it). Every candidate is planned in
full (the schedules' closed forms make a plan cost microseconds in the pipeline, whatever its size).
"""

from __future__ import annotations

import dataclasses

from ..dims import compression_problem, sequence_split_problem
from ..zero.offload import MIN_STAGE as OFFLOAD_MIN_STAGE
from ..zero.offload import OFFLOAD_MODES
from .cp import cp_choices
from .hardware import Hardware, PlanError
from .inputs import Layout, Training
from .moe import cp_routes, ep_choices, moe_shape
from .planner import plan_layout
from .result import ParamCounter, Plan
from .shape import ModelShape


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    shape: ModelShape, world_size: int, hw: Hardware, zeros=(0, 1, 2, 3), offload: str = "none"
) -> list[Layout]:
    """Every (dp, pp, tp, zero) the search considers for ``world_size`` devices (with ``offload``:
    the stages that can carry it, dp = 1 included: the offloaded shard is then the whole); an MoE
    model (a config with ``moe_experts``) also every ep of :func:`~parallel.plan.moe.ep_choices`."""
    moe = moe_shape(shape)
    shape = ModelShape.of(shape)
    out = []
    for tp in _divisors(min(hw.gpus_per_node, world_size)):
        if hw.gpus_per_node % tp or world_size % tp or shape.n_heads % tp or shape.n_kv_heads % tp or shape.d_ff % tp:
            continue
        cps = cp_choices(shape, world_size, tp, hw.gpus_per_node) if cp_routes(moe) else [1]
        for cp in cps:  # long sequences: context parallel too (MoE: dropless only, moe.cp_routes)
            sp = tp > 1 and not sequence_split_problem(shape.seq_len, tp, cp) and moe is None
            for pp in _divisors(world_size // (tp * cp)):
                if pp > shape.n_layers:
                    break
                dp = world_size // (tp * cp * pp)
                for zero in zeros:
                    if (dp * cp == 1 and zero and offload == "none") or zero < OFFLOAD_MIN_STAGE[offload]:
                        continue
                    for ep in ep_choices(moe, dp):
                        out.append(
                            Layout(dp=dp, pp=pp, tp=tp, sequence_parallel=sp, zero=zero, cp=cp, offload=offload, ep=ep)
                        )
    return out


def recommend(
    shape,
    world_size: int,
    training: Training,
    hw: Hardware,
    count_params: ParamCounter,
    *,
    top: int = 5,
    micro_batches=(1, 2, 4, 8),
    checkpointing=("none", "selective", "full"),
    zeros=(0, 1, 2, 3),
) -> list[Plan]:
    """The ``top`` fitting plans, fastest first, the leaner of equally fast ones first (``training.micro_batch`` and
    ``checkpointing`` are searched; the global batch and the rest are kept)."""
    if world_size < 1:
        raise PlanError(f"world size must be positive, got {world_size}")
    rough: list[tuple[float, Layout, Training]] = []
    for offload in OFFLOAD_MODES:  # offload only when nothing fits on the devices alone
        if not rough:
            rough = _fitting(
                shape, world_size, training, hw, count_params, micro_batches, checkpointing, zeros, offload
            )
    if not rough:
        raise PlanError(
            f"no layout of {world_size} × {hw.name} fits this model at global batch "
            f"{training.global_batch}, even with ZeRO-Offload; add devices or choose a larger device profile"
        )
    rough.sort(key=lambda x: -x[0])
    exact = [plan_layout(shape, lay, tr, hw, count_params) for _, lay, tr in rough[: 3 * top]]  # shape: MoE too
    exact = [p for p in exact if p.fits]
    exact.sort(key=lambda p: (-round(p.step["tokens_per_s"], 6), p.peak_memory))  # ties: less memory first
    return exact[:top]


def _fitting(shape, world_size, training, hw, count_params, micro_batches, checkpointing, zeros, offload):
    """(rough tokens/s, layout, training) of every candidate with ``offload`` that fits."""
    rough: list[tuple[float, Layout, Training]] = []
    for layout in candidate_layouts(shape, world_size, hw, zeros, offload):
        for mb in micro_batches:
            if training.global_batch % (mb * layout.dp):
                continue
            for ckpt in checkpointing:
                tr = dataclasses.replace(
                    training,
                    micro_batch=mb,
                    checkpointing=ckpt,
                    compression="none"
                    if compression_problem(training.compression, layout.zero)
                    else training.compression,
                )
                try:
                    p = plan_layout(shape, layout, tr, hw, count_params)
                except PlanError:
                    continue
                if p.fits:
                    rough.append((p.step["tokens_per_s"], layout, tr))
    return rough
