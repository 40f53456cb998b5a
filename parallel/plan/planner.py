"""The plan of one layout: per pipeline rank memory, traffic and time; for the step time, throughput,
MFU and advice. Each stage's forward and backward per micro-batch (its collectives on the critical path
included) feed the schedule's closed form or simulator; DP traffic is added where backward cannot hide
it, as :mod:`parallel.overlap`'s table (the engine's) says. Parameters come from the caller's counter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from ..overlap import STEP_SCALARS
from ..zero.policy import policy
from . import compute as C
from . import memory as M
from . import moe as MoE
from . import offload as O
from .advice import advise
from .buffers import buffer_bytes
from .exposure import exposed_dp_time, norm_every_step
from .hardware import Hardware, host_costs
from .inputs import Layout, Setup, Training
from .pipeline import p2p_message_seconds, pipeline_step, zb_h1_holds
from .result import ParamCounter, Plan, RankClass
from .shape import layer_partition, model_flops_per_token
from .stage import Stage, alike_key, stage_flags, stages
from .traffic import AxisTraffic, axis_traffic, dp_traffic, group_crosses_node


@dataclass
class _Step:
    """The step's terms after the pipeline: each the maximum over the stages."""

    dp_exposed: float = 0.0
    dp_exposed_unread: float = 0.0  # the same for a step nobody reads
    offload_exposed: float = 0.0
    optimizer_s: float = 0.0
    scalars_tp_pp: float = 0.0  # the step's scalars on the tp and pp groups (the norm, the loss's broadcast)
    scalars_tp_pp_unread: float = 0.0


def plan_layout(
    shape,
    layout: Layout,
    training: Training,
    hw: Hardware,
    count_params: ParamCounter,
    *,
    world_size: int | None = None,
    pp_layers: tuple[int, ...] | None = None,
) -> Plan:
    """The per-rank-class memory, traffic and time of ``layout`` (module docstring); ``pp_layers``:
    the layers of each pipeline rank (:func:`parallel.pipeline.partition.partition_layers`)."""
    ctx = Setup(shape, layout, training, hw, count_params, world_size)
    dims = ctx.dims
    priced = stages(ctx, layer_partition(ctx.shape, dims.pp, dims.vpp, pp_layers))
    # the slowest stage paces the pipeline; p2p of one activation between stages
    pp_crosses = group_crosses_node(dims.tp * ctx.zdp, dims.pp, hw.gpus_per_node)
    slow_f = max(st.forward_s for st in priced) / dims.vpp
    # without SP each TP rank sends 1/tp of the activation; the receiver's TP all-gather is awaited too
    gather_s = _transfer_gather(ctx, axis_traffic(1, dims.tp, hw.gpus_per_node)) if dims.pp > 1 else 0.0
    p2p = p2p_message_seconds(hw, ctx.act_msg / ctx.transfer_split, pp_crosses, dims.pp, slow_f) + gather_s
    costs = [(st.forward_s, st.backward_s) for st in priced]
    makespan, bubble, peaks = pipeline_step(dims.schedule, dims.pp, ctx.m, dims.vpp, costs, p2p)
    totals, alike = _Step(), {}
    ranks = []
    for s, st in enumerate(priced):  # stages alike (stage.alike_key) differ only in the activations in flight
        key = alike_key(ctx, st.chunks)
        if key in alike:
            ranks.append(_alike_rank(ctx, alike[key], s, st, peaks[s]))
        else:
            ranks.append(_rank(ctx, s, st, peaks[s], pp_crosses, totals))
            alike[key] = ranks[-1]
    plan = Plan(
        model=asdict(ctx.shape),
        layout={**asdict(dims), "pp_layers": pp_layers},
        training=asdict(training),
        hardware=asdict(hw),
        grad_accum=ctx.m,
        ranks=ranks,
        step=_step_summary(ctx, ranks, totals, makespan, bubble),
    )
    plan.advice = advise(plan, ctx.shape, hw, moe=ctx.moe is not None)
    return plan


