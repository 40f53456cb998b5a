"""The plan of one layout: per pipeline rank, memory, traffic and time; for the step,
time, throughput, MFU and advice. Pure: no process is started.

The caller supplies the model's shape and a :data:`ParamCounter` that counts the
parameters of a chunk of the real model (``recipes.tools.plan`` builds it on the
``meta`` device), so counts cannot drift from the code that trains.

Step time: every micro-batch's forward and backward cost FLOPs / (peak ·
efficiency) plus their tensor-parallel collectives (which sit on the critical
path); the pipeline schedule is run on paper by the simulator with those costs
(the slowest stage's, pipeline p2p as message latency), which gives the
makespan, the bubble and the micro-batches each stage holds at its peak. DP
traffic is then added where backward cannot hide it (:func:`_exposed_dp_time`). What hides
behind what is :mod:`parallel.overlap`'s table, the one the engine implements.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Callable

from ..overlap import (
    DP_REDUCTION,
    PARAM_GATHER_AFTER_STEP,
    PIPELINE_P2P,
    STEP_SCALARS,
    TP_COLLECTIVES,
    TP_SP_BACKWARD,
    ZERO3_GATHER,
    ZERO3_PREFETCH_UNITS,
    exposed_sharing,
)
from ..pipeline.schedules import ScheduleError, build_schedule, schedule_problem
from ..pipeline.simulator import simulate
from ..zero.compression import INDEX_BYTES
from ..zero.packing import comm_copy_bytes, reduction_buffer_bytes
from ..zero.policy import policy
from ..zero.theory import GRAD_BYTES, accumulation_grad_bytes
from . import compute as C
from . import memory as M
from . import moe as MoE
from . import offload as O
from .advice import advise
from .cp import cp_traffic, extra_activation_bytes, local_shape
from .hardware import Hardware, PlanError
from .inputs import Layout, Training, check
from .shape import ModelShape, layer_partition, model_flops_per_token
from .traffic import AxisTraffic, dp_traffic, group_crosses_node, topk_kept, tp_traffic

#: ``count(layers, has_embedding, has_head, tp)`` → the parameters of that chunk on one TP rank
ParamCounter = Callable[[range, bool, bool, int], M.StageParams]


@dataclass
class RankClass:
    """One pipeline stage's ranks (every DP and TP rank of a stage is alike)."""

    stage: int
    layers: list[tuple[int, int]]  # [start, stop) per chunk
    params: M.StageParams
    memory: dict[str, float]  # bytes: params, grads, optimizer, activations, buffers, total
    in_flight: int  # (micro-batch, chunk) activations held at the peak
    activation_per_microbatch: float
    forward_s: float  # one micro-batch through all its chunks, TP collectives included
    backward_s: float
    compute_s: float  # the step's matmuls, attention and elementwise work (plan.compute), recomputation included
    traffic: dict[str, dict]  # per axis: group_size, crosses_node, bytes, time_s, items
    fits: bool = True


@dataclass
class Plan:
    model: dict
    layout: dict
    training: dict
    hardware: dict
    grad_accum: int
    ranks: list[RankClass]
    step: dict[str, float] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def peak_memory(self) -> float:
        return max(r.memory["total"] for r in self.ranks)

    def to_dict(self) -> dict:
        """Plain JSON-able data (infinite ratios, e.g. compute/communication with no
        communication, become ``None``)."""
        d = asdict(self)
        d["fits"], d["peak_memory_bytes"] = self.fits, self.peak_memory
        return _finite(d)


def _finite(x):
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and x in (float("inf"), float("-inf")) else x


@lru_cache(maxsize=256)
def _simulate(schedule: str, pp: int, m: int, vpp: int, bwd: float, p2p: float):
    r = simulate(build_schedule(schedule, pp, m, vpp), forward=1.0, backward=bwd, p2p_latency=p2p)
    return r.makespan, r.bubble_fraction, tuple(r.peak_activations)


