"""``mode=recommend``: the layouts that fit a device count, ranked by predicted throughput. Searched:
tp inside a node, cp beside it for long sequences, pp up to the layer count, dp the rest, ep for MoE
models, ZeRO 0–3, micro-batches, checkpointing; sequence parallelism wherever it applies.
"""

from __future__ import annotations

import dataclasses

from ..dims import OFFLOAD_MIN_STAGE, OFFLOAD_MODES, compression_problem, sequence_split_problem, tp_split_problem
from ..zero.theory import accumulate_applies
from .cp import cp_choices
from .hardware import Hardware, PlanError
from .inputs import Layout, Training, resolve
from .moe import cp_routes, ep_choices, moe_shape
from .planner import plan_layout
from .result import ParamCounter, Plan
from .shape import ModelShape


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    shape,
    world_size: int,
    hw: Hardware,
    zeros=(0, 1, 2, 3),
    offload: str = "none",
    compression: str = "none",
    accumulate: str = "sharded",
) -> list[Layout]:
    """Every layout the search considers for ``world_size`` devices (with ``offload``, the stages that
    carry it); ``compression`` and ``accumulate`` hold where the layout's ZeRO stage takes them."""
    moe, model = moe_shape(shape), ModelShape.of(shape)
    out = []
    for tp in _divisors(min(hw.gpus_per_node, world_size)):
        if (
            hw.gpus_per_node % tp
            or world_size % tp
            or tp_split_problem(model.n_heads, model.n_kv_heads, model.d_ff, tp)
        ):
            continue
        cps = cp_choices(model, world_size, tp, hw.gpus_per_node) if cp_routes(moe) else [1]
        for cp in cps:  # long sequences: context parallel too (MoE: dropless only, moe.cp_routes)
            sp = tp > 1 and not sequence_split_problem(model.seq_len, tp, cp) and moe is None
            for pp in _divisors(world_size // (tp * cp)):
                if pp > model.n_layers:
                    break
                dp = world_size // (tp * cp * pp)
                for zero in zeros:
                    if (dp * cp == 1 and zero and offload == "none") or zero < OFFLOAD_MIN_STAGE[offload]:
                        continue
                    kept = dict(
                        compression="none" if compression_problem(compression, zero) else compression,
                        accumulate=accumulate if accumulate_applies(zero) else "sharded",
                    )
                    for ep in ep_choices(moe, dp):
                        sizes = dict(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
                        out.append(resolve(shape, **sizes, sequence_parallel=sp, zero=zero, offload=offload, **kept))
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
    compression: str = "none",
    accumulate: str = "sharded",
) -> list[Plan]:
    """The ``top`` fitting plans, fastest first, the leaner of equally fast ones first (``training.micro_batch`` and
    ``checkpointing`` are searched; the global batch, the rest and the layout's ``compression`` and ZeRO-2/3
    ``accumulate`` are kept)."""
    if world_size < 1:
        raise PlanError(f"world size must be positive, got {world_size}")
    rough: list[tuple[float, Layout, Training]] = []
    for offload in OFFLOAD_MODES:  # offload only when nothing fits on the devices alone
        if not rough:
            layouts = candidate_layouts(shape, world_size, hw, zeros, offload, compression, accumulate)
            rough = _fitting(shape, layouts, training, hw, count_params, micro_batches, checkpointing)
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


def _fitting(shape, layouts, training, hw, count_params, micro_batches, checkpointing):
    """(rough tokens/s, layout, training) of every one of ``layouts`` that fits."""
    rough: list[tuple[float, Layout, Training]] = []
    for layout in layouts:
        for mb in micro_batches:
            if training.global_batch % (mb * layout.dp):
                continue
            for ckpt in checkpointing:
                tr = dataclasses.replace(training, micro_batch=mb, checkpointing=ckpt)
                try:
                    p = plan_layout(shape, layout, tr, hw, count_params)
                except PlanError:
                    continue
                if p.fits:
                    rough.append((p.step["tokens_per_s"], layout, tr))
    return rough