def _rank(ctx: Setup, s: int, st: Stage, in_flight: int, pp_crosses: bool, totals: _Step) -> RankClass:
    """Stage ``s``'s ranks: their model states, DP, PP and embedding traffic, memory; adds the
    stage's share of the step's terms to ``totals``."""
    dims, tr, hw, zdp, edp, e = ctx.dims, ctx.tr, ctx.hw, ctx.zdp, ctx.edp, ctx.e
    pol, pp, vpp = policy(dims.zero), dims.pp, dims.vpp
    params, experts = MoE.ep_split(st.params, dims.ep)  # experts: E/ep per rank, ZeRO over edp
    psi = M.zero_padded_numel(params, zdp, ctx.bucket, e, per_unit=pol.gathers_per_unit)
    states = M.model_state_bytes(psi, dims.zero, zdp, tr.precision, tr.optimizer, dims.offload)
    epsi = M.zero_padded_numel(experts, edp, ctx.bucket, e, pol.gathers_per_unit) if experts.numel else 0
    if epsi:
        e_states = M.model_state_bytes(epsi, dims.zero, edp, tr.precision, tr.optimizer, dims.offload)
        states = {k: v + e_states[k] for k, v in states.items()}
    shard = psi // zdp if pol.shards_optimizer else psi
    shard += epsi // edp if pol.shards_optimizer else epsi
    offload_s = O.offload_seconds(shard, e, dims.offload, hw, ctx.m, st.forward_s, st.backward_s)
    extras = M.zero_extra_reduce_counts(params, ctx.bucket, e, pol.gathers_per_unit)  # one call per bucket
    tp_axis = st.tp
    # ZeRO sums them over TP after the DP reduction, bucket by bucket: their fp32 shard. Under SP an MoE
    # block's router and experts are replicated over TP too: the experts' buckets, sharded over edp, as well
    for part, group, what in ((params, zdp, ""), (experts, edp, "MoE experts' ")):
        if dims.sp_enabled and part.replicated:
            numel = M.zero_extra_reduce_numel(part, group, ctx.bucket, e, pol.gathers_per_unit)
            calls = M.zero_extra_reduce_counts(part, ctx.bucket, e, pol.gathers_per_unit)["tp"]
            shard = numel // (group if pol.shards_optimizer else 1)
            what += "sequence-parallel parameter gradients (fp32 shard)"
            tp_axis.add("all_reduce", shard * 4, 1, hw, what, calls=calls)
    scalars = tp_axis.add("all_reduce", 4, 1, hw, "gradient norm (fp32 scalar)")
    n_moe = sum(MoE.moe_layers_in(ctx.moe, r) for _, r in st.chunks)
    if dims.sp_enabled:  # SP's tp ranks route different tokens: their loads are summed too, every step
        scalars += MoE.bias_load_traffic(ctx.moe, tp_axis, hw, n_moe=n_moe)
    dp_axis, edp_axis = _dp(ctx, st, params, psi, epsi, totals, n_moe)
    if dims.offload == "none":  # offloaded, the step runs on the host: offload_seconds prices it
        totals.optimizer_s = max(totals.optimizer_s, C.optimizer_seconds(shard, ctx.work_hw))
    pp_axis = AxisTraffic(pp, pp_crosses)
    sends = sum(int(v < pp * vpp - 1) + int(v > 0) for v, _ in st.chunks)
    split = ctx.transfer_split
    what = "activations and gradients to neighbour stages" + (f" (1/{split}: scatter-gather)" if split > 1 else "")
    pp_axis.add("p2p", ctx.act_msg / split, sends * ctx.m, hw, what)
    _transfer_gather(ctx, tp_axis, sends * ctx.m)
    loss_pp = pp_axis.add("broadcast", 4, 1, hw, "loss from the last stage (fp32 scalar)")
    scalars += pp_axis.add("all_reduce", 4, 1, hw, "gradient norm (fp32 scalar)")  # scalars: the norm's
    read_only = loss_pp + (0.0 if norm_every_step(tr.grad_clip, tr.precision, dims.offload) else scalars)
    scalars += loss_pp
    totals.scalars_tp_pp = max(totals.scalars_tp_pp, STEP_SCALARS.exposed(scalars, 0.0))  # after backward
    totals.scalars_tp_pp_unread = max(totals.scalars_tp_pp_unread, STEP_SCALARS.exposed(scalars - read_only, 0.0))
    emb_axis = AxisTraffic(2 if params.shared_embedding and pp > 1 else 1, pp_axis.crosses_node)
    emb_shard = M.padded(params.shared_embedding, zdp) // (zdp if pol.shards_optimizer else 1)  # as for SP
    what = "tied embedding gradient (fp32 shard)"
    emb_axis.add("all_reduce", emb_shard * 4, 1, hw, what, calls=extras["embedding"])
    mem = _memory(ctx, s, st, states, params, experts, in_flight)
    host_ok = O.host_fits(mem.get("host", 0.0), ctx.colocated, hw)
    axes = (("dp", dp_axis), ("tp", tp_axis), ("pp", pp_axis), ("embedding", emb_axis), ("cp", st.cp))
    traffic = {name: a.as_dict() for name, a in axes}
    if ctx.moe is not None:  # MoE: the all-to-alls (exposed) and the experts' gradients over edp
        traffic["ep"] = st.ep.as_dict()
        if dims.ep_enabled:
            traffic["edp"] = edp_axis.as_dict()
    totals.offload_exposed = max(totals.offload_exposed, offload_s["exposed_s"])
    return RankClass(
        stage=s,
        layers=[(r.start, r.stop) for _, r in st.chunks],
        params=params + experts,
        memory=mem,
        in_flight=in_flight,
        activation_per_microbatch=sum(st.activations),
        forward_s=st.forward_s,
        backward_s=st.backward_s,
        compute_s=ctx.m * st.flops_s,
        traffic=traffic,
        fits=mem["total"] <= hw.memory_bytes and host_ok,
    )


