"""One pipeline stage's numbers: parameters, forward and backward seconds per micro-batch (the
collectives on the critical path included), activations, compute; stages with the same chunks share them."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..overlap import TP_COLLECTIVES, TP_SP_BACKWARD
from . import compute as C
from . import memory as M
from . import moe as MoE
from .cp import cp_traffic, extra_activation_bytes
from .deferred import compiled_deferred_bytes, deferred_stage_bytes
from .exposure import partly_hidden
from .hardware import host_costs
from .inputs import Setup
from .traffic import AxisTraffic, axis_traffic, tp_traffic


class Stage(NamedTuple):
    """A stage's chunks ``[(virtual index, layers)]`` and their numbers (:func:`stage_numbers`)."""

    chunks: list[tuple[int, range]]
    params: M.StageParams
    tp: AxisTraffic
    cp: AxisTraffic
    ep: AxisTraffic
    forward_s: float
    backward_s: float
    activations: list[float]  # per chunk, one micro-batch
    flops_s: float  # one micro-batch's compute, recomputation included
    deferred: list[float] | None = None  # per chunk, one micro-batch between zero-bubble's B and W; None: unpriced


def stage_flags(v: int, n_virtual: int) -> tuple[bool, bool]:
    """(has the embedding, has the head) of virtual stage ``v``."""
    return v == 0, v == n_virtual - 1


def alike_key(ctx: Setup, chunks: list[tuple[int, range]]) -> tuple:
    """What a stage's numbers follow from: per chunk its layer count, MoE layers and embedding/head flags."""
    n_virtual = ctx.dims.pp * ctx.dims.vpp
    return tuple((len(r), MoE.moe_layers_in(ctx.moe, r)) + stage_flags(v, n_virtual) for v, r in chunks)


def stages(ctx: Setup, ranges: list[range]) -> list[Stage]:
    """Every pipeline stage's :class:`Stage`; stages alike share the numbers, not the traffic ledgers."""
    out, alike, pp, n_virtual = [], {}, ctx.dims.pp, ctx.dims.pp * ctx.dims.vpp
    for s in range(pp):
        chunks = [(v, ranges[v]) for v in range(s, n_virtual, pp)]
        key = alike_key(ctx, chunks)
        if key not in alike:
            alike[key] = stage_numbers(ctx, chunks)
        st = alike[key]
        out.append(st._replace(chunks=chunks, tp=st.tp.copy(), ep=st.ep.copy()))
    return out