def closed_form(schedule: str, pp: int, m: int, vpp: int, fwd: float, bwd: float, p2p: float):
    """The simulator's (makespan, peak in-flight per stage) of a standard schedule, in closed form,
    or None for a schedule without one. ``fwd``/``bwd`` are one chunk's costs, ``p2p`` one
    rendezvous transfer (it delays both ends); the simulator's timing is linear in them:

    * GPipe: ``(m + pp − 1)(f + b) + 2(m + pp − 2)·p``; every stage holds ``m``;
    * 1F1B: ``(m + pp − 1)(f + b)`` plus ``p`` times ``m + 1`` (pp = 2) or
      ``2(pp − 1) + max(0, 2m − 3)`` (pp ≥ 3); stage ``s`` holds ``min(pp − s, m)``;
    * interleaved 1F1B: ``(m·vpp + pp − 1)(f + b) + ((vpp + 1)·pp + vpp·m − 3)·p``; stage ``s``
      holds its warm-up ``min(2(pp − s − 1) + (vpp − 1)pp, m·vpp)`` plus one, at most ``m·vpp``.

    ``tests/parallel/plan/test_pipeline_closed_form.py`` holds each against the simulator.
    """
    if pp == 1:
        return m * vpp * (fwd + bwd), (m * vpp if schedule == "gpipe" else 1,)
    if schedule == "gpipe":
        return (m + pp - 1) * (fwd + bwd) + 2 * (m + pp - 2) * p2p, (m,) * pp
    if schedule == "1f1b":
        hops = m + 1 if pp == 2 else 2 * (pp - 1) + max(0, 2 * m - 3)
        return (m + pp - 1) * (fwd + bwd) + hops * p2p, tuple(min(pp - s, m) for s in range(pp))
    if schedule == "interleaved":
        total = m * vpp
        span = (total + pp - 1) * (fwd + bwd) + ((vpp + 1) * pp + vpp * m - 3) * p2p
        peaks = tuple(min(min(2 * (pp - s - 1) + (vpp - 1) * pp, total) + 1, total) for s in range(pp))
        return span, peaks
    return None


def uneven_stages_saving(stage_costs: list[float]) -> float:
    """Seconds a GPipe or 1F1B step (one chunk per stage) takes less than :func:`closed_form` prices
    it at the slowest stage's cost ``c_k`` (one micro-batch's forward + backward) on every stage: the
    slowest stage works ``m · c_k`` without a break once its first micro-batch arrives, the others only
    fill and drain the pipeline around it, so the makespan is ``m·c_k + Σ_{s≠k} c_s`` (plus the
    transfers) instead of ``(m + pp − 1)·c_k``: the saving is ``Σ_s (c_k − c_s)``."""
    slowest = max(stage_costs, default=0.0)
    return sum(slowest - c for c in stage_costs)


def pipeline_time(
    schedule: str, pp: int, m: int, vpp: int, fwd: float, bwd: float, p2p: float
) -> tuple[float, float, tuple[int, ...]]:
    """(makespan seconds, bubble fraction, peak in-flight activations per stage) of a step.

    ``fwd``/``bwd``: one micro-batch through one chunk. The standard schedules use
    :func:`closed_form` (equal to the simulator, any size in microseconds); any other
    schedule is run in the simulator (costs normalised to the forward's, rounded to
    0.1 %, so layouts share simulations).
    """
    if not fwd > 0 or not bwd >= 0 or not p2p >= 0:
        raise PlanError(f"pipeline costs must be finite and positive, got forward {fwd}, backward {bwd}, p2p {p2p}")
    problem = schedule_problem(schedule, pp, vpp)
    if problem:
        raise PlanError(problem)
    form = closed_form(schedule, pp, m, vpp, fwd, bwd, p2p)
    if form is not None:
        span, peaks = form
        return span, 1 - m * vpp * (fwd + bwd) / span, peaks
    try:
        span, bubble, peaks = _simulate(schedule, pp, m, vpp, round(bwd / fwd, 3), round(p2p / fwd, 3))
    except ScheduleError as e:
        raise PlanError(str(e)) from None
    return span * fwd, bubble, peaks


def _stage_flags(v: int, n_virtual: int) -> tuple[bool, bool]:
    return v == 0, v == n_virtual - 1