def _alike_rank(ctx: Setup, like: RankClass, s: int, st: Stage, in_flight: int) -> RankClass:
    """Stage ``s``'s ranks, alike to ``like``'s but for the micro-batches in flight: its activations and
    total as :func:`_memory` sums them; the step's terms are ``like``'s (already in the totals)."""
    mem = dict(like.memory)
    mem["activations"] = _activations(ctx, s, st, in_flight)
    mem["temporaries"] = _temporaries(ctx, st, in_flight, mem["activations"])
    mem["total"] = mem["model_states"] + mem["activations"] + mem["temporaries"] + mem["buffers"]
    traffic = {k: {**v, "items": list(v["items"]), "by_kind": dict(v["by_kind"])} for k, v in like.traffic.items()}
    fits = mem["total"] <= ctx.hw.memory_bytes and O.host_fits(mem.get("host", 0.0), ctx.colocated, ctx.hw)
    layers = [(r.start, r.stop) for _, r in st.chunks]
    return dataclasses.replace(
        like, stage=s, layers=layers, memory=mem, in_flight=in_flight, traffic=traffic, fits=fits
    )


def _dp(
    ctx: Setup, st: Stage, params, psi: int, epsi: int, totals: _Step, n_moe: int
) -> tuple[AxisTraffic, AxisTraffic]:
    """The DP (and expert DP) traffic of a stage's ranks, as the engine's buckets issue it, and what
    of it compute cannot hide (into ``totals``); returns the dp and edp axes. ``n_moe``: its MoE blocks."""
    dims, tr, hw, zdp, edp, e, m = ctx.dims, ctx.tr, ctx.hw, ctx.zdp, ctx.edp, ctx.e, ctx.m
    pol, t, gpn = policy(dims.zero), dims.tp, hw.gpus_per_node
    per_unit = pol.gathers_per_unit
    dp_axis = axis_traffic(t, zdp, gpn)
    counts = M.zero_bucket_counts(params, ctx.bucket, e, per_unit)  # one collective each
    if counts is not None:  # the engine's buckets: per block (ZeRO-3), then the rest
        buckets, units, root_calls = sum(counts), max(1, sum(counts[:-1])), counts[-1]  # a middle stage: no rest
    else:  # classes unknown: the rank packed as one class, ZeRO-3's blocks one bucket each
        buckets = max(1, -(-psi * e // int(ctx.bucket)))
        units, root_calls = sum(len(r) for _, r in st.chunks), 1
    reductions = max(buckets, units) if per_unit else buckets
    root_psi = M.zero_padded_numel(M.StageParams(0, root=params.root), zdp, ctx.bucket, e)
    several = counts is not None and len(counts) > 1
    common = dict(zero=dims.zero, micro_batches=m, param_bytes=e, comm_bytes=ctx.c, accumulate=dims.accumulate)
    dp_times = dp_traffic(
        hw,
        dp_axis,
        psi=psi,
        compression=dims.compression,
        topk_ratio=tr.topk_ratio,
        regathered_psi=psi - root_psi,
        buckets=buckets,
        units=units,
        root_calls=root_calls,
        first_unit_calls=counts[0] if several else None,
        unit_count=len(counts) - 1 if several else None,
        overlap=tr.overlap,
        **common,
    )
    edp_axis = dp_axis if not dims.ep_enabled else axis_traffic(t * dims.ep, edp, gpn)
    scalars_ep = 0.0
    if epsi:  # expert gradients (and stage-3 gathers) on edp, hidden behind the same backward
        e_times = dp_traffic(hw, edp_axis, psi=epsi, regathered_psi=epsi, **common)
        dp_times = {k: v + e_times[k] for k, v in dp_times.items()}
        if not pol.shards_optimizer:  # stage 0: each ep rank's experts enter the norm
            scalars_ep = st.ep.add("all_reduce", 4, 1, hw, "expert gradient norm (fp32 scalar)")
    # the step's scalars: the loss averaged over DP; the gradient norm summed over DP when sharded.
    # They follow backward, so nothing hides them. An unread step (parallel.engine.PendingLoss)
    # issues no loss scalar, and no norm unless norm_every_step: read_only_dp is what a logged step adds.
    n_scalars = 1 + pol.shards_optimizer
    dp_one = dp_axis.add("all_reduce", 4, n_scalars, hw, "loss and gradient norm (fp32 scalars)")
    norm_dp = (n_scalars - 1) * dp_one + (scalars_ep if epsi and not pol.shards_optimizer else 0.0)
    loads = MoE.bias_load_traffic(ctx.moe, dp_axis, hw, n_moe=n_moe)  # every step, read or not
    scalars_s = STEP_SCALARS.exposed(dp_one + norm_dp + loads, 0.0)
    norm_always = norm_every_step(tr.grad_clip, tr.precision, dims.offload)
    read_only_dp = STEP_SCALARS.exposed(dp_one + (0.0 if norm_always else norm_dp), 0.0)
    fraction = host_costs(hw).overlap_fraction
    exposed = exposed_dp_time(dp_times, m, st.forward_s, st.backward_s, tr.overlap, reductions, fraction)
    totals.dp_exposed = max(totals.dp_exposed, exposed + scalars_s)
    totals.dp_exposed_unread = max(totals.dp_exposed_unread, exposed + scalars_s - read_only_dp)
    return dp_axis, edp_axis


def _block_transient(ctx: Setup) -> float:
    """A block's backward above what it stores: its workspace and, under ``full``, its recomputed activations."""
    dims, tr = ctx.dims, ctx.tr
    kw = dict(tp=dims.tp, sequence_parallel=dims.sp_enabled, precision=tr.precision, fp8=tr.fp8, compiled=tr.compiled)
    recompute = M.recompute_peak_bytes(ctx.local, tr.micro_batch, checkpointing=tr.checkpointing, **kw)
    return recompute + M.backward_workspace_bytes(ctx.local, tr.micro_batch, **kw)


def _transient(ctx: Setup, st: Stage) -> float:
    """The largest activation transient of a stage's step: a block's backward (:func:`_block_transient`),
    the loss's (the head's stage), fp8's casts."""
    dims, tr = ctx.dims, ctx.tr
    recompute = _block_transient(ctx)
    casts = M.fp8_cast_peak_bytes(ctx.local, tr.micro_batch, tp=dims.tp) if tr.fp8 else 0.0
    has_head = any(v == dims.pp * dims.vpp - 1 for v, _ in st.chunks)
    loss = M.loss_temporary_bytes(ctx.local, tr.micro_batch, tp=dims.tp, precision=tr.precision) if has_head else 0.0
    return max(recompute, loss, casts)


def _temporaries(ctx: Setup, st: Stage, in_flight: int, activations: float) -> float:
    """What the stage's peak holds beyond ``activations`` (:func:`_activations`): the excess of its peak
    while a vocabulary weight gradient is fresh (:func:`_vocabulary_gradients`), 0 where that is lower.
    Not priced under ZB-H1 at pp > 1, whose holdings differ (:func:`_activations`)."""
    if ctx.dims.schedule == "zb-h1" and ctx.dims.pp > 1:
        return 0.0
    return max(0.0, _vocabulary_gradients(ctx, st, in_flight, max(st.activations)) - activations)


def _vocabulary_gradients(ctx: Setup, st: Stage, in_flight: int, one: float) -> float:
    """The stage's activations and fresh gradients while its embedding's or head's weight gradient is
    fresh (``G = e·V/t·h`` in the parameters' dtype each, alive from its backward GEMM until ZeRO's hook
    copies it into the flat buffer), 0 on stages with neither. The head's comes at the start of a
    micro-batch's backward, beside the loss's gradient ``e·N`` (``N = b·s·V/t`` logits) and its input
    gradient, once what the loss stored (:func:`.memory.loss_stored_bytes`) is freed; the embedding's at
    the end, when that micro-batch's activations are gone. A tied pair on one stage is one parameter
    used twice: autograd holds the head's gradient through every block's backward until the embedding's
    arrives, then sums the two into a third."""
    dims, shape, mb = ctx.dims, ctx.local, ctx.tr.micro_batch
    flags = [stage_flags(v, dims.pp * dims.vpp) for v, _ in st.chunks]
    has_embedding, has_head = any(f[0] for f in flags), any(f[1] for f in flags)
    if not (has_embedding or has_head):
        return 0.0
    vocab, tokens = shape.padded_vocab(dims.tp) / dims.tp, mb * shape.seq_len
    e_act = M.PRECISION_BYTES[ctx.tr.precision]
    g = ctx.e * vocab * shape.d_model
    peak = 0.0
    if has_head:  # the head's backward: its weight and input gradients from the logits' gradient
        kw = dict(tp=dims.tp, precision=ctx.tr.precision, compiled=ctx.tr.compiled)
        stored = M.loss_stored_bytes(shape, mb, **kw)  # freed by the loss's backward
        peak = in_flight * one - stored + e_act * tokens * (vocab + shape.d_model) + g
    if has_embedding and has_head and shape.tie_embeddings:
        return max(peak, in_flight * one + _block_transient(ctx) + g, (in_flight - 1) * one + 3 * g)
    if has_embedding:
        peak = max(peak, (in_flight - 1) * one + g)
    return peak


def _activations(ctx: Setup, s: int, st: Stage, in_flight: int) -> float:
    """Stage ``s``'s activations at its peak: the in-flight micro-batches and the largest transient
    (:func:`_transient`). Under ZB-H1 a micro-batch between its B and W holds what W reads
    (``st.deferred``), not what it stored: the peak is the largest of the schedule's holdings
    (:func:`.pipeline.zb_h1_holds`), the one in B at the larger of the two, as it turns the one into
    the other (its backward's transient on top), the one in W at its deferred bytes."""
    one, transient = max(st.activations), _transient(ctx, st)
    if ctx.dims.schedule != "zb-h1" or ctx.dims.pp == 1 or st.deferred is None:
        return in_flight * one + transient
    held = max(st.deferred)
    return max(
        (stored - during_b) * one + deferred * held + (max(one, held) + transient if during_b else 0.0)
        for stored, deferred, during_b in zb_h1_holds(ctx.dims.pp, ctx.m)[s]
    )


def _memory(ctx: Setup, s: int, st: Stage, states: dict, params, experts, in_flight: int) -> dict[str, float]:
    """Bytes per rank: model states, activations at the peak (:func:`_activations`), communication
    buffers, and their total."""
    activations = _activations(ctx, s, st, in_flight)
    buffers = buffer_bytes(ctx, params, experts)
    mem = {
        **{k: float(v) for k, v in states.items() if k != "total"},
        "model_states": float(states["total"]),
        "activations": activations,
        "temporaries": _temporaries(ctx, st, in_flight, activations),
        "buffers": buffers,
    }
    mem["total"] = mem["model_states"] + activations + mem["temporaries"] + buffers
    return mem


def _step_summary(ctx: Setup, ranks: list[RankClass], totals: _Step, makespan: float, bubble: float) -> dict:
    """The step's time (logged and unread), throughput, MFU and compute/communication ratio."""
    hw, tr, dims, shape, moe = ctx.hw, ctx.tr, ctx.dims, ctx.shape, ctx.moe
    emb_time = STEP_SCALARS.exposed(max(r.traffic["embedding"]["time_s"] for r in ranks), 0.0)  # after backward
    overhead_s = C.step_overhead_seconds(ctx.work_hw)  # the step's fixed host cost (none on GPU profiles)
    t = totals
    step_time = makespan + t.dp_exposed + emb_time + t.scalars_tp_pp + t.offload_exposed + t.optimizer_s + overhead_s
    unread = (
        makespan + t.dp_exposed_unread + emb_time + t.scalars_tp_pp_unread + t.offload_exposed + t.optimizer_s
    ) + overhead_s
    compute = max(r.compute_s for r in ranks)
    comm_total = max(sum(a["time_s"] for a in r.traffic.values()) for r in ranks)
    tokens_step = tr.global_batch * shape.seq_len
    mfpt = MoE.flops_per_token(moe) if moe else model_flops_per_token(shape)  # MoE: active parameters
    step = {
        "step_time_s": step_time,  # a logged step (read: the loss and norm scalars); the dry run's step
        "unread_step_time_s": unread,  # a step nobody reads (recipes/training/trainer.py: most steps)
        "read_extra_s": step_time - unread,  # what reading a step adds
        "pipeline_s": makespan,
        "bubble_fraction": bubble,
        "dp_exposed_s": totals.dp_exposed,
        "optimizer_s": totals.optimizer_s,
        "step_overhead_s": overhead_s,
        "scalars_s": emb_time + totals.scalars_tp_pp,  # tp/pp norm, loss broadcast, tied embedding (dp's in dp_exposed)
        "colocated_factor": C.colocated_factor(hw, ctx.colocated),
        "offload_s": totals.offload_exposed,
        "tokens_per_s": tokens_step / step_time,
        "mfu": tokens_step * mfpt / step_time / (dims.world_size * hw.peak_flops(tr.precision)),
        "compute_s": compute,
        "comm_s": comm_total,
        "compute_comm_ratio": compute / comm_total if comm_total else float("inf"),
        "model_flops_per_token": mfpt,
        "tflops_per_gpu": tokens_step * mfpt / step_time / dims.world_size / 1e12,
    }
    if moe is not None:
        counts = MoE.param_counts(moe)
        step.update(params_total=counts["total"], params_active=counts["active"])
    return step


def _transfer_gather(ctx: Setup, tp_axis: AxisTraffic, count: int = 1) -> float:
    """The scatter-gather's TP ``all_gather`` that rebuilds each received activation (or gradient),
    ``count`` of them on ``tp_axis``; one's seconds (0 where ``ctx.transfer_split`` is 1)."""
    if ctx.transfer_split == 1:
        return 0.0
    return tp_axis.add("all_gather", ctx.act_msg, count, ctx.hw, "pipeline receives rebuilt from TP shares")