def stage_numbers(ctx: Setup, chunks: list[tuple[int, range]]) -> Stage:
    """The :class:`Stage` of a rank holding ``chunks``: parameters, TP, CP and EP traffic,
    per-micro-batch forward/backward seconds, activations per chunk, the step's compute seconds."""
    dims, tr, hw, local, moe, m, e = ctx.dims, ctx.tr, ctx.work_hw, ctx.local, ctx.moe, ctx.m, ctx.e
    t, sp, ckpt, mb = dims.tp, dims.sp_enabled, tr.checkpointing, tr.micro_batch
    params = M.StageParams(0)  # activations and TP messages: s/cp tokens; FLOPs: those tokens over all s
    tp_axis = axis_traffic(1, t, hw.gpus_per_node)
    cp_axis = axis_traffic(t, dims.cp, hw.gpus_per_node)
    ep_axis = axis_traffic(t * dims.cp, dims.ep, hw.gpus_per_node)
    fwd = bwd = flops_s = 0.0
    acts, deferred = [], []
    layer = C.layer_time(local, mb, t, sp, hw, tr.precision, tr.attention, tr.fp8, tr.compiled)
    if dims.cp_enabled:  # each cp rank's s/cp queries attend over all s keys: cp × the local square
        layer = dataclasses.replace(
            layer, attention=layer.attention * dims.cp, attention_backward=layer.attention_backward * dims.cp
        )
    routed = mb * dims.tp_seq_len  # the tokens a rank routes: its s/tp of each sequence under SP
    moe_layer = MoE.layer_time(moe, layer, local, mb, t, hw, tr.precision, routed) if moe else layer
    for v, r in chunks:
        first, last = stage_flags(v, dims.pp * dims.vpp)
        params = params + ctx.count(r, first, last, t)
        n, n_moe = len(r), MoE.moe_layers_in(moe, r)
        head = C.head_time(local, mb, t, hw, tr.precision) if last else C.LayerTime(0.0, 0.0, 0.0)
        blocks_f = (n - n_moe) * layer.forward + n_moe * moe_layer.forward
        blocks_b = (n - n_moe) * layer.backward + n_moe * moe_layer.backward
        recompute = {"full": blocks_f, "selective": n * layer.attention}.get(ckpt, 0.0)
        tf, tb, (regather, scatter) = tp_traffic(
            local,
            tp_axis,
            hw,
            n_layers=n,
            has_embedding=first,
            has_head=last,
            mb=mb,
            m=m,
            e=e,
            sp=sp,
            ckpt=ckpt,
            fp8=tr.fp8,
            mlp_layers=n - n_moe + (n_moe if moe and moe.moe_shared_experts else 0),  # an MoE block's: shared only
        )
        cf, cb = cp_traffic(
            ctx.shape, cp_axis, hw, dims, n_layers=n, mb=mb, m=m, e=e, ckpt=ckpt, peak_flops=ctx.peak_flops
        )
        ef = eb = 0.0
        if n_moe:  # exposed: the layer waits for its exchanges; router statistics summed over cp (and tp under SP)
            ef, eb = MoE.ep_traffic(moe, ep_axis, hw, n_moe=n_moe, tokens=routed, m=m, e=e, checkpointing=ckpt)
            sf, sb = MoE.stats_traffic(moe, cp_axis, hw, n_moe=n_moe, m=m, checkpointing=ckpt)
            cf, cb = cf + sf, cb + sb
            if sp:
                stats_kw = dict(m=m, checkpointing=ckpt, backward=False, sequences=mb)  # s/tp of mb sequences
                sf, _ = MoE.stats_traffic(moe, tp_axis, hw, n_moe=n_moe, **stats_kw)
                ef += sf  # exposed: the layer waits for it
        f_s = blocks_f + head.forward
        b_s = blocks_b + head.backward + recompute
        fwd += f_s + TP_COLLECTIVES.exposed(tf, n * layer.gemm) + cf + ef  # exposed: TP collectives block
        column = n * layer.column_gemm  # input-gradient matmuls hide the re-gathers, weight-gradient ones the scatters
        sp_b = TP_SP_BACKWARD.exposed(regather, column) + TP_SP_BACKWARD.exposed(scatter, column)
        sp_b = partly_hidden(regather + scatter, sp_b, host_costs(hw).overlap_fraction)
        bwd += b_s + TP_COLLECTIVES.exposed(tb, 2 * n * layer.gemm) + sp_b + cb + eb
        flops_s += f_s + b_s
        kw = dict(
            tp=t, sequence_parallel=sp, checkpointing=ckpt, precision=tr.precision, fp8=tr.fp8, compiled=tr.compiled
        )
        acts.append(
            M.stage_activation_bytes(local, mb, len(r), has_embedding=first, has_head=last, **kw)
            + len(r) * extra_activation_bytes(ctx.shape, mb, dims, checkpointing=ckpt, e=e)
            + (
                n_moe
                and n_moe
                * MoE.activation_bytes(
                    moe, local, mb, tp=t, checkpointing=ckpt, e=e, ep=dims.ep, routed=routed, compiled=tr.compiled
                )
            )
            + (0.0 if last else ctx.act_msg)  # the chunk's output, which the executor holds for its backward
        )
        deferred.append(_deferred(ctx, v, r, n_moe, last, kw))
    priced = all(d is not None for d in deferred)
    return Stage(chunks, params, tp_axis, cp_axis, ep_axis, fwd, bwd, acts, flops_s, deferred if priced else None)


def _deferred(ctx: Setup, v: int, r: range, n_moe: int, last: bool, kw: dict) -> float | None:
    """One micro-batch's bytes on chunk ``v`` between zero-bubble's B and W (the chunk's output, held
    until W, and :func:`.deferred.deferred_stage_bytes`; the first virtual stage's B is the whole backward,
    so it keeps the output only; compiled blocks: :func:`.deferred.compiled_deferred_bytes`), or None where
    that is not priced (dense GPT layers, or compiled dense blocks, without recomputation, fp8, context
    parallelism or latent attention only)."""
    if v == 0:
        return ctx.act_msg
    dims, shape = ctx.dims, ctx.local
    if shape.kv_lora_rank or n_moe or kw["checkpointing"] != "none" or kw["fp8"] or dims.cp_enabled:
        return None
    if not kw["compiled"] and shape.arch != "gpt":
        return None
    dense = dict(tp=dims.tp, sequence_parallel=dims.sp_enabled, precision=ctx.tr.precision)
    if kw["compiled"]:  # the blocks' weight gradients, computed in B; the head's linear W as eager's
        blocks = compiled_deferred_bytes(ctx.count(r, False, False, dims.tp).numel, ctx.tr.precision)
        held = blocks + (deferred_stage_bytes(shape, ctx.tr.micro_batch, 0, has_head=True, **dense) if last else 0.0)
    else:
        held = deferred_stage_bytes(shape, ctx.tr.micro_batch, len(r), has_head=last, **dense)
    return held + (0.0 if last else ctx.act_msg)
