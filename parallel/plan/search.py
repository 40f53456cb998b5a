"""``mode=recommend``: the layouts that fit a device count, ranked by predicted step time. Searched:
tp inside a node, cp beside it for long sequences, pp up to the layer count, dp the rest, ep for MoE
models, ZeRO 0–3 and ZeRO-2/3's gradient accumulation (sharded: a reduce-scatter every micro-batch;
unsharded: the full fp32 gradient held, one reduce-scatter per step), the pipeline schedule (1F1B,
ZB-H1, interleaved with every vpp up to :data:`MAX_VPP`), micro-batches, checkpointing, offload where
nothing fits without it; sequence parallelism wherever it applies. Each ZeRO-2/3 plan returned says in
its advice what the other accumulation would send, hold and take (:func:`other_accumulation`).
"""

from __future__ import annotations

import dataclasses
import itertools

from ..dims import (
    OFFLOAD_MIN_STAGE,
    OFFLOAD_MODES,
    compression_problem,
    interleaved_problem,
    sequence_split_problem,
    tp_split_problem,
)
from ..pipeline.schedules import zero_bubble_problem
from ..zero.theory import ZERO_ACCUMULATE, accumulate_applies
from .advice import accumulation_choice
from .cp import cp_choices
from .hardware import Hardware, PlanError
from .inputs import Layout, Training, resolve
from .moe import cp_routes, ep_choices, moe_shape, sp_routes
from .planner import plan_layout
from .result import ParamCounter, Plan
from .shape import ModelShape