def plan_layout(
    shape,
    layout: Layout,
    training: Training,
    hw: Hardware,
    count_params: ParamCounter,
    *,
    world_size: int | None = None,
) -> Plan:
    """The per-rank-class memory, traffic and time of ``layout`` (module docstring)."""
    moe = MoE.moe_shape(shape)  # MoE models: experts over ep, all-to-all, active FLOPs (parallel/plan/moe.py)
    shape = ModelShape.of(shape)
    m = check(shape, layout, training, world_size)
    MoE.check_ep(moe, layout.dp, layout.ep, layout.sequence_parallel, layout.cp)
    L, t, dp, pp, vpp = layout, layout.tp, layout.dp * layout.cp, layout.pp, layout.vpp  # ZeRO spans dp × cp
    local = local_shape(shape, L.cp)  # what one cp rank holds of each sample (parallel/plan/cp.py)
    e = M.PRECISION_BYTES[training.precision]
    c = M.comm_bytes(training.precision, training.comm_dtype)
    sp, ckpt, mb = L.sequence_parallel, training.checkpointing, training.micro_batch
    ranges = layer_partition(shape, pp, vpp, L.pp_layers)
    gpn = hw.gpus_per_node
    # compute as each rank sees it with the host's other ranks busy too (0 slowdown on GPU profiles)
    colocated = min(layout.world_size, gpn)
    work_hw = C.colocated(hw, colocated)
    peak_flops = work_hw.peak_flops(training.precision) * work_hw.efficiency  # large GEMMs: cp's ring overlap (plan.cp)
    stage_info, alike = [], {}  # stages with the same chunk shapes share their numbers
    for s in range(pp):
        chunks = [(v, ranges[v]) for v in range(s, pp * vpp, pp)]
        key = tuple((len(r), MoE.moe_layers_in(moe, r)) + _stage_flags(v, pp * vpp) for v, r in chunks)
        if key not in alike:
            alike[key] = _stage_numbers(shape, chunks, count_params, work_hw, training, L, m, peak_flops, moe)
        params, tp_axis, cp_axis, fwd, bwd, acts, flops_s, ep_axis = alike[key]
        tp_axis, ep_axis = tp_axis.copy(), ep_axis.copy()  # stages alike share the numbers, not the ledger
        stage_info.append((chunks, params, (tp_axis, cp_axis, ep_axis), fwd, bwd, acts, flops_s))
    # the slowest stage paces the pipeline; p2p of one activation between stages
    p2p_axis_proto = AxisTraffic(pp, group_crosses_node(t * dp, pp, gpn))
    act_msg = e * mb * local.seq_len * shape.d_model / (t if sp else 1)
    slow_f = max(i[3] for i in stage_info) / vpp
    slow_b = max(i[4] for i in stage_info) / vpp
    p2p_fixed = (hw.latency_us + hw.collective_overhead_us) * 1e-6  # per message: latency and host cost
    p2p_one = (act_msg / hw.bandwidth(p2p_axis_proto.crosses_node) + p2p_fixed) if pp > 1 else 0.0
    p2p_one = PIPELINE_P2P.exposed(p2p_one, slow_f)  # exposed: the executor awaits receives before computing
    makespan, bubble, peaks = pipeline_time(L.schedule, pp, m, vpp, slow_f, slow_b, p2p_one)
    if vpp == 1 and L.schedule in ("gpipe", "1f1b"):  # faster stages fill and drain the pipeline faster
        makespan -= uneven_stages_saving([i[3] + i[4] for i in stage_info])
        bubble = 1 - m * (slow_f + slow_b) / makespan
    ranks, dp_exposed, offload_exposed, optimizer_s = [], 0.0, 0.0, 0.0
    scalars_tp_pp = 0.0  # the step's scalars on the tp and pp groups (the norm, the loss's broadcast)
    dp_exposed_unread = scalars_tp_pp_unread = 0.0  # the same for a step nobody reads
    norm_always = norm_every_step(training.grad_clip, training.precision, L.offload)
    for s, (chunks, params, (tp_axis, cp_axis, ep_axis), fwd, bwd, acts, flops_s) in enumerate(stage_info):
        params, experts = MoE.ep_split(params, L.ep)  # experts: E/ep per rank, ZeRO over edp = dp·cp/ep
        psi = M.zero_padded_numel(params, dp, training.bucket_mb * 2**20, e, per_unit=policy(L.zero).gathers_per_unit)
        states = M.model_state_bytes(psi, L.zero, dp, training.precision, training.optimizer, L.offload)
        edp = dp // L.ep
        per_unit = policy(L.zero).gathers_per_unit
        epsi = M.zero_padded_numel(experts, edp, training.bucket_mb * 2**20, e, per_unit) if experts.numel else 0
        if epsi:
            e_states = M.model_state_bytes(epsi, L.zero, edp, training.precision, training.optimizer, L.offload)
            states = {k: v + e_states[k] for k, v in states.items()}
        shard = psi // dp if policy(L.zero).shards_optimizer else psi
        shard += epsi // edp if policy(L.zero).shards_optimizer else epsi
        offload_s = O.offload_seconds(shard, e, L.offload, hw, m, fwd, bwd)
        extras = M.zero_extra_reduce_counts(params, training.bucket_mb * 2**20, e, per_unit)  # one call per bucket
        if sp and t > 1 and params.replicated:  # ZeRO sums them after the DP reduction: its fp32 shard
            sp_shard = M.padded(params.replicated, dp) // (dp if policy(L.zero).shards_optimizer else 1)
            tp_axis.add(
                "all_reduce",
                sp_shard * 4,
                1,
                hw,
                "sequence-parallel parameter gradients (fp32 shard)",
                calls=extras["tp"],
            )
        scalars = tp_axis.add("all_reduce", 4, 1, hw, "gradient norm (fp32 scalar)")
        dp_axis = AxisTraffic(dp, group_crosses_node(t, dp, gpn))
        counts = M.zero_bucket_counts(params, training.bucket_mb * 2**20, e, per_unit)  # one collective each
        if counts is not None:  # the engine's buckets: per block (ZeRO-3), then the rest
            buckets, units, root_calls = sum(counts), max(1, sum(counts[:-1])), counts[-1]  # a middle stage: no rest
        else:  # classes unknown: the rank packed as one class, ZeRO-3's blocks one bucket each
            buckets, units, root_calls = (
                max(1, -(-psi * e // int(training.bucket_mb * 2**20))),
                sum(len(r) for _, r in chunks),
                1,
            )
        reductions = max(buckets, units) if per_unit else buckets
        root_psi = M.zero_padded_numel(M.StageParams(0, root=params.root), dp, training.bucket_mb * 2**20, e)
        dp_times = dp_traffic(
            hw,
            dp_axis,
            psi=psi,
            zero=L.zero,
            micro_batches=m,
            param_bytes=e,
            comm_bytes=c,
            compression=training.compression,
            topk_ratio=training.topk_ratio,
            regathered_psi=psi - root_psi,
            accumulate=training.zero_accumulate,
            buckets=buckets,
            units=units,
            root_calls=root_calls,
            first_unit_calls=counts[0] if counts is not None and len(counts) > 1 else None,
            unit_count=len(counts) - 1 if counts is not None and len(counts) > 1 else None,
            overlap=training.overlap,
        )
        edp_axis = dp_axis if L.ep == 1 else AxisTraffic(edp, group_crosses_node(t * L.ep, edp, gpn))
        if epsi:  # expert gradients (and stage-3 gathers) on edp, hidden behind the same backward
            e_times = dp_traffic(
                hw,
                edp_axis,
                psi=epsi,
                zero=L.zero,
                micro_batches=m,
                param_bytes=e,
                comm_bytes=c,
                regathered_psi=epsi,
                accumulate=training.zero_accumulate,
            )
            dp_times = {k: v + e_times[k] for k, v in dp_times.items()}
            if not policy(L.zero).shards_optimizer:  # stage 0: each ep rank's experts enter the norm
                scalars_ep = ep_axis.add("all_reduce", 4, 1, hw, "expert gradient norm (fp32 scalar)")
        # the step's scalars: the loss averaged over DP; the gradient norm summed over DP when sharded.
        # They follow backward, so nothing hides them.
        # An unread step (parallel.engine.PendingLoss) issues no loss scalar, and no norm unless
        # norm_every_step: read_only_s is what a logged step adds.
        n_scalars = 1 + policy(L.zero).shards_optimizer
        dp_one = dp_axis.add("all_reduce", 4, n_scalars, hw, "loss and gradient norm (fp32 scalars)")
        norm_dp = (n_scalars - 1) * dp_one + (scalars_ep if epsi and not policy(L.zero).shards_optimizer else 0.0)
        scalars_s = STEP_SCALARS.exposed(dp_one + norm_dp, 0.0)
        read_only_dp = STEP_SCALARS.exposed(dp_one + (0.0 if norm_always else norm_dp), 0.0)
        exposed_dp = _exposed_dp_time(dp_times, m, fwd, bwd, training.overlap, reductions, hw.overlap_fraction)
        dp_exposed = max(dp_exposed, exposed_dp + scalars_s)
        dp_exposed_unread = max(dp_exposed_unread, exposed_dp + scalars_s - read_only_dp)
        if L.offload == "none":  # offloaded, the step runs on the host: offload_seconds prices it
            optimizer_s = max(optimizer_s, C.optimizer_seconds(shard, work_hw))
        pp_axis = AxisTraffic(pp, p2p_axis_proto.crosses_node)
        sends = sum(int(v < pp * vpp - 1) + int(v > 0) for v, _ in chunks)
        pp_axis.add("p2p", act_msg, sends * m, hw, "activations and gradients to neighbour stages")
        loss_pp = pp_axis.add("broadcast", 4, 1, hw, "loss from the last stage (fp32 scalar)")
        scalars += pp_axis.add("all_reduce", 4, 1, hw, "gradient norm (fp32 scalar)")  # scalars: the norm's
        read_only = loss_pp + (0.0 if norm_always else scalars)
        scalars += loss_pp
        scalars_tp_pp = max(scalars_tp_pp, STEP_SCALARS.exposed(scalars, 0.0))  # after backward: exposed
        scalars_tp_pp_unread = max(scalars_tp_pp_unread, STEP_SCALARS.exposed(scalars - read_only, 0.0))
        emb_axis = AxisTraffic(2 if params.shared_embedding and pp > 1 else 1, pp_axis.crosses_node)
        emb_shard = M.padded(params.shared_embedding, dp) // (
            dp if policy(L.zero).shards_optimizer else 1
        )  # as for SP: its fp32 shard
        emb_axis.add(
            "all_reduce", emb_shard * 4, 1, hw, "tied embedding gradient (fp32 shard)", calls=extras["embedding"]
        )
        in_flight = peaks[s]
        # transients (they do not coincide: the loss's end before the recomputed layers' backward)
        recompute = M.recompute_peak_bytes(
            local, mb, checkpointing=ckpt, tp=t, sequence_parallel=sp, precision=training.precision
        )
        has_head = any(v == pp * vpp - 1 for v, _ in chunks)
        loss = M.loss_temporary_bytes(local, mb, tp=t, precision=training.precision) if has_head else 0.0
        activations = in_flight * max(acts) + max(recompute, loss)
        buffers = _buffer_bytes(dataclasses.replace(L, dp=dp), training, params, experts, count_params, act_msg, e, c)
        mem = {
            **{k: float(v) for k, v in states.items() if k != "total"},
            "model_states": float(states["total"]),
            "activations": activations,
            "buffers": buffers,
        }
        mem["total"] = mem["model_states"] + activations + buffers
        host_ok = O.host_fits(mem.get("host", 0.0), min(gpn, layout.world_size), hw)
        traffic = {
            name: a.as_dict()
            for name, a in (("dp", dp_axis), ("tp", tp_axis), ("pp", pp_axis), ("embedding", emb_axis))
        }
        traffic["cp"] = cp_axis.as_dict()
        if moe is not None:  # MoE: the all-to-alls (exposed) and the experts' gradients over edp
            traffic["ep"] = ep_axis.as_dict()
            if L.ep > 1:
                traffic["edp"] = edp_axis.as_dict()
        ranks.append(
            RankClass(
                stage=s,
                layers=[(r.start, r.stop) for _, r in chunks],
                params=params + experts,
                memory=mem,
                in_flight=in_flight,
                activation_per_microbatch=sum(acts),
                forward_s=fwd,
                backward_s=bwd,
                compute_s=m * flops_s,
                traffic=traffic,
                fits=mem["total"] <= hw.memory_bytes and host_ok,
            )
        )
        offload_exposed = max(offload_exposed, offload_s["exposed_s"])
    emb_time = STEP_SCALARS.exposed(max(r.traffic["embedding"]["time_s"] for r in ranks), 0.0)  # after backward
    overhead_s = C.step_overhead_seconds(work_hw)  # the step's fixed host cost (0 on GPU profiles)
    step_time = makespan + dp_exposed + emb_time + scalars_tp_pp + offload_exposed + optimizer_s + overhead_s
    unread = makespan + dp_exposed_unread + emb_time + scalars_tp_pp_unread + offload_exposed + optimizer_s + overhead_s
    compute = max(r.compute_s for r in ranks)
    comm_total = max(sum(a["time_s"] for a in r.traffic.values()) for r in ranks)
    tokens_step = training.global_batch * shape.seq_len
    mfpt = MoE.flops_per_token(moe) if moe else model_flops_per_token(shape)  # MoE: active parameters
    step = {
        "step_time_s": step_time,  # a logged step (read: the loss and norm scalars); the dry run's step
        "unread_step_time_s": unread,  # a step nobody reads (recipes/training/trainer.py: most steps)
        "read_extra_s": step_time - unread,  # what reading a step adds
        "pipeline_s": makespan,
        "bubble_fraction": bubble,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": optimizer_s,
        "step_overhead_s": overhead_s,
        "scalars_s": emb_time + scalars_tp_pp,  # tp/pp norm, loss broadcast, tied embedding (dp's in dp_exposed)
        "colocated_factor": C.colocated_factor(hw, colocated),
        "offload_s": offload_exposed,
        "tokens_per_s": tokens_step / step_time,
        "mfu": tokens_step * mfpt / step_time / (layout.world_size * hw.peak_flops(training.precision)),
        "compute_s": compute,
        "comm_s": comm_total,
        "compute_comm_ratio": compute / comm_total if comm_total else float("inf"),
        "model_flops_per_token": mfpt,
        "tflops_per_gpu": tokens_step * mfpt / step_time / layout.world_size / 1e12,
    }
    if moe is not None:
        counts = MoE.param_counts(moe)
        step.update(params_total=counts["total"], params_active=counts["active"])
    plan = Plan(
        model=asdict(shape),
        layout=asdict(layout),
        training=asdict(training),
        hardware=asdict(hw),
        grad_accum=m,
        ranks=ranks,
        step=step,
    )
    plan.advice = advise(plan, shape, hw)
    return plan


def _stage_numbers(shape, chunks, count_params, hw, training, L, m, peak_flops, moe=None):
    """Parameters, TP and CP traffic, per-micro-batch forward/backward seconds, activations per
    chunk, the step's compute seconds and the ep traffic of a rank holding ``chunks``."""
    t, sp, ckpt, mb = L.tp, L.sequence_parallel, training.checkpointing, training.micro_batch
    e = M.PRECISION_BYTES[training.precision]
    local = local_shape(shape, L.cp)  # activations and TP messages: s/cp tokens; FLOPs: those tokens over all s
    params = M.StageParams(0)
    tp_axis = AxisTraffic(t, group_crosses_node(1, t, hw.gpus_per_node))
    cp_axis = AxisTraffic(L.cp, group_crosses_node(t, L.cp, hw.gpus_per_node))
    fwd = bwd = flops_s = 0.0
    acts = []
    layer = C.layer_time(local, mb, t, sp, hw, training.precision, training.attention)
    if L.cp > 1:  # each cp rank's s/cp queries attend over all s keys: cp × the local square
        layer = dataclasses.replace(
            layer, attention=layer.attention * L.cp, attention_backward=layer.attention_backward * L.cp
        )
    moe_layer = MoE.layer_time(moe, layer, local, mb, t, hw, training.precision) if moe else layer
    ep_axis = AxisTraffic(L.ep, group_crosses_node(t * L.cp, L.ep, hw.gpus_per_node))
    for v, r in chunks:
        first, last = _stage_flags(v, L.pp * L.vpp)
        params = params + count_params(r, first, last, t)
        n, n_moe = len(r), MoE.moe_layers_in(moe, r)
        head = C.head_time(local, mb, t, hw, training.precision) if last else C.LayerTime(0.0, 0.0, 0.0)
        blocks_f = (n - n_moe) * layer.forward + n_moe * moe_layer.forward
        blocks_b = (n - n_moe) * layer.backward + n_moe * moe_layer.backward
        recompute = {"full": blocks_f, "selective": n * layer.attention}.get(ckpt, 0.0)
        tf, tb, (regather, scatter) = tp_traffic(
            local, tp_axis, hw, n_layers=n, has_embedding=first, has_head=last, mb=mb, m=m, e=e, sp=sp, ckpt=ckpt
        )
        cf, cb = cp_traffic(
            shape, cp_axis, hw, n_layers=n, mb=mb, m=m, e=e, tp=t, ckpt=ckpt, impl=L.cp_impl, peak_flops=peak_flops
        )
        ef, eb = (
            (0.0, 0.0)
            if not n_moe
            else MoE.ep_traffic(moe, ep_axis, hw, n_moe=n_moe, tokens=mb * local.seq_len, m=m, e=e, checkpointing=ckpt)
        )  # exposed: the MoE layer waits for its exchanges
        if n_moe:  # cp > 1: the router statistics summed over the cp group
            sf, sb = MoE.cp_stats_traffic(moe, cp_axis, hw, n_moe=n_moe, m=m, checkpointing=ckpt)
            cf, cb = cf + sf, cb + sb
        f_s = blocks_f + head.forward
        b_s = blocks_b + head.backward + recompute
        fwd += f_s + TP_COLLECTIVES.exposed(tf, n * layer.gemm) + cf + ef  # exposed: TP collectives block
        column = n * layer.column_gemm  # input-gradient matmuls hide the re-gathers, weight-gradient ones the scatters
        sp_b = TP_SP_BACKWARD.exposed(regather, column) + TP_SP_BACKWARD.exposed(scatter, column)
        sp_b = partly_hidden(regather + scatter, sp_b, hw.overlap_fraction)
        bwd += b_s + TP_COLLECTIVES.exposed(tb, 2 * n * layer.gemm) + sp_b + cb + eb
        flops_s += f_s + b_s
        acts.append(
            M.stage_activation_bytes(
                local,
                mb,
                len(r),
                has_embedding=first,
                has_head=last,
                tp=t,
                sequence_parallel=sp,
                checkpointing=ckpt,
                precision=training.precision,
            )
            + len(r) * extra_activation_bytes(shape, mb, cp=L.cp, tp=t, impl=L.cp_impl, checkpointing=ckpt, e=e)
            + (n_moe and n_moe * MoE.activation_bytes(moe, local, mb, tp=t, checkpointing=ckpt, e=e, ep=L.ep))
        )
    return params, tp_axis, cp_axis, fwd, bwd, acts, flops_s, ep_axis


def norm_every_step(grad_clip: float, precision: str, offload: str) -> bool:
    """Whether every step computes the gradient norm (its scalar collectives), read or not: the
    engine (``parallel.zero.engine.ZeroDataParallel.step``) skips it on an unread step only without
    clipping (``grad_clip`` 0), without fp16's loss scaler and without offload (its host step reads
    the skip flag). tests/parallel/plan/test_engine_buffers.py holds this against a real engine."""
    return grad_clip > 0 or precision == "fp16" or offload != "none"


def partly_hidden(comm_s: float, exposed_s: float, fraction: float) -> float:
    """Seconds exposed when compute hides only ``fraction`` of what the overlap table hides
    (``Hardware.overlap_fraction``): ``exposed + (1 − fraction)·(comm − exposed)``."""
    return exposed_s + (1.0 - fraction) * max(0.0, comm_s - exposed_s)


def _unmeasured(fraction: float, measured_s: float, comm_s: float) -> float:
    """``fraction`` of the hideable seconds that compute hides when ``measured_s`` of ``comm_s`` were
    measured net of overlap already (hidden: none of them): ``fraction · (1 − measured/comm)``."""
    if comm_s <= 0.0 or measured_s <= 0.0:
        return fraction
    return fraction * max(0.0, 1.0 - measured_s / comm_s)


def _exposed_dp_time(
    dp: dict, m: int, fwd: float, bwd: float, overlap: bool, reductions: int = 1, fraction: float = 1.0
) -> float:
    """DP seconds compute cannot hide, as :mod:`parallel.overlap`'s rows say: gradient reductions
    (``DP_REDUCTION``, with ``overlap``) under the backward — stages 0–1 the last micro-batch's,
    stages 2–3 every one's — sharing it with stage 3's backward gathers (``ZERO3_GATHER``,
    prefetched whatever ``overlap``); stage 3's forward gathers under the forward; the all-gather
    after the optimizer step (``PARAM_GATHER_AFTER_STEP``) exposed. The gradients are reduced as
    ``reductions`` collectives (buckets; ZeRO-3's units), each launched when its last gradient is
    ready: the last one's starts when backward ends, so at least that ``1/reductions`` share is
    exposed whatever the overlap (one bucket: all of it). Compute hides only ``fraction`` of the rest
    (:func:`partly_hidden`), and none of the seconds priced with a measured ``ahead_call_us``
    (``measured_per_mb``, ``measured_per_step``: stage 3's calls launched ahead of their wait,
    :meth:`parallel.plan.traffic.AxisTraffic.add`): calibration measured those as what is left exposed
    after overlap (``recipes.tools.calibrate.fit_launched_ahead``), so their share of what the overlap table
    hides stays exposed; with no measured cost (the GPU profiles) nothing changes."""
    last = 1.0 / max(1, reductions)
    per_mb = max(
        exposed_sharing(
            bwd, (DP_REDUCTION, dp["grad_per_mb"]), (ZERO3_GATHER, dp["param_bwd_per_mb"]), overlap=overlap
        ),
        last * dp["grad_per_mb"],
    ) + ZERO3_GATHER.exposed(dp["param_fwd_per_mb"], fwd, overlap)
    comm = dp["grad_per_mb"] + dp["param_bwd_per_mb"] + dp["param_fwd_per_mb"]
    per_mb = partly_hidden(comm, per_mb, _unmeasured(fraction, dp.get("measured_per_mb", 0.0), comm))
    once = max(DP_REDUCTION.exposed(dp["grad_per_step"], bwd, overlap), last * dp["grad_per_step"])
    step_fraction = _unmeasured(fraction, dp.get("measured_per_step", 0.0), dp["grad_per_step"])
    once = partly_hidden(dp["grad_per_step"], once, step_fraction)
    return m * per_mb + once + PARAM_GATHER_AFTER_STEP.exposed(dp["param_after_step"], 0.0, overlap)


def _buffer_bytes(
    L: Layout, tr: Training, params: M.StageParams, experts: M.StageParams, count, act_msg, e, c
) -> float:
    """Communication buffers, as the engine allocates them: stages 2–3's gradient reductions in flight
    (:func:`parallel.zero.packing.reduction_buffer_bytes`, of the rank's real buckets), stage 0–1's
    wire copies of every bucket in a 16-bit wire dtype
    (:func:`parallel.zero.packing.comm_copy_bytes`), stage 3's gathered units (the block whose forward or
    backward runs and ZERO3_PREFETCH_UNITS prefetched, each its padded buckets; the rest, gathered
    from the first forward to the optimizer step), Top-K's fp32 residual and gathered values, four
    p2p messages, and unsharded accumulation's full fp32 gradient."""
    pol, bucket_bytes = policy(L.zero), tr.bucket_mb * 2**20
    edp = max(1, L.dp // L.ep)
    dense = M.zero_bucket_numels(params, L.dp, bucket_bytes, e, pol.gathers_per_unit)
    expert = M.zero_bucket_numels(experts, edp, bucket_bytes, e, pol.gathers_per_unit) if experts.numel else ()
    total = 0.0
    if L.dp > 1 and pol.shards_grads:
        if dense is None:  # classes unknown: the rank as buckets of at most bucket_bytes
            cap = M.padded(max(1, min(params.numel, int(bucket_bytes // e))), L.dp)
            sizes, groups = [cap] * -(-params.numel // cap), L.dp
        else:  # dense buckets sharded over DP, experts' over expert DP
            sizes = [n for unit in dense for n in unit] + [n for unit in expert or () for n in unit]
            groups = [L.dp] * sum(map(len, dense)) + [edp] * sum(map(len, expert or ()))
        sends_acc = tr.zero_accumulate == "unsharded" and c == GRAD_BYTES
        total += reduction_buffer_bytes(sizes, c, groups, sends_accumulator=sends_acc, overlap=tr.overlap)
    elif L.dp > 1 and tr.compression != "topk":  # stages 0-1: every bucket's wire copy until step()
        if dense is None:
            sizes = [M.padded(params.numel, L.dp), M.padded(experts.numel, edp) if experts.numel else 0]
        else:
            sizes = [n for unit in dense + (expert or ()) for n in unit]
        total += comm_copy_bytes(sizes, c)
    if pol.gathers_per_unit and L.dp > 1:
        if dense is None:
            total += (1 + ZERO3_PREFETCH_UNITS) * e * MoE.at_ep(count(range(0, 1), False, False, L.tp), L.ep).numel
        else:
            per_unit = [sum(u) for u in dense[:-1]]
            experts_unit = [sum(u) for u in expert[:-1]] if expert else [0]
            if tr.overlap:  # the block computing and the prefetched ones
                total += e * (1 + ZERO3_PREFETCH_UNITS) * (max(per_unit, default=0) + max(experts_unit, default=0))
            else:  # a block is freed only when backward ends (ZeroDataParallel._end_of_backward): all gathered
                total += e * (sum(per_unit) + sum(experts_unit))
            total += e * sum(dense[-1])  # the rest: gathered once per step, held until the optimizer step
    if tr.compression == "topk":
        total += 4 * params.numel + L.dp * topk_kept(params.numel, tr.topk_ratio) * (c + INDEX_BYTES)
    if L.pp > 1:
        total += 4 * act_msg
    total += accumulation_grad_bytes((params + experts).numel, L.zero, tr.zero_accumulate)  # the full fp32 gradient
    return total