MAX_VPP = 8  # interleaved: the most model chunks per rank searched (Megatron's runs use 2–6)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, n_layers: int, moe: bool) -> list[tuple[str, int]]:
    """(schedule, vpp) pairs searched for ``pp`` stages: 1F1B, ZB-H1 (not for MoE models: the recipe
    refuses it there) and interleaved with 2 … :data:`MAX_VPP` chunks while ``pp·vpp ≤ n_layers``."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)] + ([] if moe else [("zb-h1", 1)])
    return out + [("interleaved", v) for v in range(2, min(MAX_VPP, n_layers // pp) + 1)]


def accumulations(choices, zero: int, offload: str) -> tuple[str, ...]:
    """The ZeRO-2/3 accumulations of ``choices`` (one name or several) that ``zero`` with ``offload`` runs:
    only stages 2-3 take the choice, and offload refuses unsharded (it keeps the full gradient on the device)."""
    choices = (choices,) if isinstance(choices, str) else tuple(choices)
    runs = accumulate_applies(zero) and offload == "none"
    return tuple(a for a in choices if a == "sharded" or runs) or ("sharded",)


def candidate_layouts(
    shape,
    world_size: int,
    hw: Hardware,
    zeros=(0, 1, 2, 3),
    offload: str = "none",
    compression: str = "none",
    accumulate=ZERO_ACCUMULATE,
) -> list[Layout]:
    """Every layout the search considers for ``world_size`` devices (with ``offload``, the stages that
    carry it); ``compression`` holds where the layout's ZeRO stage takes it; ``accumulate`` (one of
    :data:`~parallel.zero.theory.ZERO_ACCUMULATE` or several) is searched where it takes them (:func:`accumulations`)."""
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
            sp = tp > 1 and not sequence_split_problem(model.seq_len, tp, cp) and sp_routes(moe)
            for pp in _divisors(world_size // (tp * cp)):
                if pp > model.n_layers:
                    break
                dp = world_size // (tp * cp * pp)
                for zero in zeros:
                    if (dp * cp == 1 and zero and offload == "none") or zero < OFFLOAD_MIN_STAGE[offload]:
                        continue
                    kept = dict(compression="none" if compression_problem(compression, zero) else compression)
                    for acc, ep, (schedule, vpp) in itertools.product(
                        accumulations(accumulate, zero, offload),
                        ep_choices(moe, dp),
                        schedules(pp, model.n_layers, moe is not None),
                    ):
                        sizes = dict(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, schedule=schedule, vpp=vpp, accumulate=acc)
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
    accumulate=ZERO_ACCUMULATE,
) -> list[Plan]:
    """The ``top`` fitting plans, fastest step first, the leaner of equally fast ones first (``training.micro_batch``,
    ``checkpointing`` and ZeRO-2/3's ``accumulate`` choices are searched; the global batch, the rest and the
    layout's ``compression`` are kept). A ZeRO-2/3 plan's advice ends with what the other accumulation
    sends, holds and takes (:func:`~parallel.plan.advice.accumulation_choice`)."""
    if world_size < 1:
        raise PlanError(f"world size must be positive, got {world_size}")
    fitting: list[Plan] = []
    for offload in OFFLOAD_MODES:  # offload only when nothing fits on the devices alone
        if not fitting:
            layouts = candidate_layouts(shape, world_size, hw, zeros, offload, compression, accumulate)
            fitting = _fitting(shape, layouts, training, hw, count_params, micro_batches, checkpointing)
    if not fitting:
        raise PlanError(
            f"no layout of {world_size} × {hw.name} fits this model at global batch "
            f"{training.global_batch}, even with ZeRO-Offload; add devices or choose a larger device profile"
        )
    fitting.sort(key=lambda p: (round(p.step["step_time_s"], 9), p.peak_memory))  # ties: less memory first
    priced = {_priced(p.layout, p.training): p for p in fitting}
    for p in fitting[:top]:
        other = other_accumulation(shape, p, hw, count_params, priced)
        if other is not None:
            p.advice.append(accumulation_choice(p, other, hw))
    return fitting[:top]


def _priced(layout: dict, training: dict) -> tuple:
    """A plan's layout and training as a key (every field: equal keys price equally)."""
    return tuple(tuple((k, repr(v)) for k, v in sorted(d.items())) for d in (layout, training))


def other_accumulation(shape, plan: Plan, hw: Hardware, count_params: ParamCounter, priced=None) -> Plan | None:
    """``plan`` with ZeRO-2/3's other gradient accumulation (taken from ``priced``, a :func:`_priced` → plan
    map, where it is there), or None where the layout has no other (stages 0-1; offload refuses unsharded)."""
    L = plan.layout
    others = [a for a in accumulations(ZERO_ACCUMULATE, L["zero"], L["offload"]) if a != L["accumulate"]]
    if not others:
        return None
    layout = {**L, "accumulate": others[0]}
    found = (priced or {}).get(_priced(layout, plan.training))
    if found is not None:
        return found
    fields = {k: v for k, v in layout.items() if k != "pp_layers"}
    training = Training(**plan.training)
    return plan_layout(shape, resolve(shape, **fields), training, hw, count_params, pp_layers=L.get("pp_layers"))


def _base(layout: Layout, mb: int, ckpt: str) -> tuple:
    """What a layout and training are apart from the pipeline schedule."""
    skip = ("schedule", "vpp")
    return (*(getattr(layout, f.name) for f in dataclasses.fields(layout) if f.name not in skip), mb, ckpt)


def _fitting(shape, layouts, training, hw, count_params, micro_batches, checkpointing) -> list[Plan]:
    """The plan of every one of ``layouts`` × micro-batch × checkpointing that the recipe can run and that fits.
    ZB-H1 and interleaved are priced only where 1F1B fits the same layout: they hold as many activations
    or more (every stage holds 1F1B's first stage's ``min(pp, m)``, or more chunks in flight). Unsharded
    accumulation holds more than sharded (the full fp32 gradient): it is priced only where sharded fits, and
    over several micro-batches (over one it sends sharded's bytes)."""
    out: list[Plan] = []
    one_f_one_b_fits: set[tuple] = set()  # candidate_layouts lists a layout's 1F1B before its other schedules
    sharded_fits: set[tuple] = set()  # ... and a layout's sharded accumulation before its unsharded one
    for layout in layouts:
        for mb in micro_batches:
            if (
                training.global_batch % (mb * layout.dp)
                or interleaved_problem(layout.schedule, layout.pp, training.global_batch, mb, layout.dp)
                or (layout.accumulate == "unsharded" and training.global_batch == mb * layout.dp)
            ):
                continue
            for ckpt in checkpointing:
                base = _base(layout, mb, ckpt) if layout.pp > 1 else None
                sharded = (dataclasses.replace(layout, accumulate="sharded"), mb, ckpt)
                if (
                    zero_bubble_problem(layout.schedule, ckpt, layout.zero)
                    or (layout.schedule != "1f1b" and base not in one_f_one_b_fits)
                    or (layout.accumulate == "unsharded" and sharded not in sharded_fits)
                ):
                    continue
                tr = dataclasses.replace(training, micro_batch=mb, checkpointing=ckpt)
                try:
                    p = plan_layout(shape, layout, tr, hw, count_params)
                except PlanError:
                    continue
                if p.fits:
                    out.append(p)
                    if layout.schedule == "1f1b":
                        one_f_one_b_fits.add(base)
                    if layout.accumulate == "sharded":
                        sharded_fits.add(sharded)
    return out
