"""Bytes one rank sends per step on each axis, and how long that takes: a ring collective of kind ``k``
over N ranks sends :data:`parallel.comm.SENT_FRACTION`'s share of its payload in ``RING_STEPS[k]·(N−1)``
latency steps, at :meth:`Hardware.kind_bandwidth` (intra-node inside one node, inter-node otherwise).
Rank order is Megatron's (tp fastest, then cp, dp, pp).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..comm.counter import SENT_FRACTION
from ..layers.cross_entropy import CE_MAX_BYTES_PER_TOKEN, CE_SUMS_BYTES_PER_TOKEN
from ..overlap import DP_REDUCTION, ZERO3_GATHER
from ..precision import FP8_BYTES
from ..zero.compression import INDEX_BYTES, topk_count
from ..zero.policy import policy
from ..zero.theory import grad_reductions_per_step
from .hardware import Hardware, host_costs

RING_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "all_to_all": 1}  # × (N-1)


#: the collectives NCCL runs as rings (or pipelined chains): every rank's bytes travel the ring's links in turn
RING_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def group_crosses_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether ranks ``0, stride, …, (size−1)·stride`` (the first group of an axis) span >1 node."""
    return size > 1 and (size - 1) * stride // gpus_per_node > 0


def members_per_node(stride: int, size: int, gpus_per_node: int) -> int:
    """How many of ranks ``0, stride, …, (size−1)·stride`` share one node (1 when ``stride`` spans a node)."""
    return max(1, min(size, gpus_per_node // max(1, stride)))


def axis_traffic(stride: int, size: int, gpus_per_node: int) -> AxisTraffic:
    """The empty ledger of an axis whose first group is ranks ``0, stride, …, (size−1)·stride``."""
    crosses = group_crosses_node(stride, size, gpus_per_node)
    return AxisTraffic(size, crosses, per_node=members_per_node(stride, size, gpus_per_node))


@dataclass
class AxisTraffic:
    """One axis' traffic per step from one rank: ``bytes`` sent, ``time_s`` it takes."""

    group_size: int
    crosses_node: bool
    bytes: float = 0.0
    time_s: float = 0.0
    items: list[str] = field(default_factory=list)
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # kind → calls, seconds (all of them)
    measured_s: float = 0.0  # of the last add()'s time, the part priced with a measured ahead_call_us
    per_node: int = 1  # the group's members on one node: ring kinds leave it through as many NICs

    def as_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("measured_s", "per_node")}
        return {**out, "items": list(self.items), "by_kind": {k: dict(v) for k, v in self.by_kind.items()}}

    def copy(self) -> AxisTraffic:
        """An independent copy (its items and per-kind sums are not shared)."""
        return dataclasses.replace(self, items=list(self.items), by_kind={k: dict(v) for k, v in self.by_kind.items()})

    def add(
        self,
        kind: str,
        payload: float,
        count: float,
        hw: Hardware,
        what: str,
        calls: int = 1,
        blocking: int | None = None,
        launches: int | None = None,
    ) -> float:
        """Account ``count`` collectives of ``kind`` on ``payload`` bytes, each issued as ``calls`` that split
        it; return one's seconds: the bytes at the bandwidth, the ring's latency steps and ``collective_overhead_us``
        per ``blocking`` call (default all), per other call its latency steps or the host's ``ahead_call_us``
        once per ``launches``. :attr:`measured_s` then holds the part priced with ``ahead_call_us``."""
        n = self.group_size
        self.measured_s = 0.0
        if n <= 1 or count == 0 or payload == 0:
            return 0.0
        if kind == "p2p":
            sent, steps = payload, 1
        else:
            sent, steps = SENT_FRACTION[kind](n) * payload, RING_STEPS[kind] * (n - 1)
        calls = max(1, calls)
        blocking = calls if blocking is None else min(calls, max(0, blocking))
        ring, host = steps * hw.latency_us * 1e-6, host_costs(hw)
        n_ahead = calls - blocking
        if host.ahead_call_us > 0:  # measured on this host: once per launch of calls issued together
            ahead = min(n_ahead, n_ahead if launches is None else max(0, launches)) * host.ahead_call_us * 1e-6
        else:
            ahead = n_ahead * ring
        fixed = blocking * (ring + host.collective_overhead_us * 1e-6) + ahead
        wire = sent / hw.kind_bandwidth(kind, self.crosses_node, self.per_node if kind in RING_KINDS else 1)
        one = wire + fixed
        # ahead_call_us is measured net of overlap, bytes included (recipes.tools.calibrate_fit.fit_launched_ahead)
        self.measured_s = (wire * n_ahead / calls + ahead) if host.ahead_call_us > 0 and n_ahead else 0.0
        self.bytes += count * sent
        self.time_s += count * one
        kind_sum = self.by_kind.setdefault(kind, {"calls": 0.0, "seconds": 0.0})
        kind_sum["calls"] += count * calls
        kind_sum["seconds"] += count * one
        self.items.append(f"{what}: {count:g} × {kind} of {payload / 1e6:,.1f} MB")
        return one


topk_kept = topk_count  # one home: parallel.zero.compression (entries Top-K keeps, ceil(ratio·numel) ≥ 1)


#: what :func:`dp_traffic` returns: seconds of one collective of each kind, and the measured parts
DP_TIMES = ("grad_per_mb", "grad_per_step", "param_after_step", "param_fwd_per_mb", "param_bwd_per_mb")
DP_TIMES += ("measured_per_mb", "measured_per_step")


def dp_traffic(
    hw: Hardware,
    axis: AxisTraffic,
    *,
    psi: int,
    zero: int,
    micro_batches: int,
    param_bytes: int,
    comm_bytes: int,
    compression: str = "none",
    topk_ratio: float = 1.0,
    regathered_psi: int | None = None,
    accumulate: str = "sharded",
    buckets: int = 1,
    units: int = 1,
    root_calls: int = 1,
    first_unit_calls: int | None = None,
    unit_count: int | None = None,
    overlap: bool = True,
) -> dict[str, float]:
    """Gradient and parameter collectives on the DP group per step, as ZeRO's policy runs them: the
    reduction once per step or every micro-batch (Top-K at stage 0: an all-gather of values and indices),
    the gather after the step, stage 3's per-unit gathers before every forward and backward
    (``regathered_psi``) and the rest's once per step; issued as ``buckets``, ``units`` and ``root_calls``
    collectives, blocking on issue as :mod:`parallel.overlap` says. Returns :data:`DP_TIMES`."""
    m, n = micro_batches, axis.group_size
    other_units = None if unit_count is None else max(0, unit_count - 1)  # ZeRO-3: launched unit by unit
    out = dict.fromkeys(DP_TIMES, 0.0)
    pol = policy(zero)  # what the engine does at this stage (parallel/zero/policy.py)
    if pol.reduce == "all_reduce" and compression == "topk":
        k = topk_kept(psi, topk_ratio)
        one = axis.add(
            "all_gather", n * k * (comm_bytes + INDEX_BYTES), 1, hw, "Top-K gradients (values + int32 indices)"
        )
        out["grad_per_step"] = one
    else:
        calls = max(buckets, units) if pol.gathers_per_unit else buckets
        first = 1 if first_unit_calls is None else first_unit_calls
        ends_backward = first + root_calls if pol.gathers_per_unit and DP_REDUCTION.hidden(overlap) else None
        if grad_reductions_per_step(zero, m, accumulate) == 1:  # stages 0-1; ZeRO-2/3 accumulating unsharded
            out["grad_per_step"] = axis.add(
                pol.reduce, psi * comm_bytes, 1, hw, "gradients", calls, ends_backward, other_units
            )
            out["measured_per_step"] = axis.measured_s
        else:
            out["grad_per_mb"] = axis.add(
                pol.reduce, psi * comm_bytes, m, hw, "gradients, every micro-batch", calls, ends_backward, other_units
            )
            out["measured_per_mb"] = axis.measured_s
    if pol.gathers_after_step:
        out["param_after_step"] = axis.add("all_gather", psi * param_bytes, 1, hw, "updated parameters", buckets)
    if pol.gathers_per_unit:
        blocks = psi if regathered_psi is None else regathered_psi
        ahead = first if ZERO3_GATHER.hidden(overlap) else None  # prefetched: the first unit's block
        out["param_fwd_per_mb"] = axis.add(
            "all_gather", blocks * param_bytes, m, hw, "block parameters before forward", units, ahead, other_units
        )
        out["measured_per_mb"] += axis.measured_s
        out["param_bwd_per_mb"] = axis.add(
            "all_gather", blocks * param_bytes, m, hw, "block parameters before backward", units, ahead, other_units
        )
        out["measured_per_mb"] += axis.measured_s
        if psi > blocks:  # the rest (embedding, head) stays gathered from the first forward to the step
            out["param_after_step"] = axis.add(
                "all_gather",
                (psi - blocks) * param_bytes,
                1,
                hw,
                "parameters outside the blocks, once per step",
                root_calls,
            )
    return out


def fp8_amax_calls(shape, fp8: str, sp: bool, tokens: int) -> tuple[tuple[int, int, int, str], ...]:
    """One block's fp8 amax all-reduces on TP (:mod:`parallel.layers.fp8_linear`'s table):
    ``(forward calls, backward calls, bytes each, what)``; fp32 scales, 4 bytes each."""
    cols = 5 if shape.arch == "llama" else 4  # q, k, v and the MLP's column layers; 2 row layers
    if fp8 == "tensorwise":  # the SP inputs', every weight's, the row inputs'; backward the column dY's
        return ((2 * sp + cols + 2 + 2, cols, 4, "fp8 amax (tensorwise scales)"),)
    return (  # rowwise: per token and per feature where the reduced axis is split
        (2, cols, 4 * tokens, "fp8 amax (rowwise: row inputs forward, column dY backward, per token)"),
        (2, cols, 4 * shape.d_model, "fp8 amax (rowwise: row weights forward, column weights backward)"),
    )


def attention_tp_widths(shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A block attention's TP collectives by width: ``(column inputs, plain gathers)``. A column input is
    all-gathered forward, reduce-scattered and gathered again backward under SP (else its gradient is
    all-reduced); a plain gather (MLA's ``k_pe``) is all-gathered forward, reduce-scattered backward (else
    all-reduced backward). Plain attention: ``x`` (q, k, v share it). MLA (:mod:`parallel.layers.mla`): the
    up-projections' latents (the q latent, or ``x`` without one; the kv latent) and the rotary key."""
    if not shape.kv_lora_rank:
        return (shape.d_model,), ()
    return (shape.q_lora_rank or shape.d_model, shape.kv_lora_rank), (shape.qk_rope_head_dim,)


def tp_traffic(
    shape, axis: AxisTraffic, hw, *, n_layers, has_embedding, has_head, mb, m, e, sp, ckpt, fp8=None, mlp_layers=None
):
    """TP collectives of a chunk, as the layers issue them (``axis`` accumulates all ``m`` micro-batches'
    bytes): seconds per micro-batch (forward, backward, (re-gathers, reduce-scatters)), the last pair
    sequence parallel's asynchronous column-layer backward (:data:`parallel.overlap.TP_SP_BACKWARD`). Each
    call also costs ``tp_call_us`` (0 on GPU profiles), in the seconds but not in ``axis``. ``fp8`` (a
    recipe): its amax all-reduces (:func:`fp8_amax_calls`); tensorwise with SP the column layers' input
    all-gathers carry fp8 (1 byte an element). The attention's collectives: :func:`attention_tp_widths`;
    ``mlp_layers`` (default all ``n_layers``): the blocks whose MLP is TP-parallel (an MoE block's only
    with shared experts: its routed experts are replicated over TP)."""
    tokens = mb * shape.seq_len
    act = e * tokens * shape.d_model
    n_mlp = n_layers if mlp_layers is None else mlp_layers
    attn_cols, attn_plain = attention_tp_widths(shape)
    # (count, payload) of the column inputs and of the plain gathers, the attention's then the MLP's
    cols = [(n_layers, e * tokens * w) for w in attn_cols] + [(n_mlp, act)]
    plain = [(n_layers, e * tokens * w) for w in attn_plain]
    scale = FP8_BYTES / e if fp8 == "tensorwise" else 1  # the column layers' input all-gathers
    gathers = [(n, p * scale) for n, p in cols]
    rows = n_layers + n_mlp  # row layers: the attention's output, the MLP's

    calls_apart = [0.0]  # the calls of the collectives backward can hide: their cost cannot hide

    def op(kind, count, what, payload=act, hidable=False):  # hidable: the call costs go to bwd apart
        if not count or axis.group_size <= 1:
            return 0.0
        wire, calls = count * axis.add(kind, payload, count * m, hw, what), count * host_costs(hw).tp_call_us * 1e-6
        if hidable:
            calls_apart[0] += calls
            return wire
        return wire + calls

    def each(kind, pieces, what, hidable=False):
        return sum(op(kind, n, what, payload, hidable) for n, payload in pieces)

    regather = scatter = 0.0
    if sp:  # the row layers' all-gathers block; the column layers' input-gradient reduce-scatters do not
        fwd = each("all_gather", gathers + plain, "block forward (all-gather)")
        fwd += op("reduce_scatter", rows, "block forward (reduce-scatter)")
        bwd = op("all_gather", rows, "block backward (all-gather)")
        bwd += each("reduce_scatter", plain, "block backward (reduce-scatter, plain gathers)")
        scatter = each("reduce_scatter", cols, "block backward (reduce-scatter)", hidable=True)
        # the column layers saved their input's sequence chunk: gathered again in backward
        regather = each("all_gather", gathers, "block backward (column inputs, gathered again)", hidable=True)
        bwd += calls_apart[0]  # compute-side cost: what TP_SP_BACKWARD hides is the collectives' wait only
    else:
        fwd = op("all_reduce", rows, "block forward")
        bwd = each("all_reduce", cols + plain, "block backward")
    for f_calls, b_calls, payload, what in fp8_amax_calls(shape, fp8, sp, mb * shape.seq_len) if fp8 else ():
        fwd += op("all_reduce", f_calls * n_layers, what + ", forward", payload)
        bwd += op("all_reduce", b_calls * n_layers, what + ", backward", payload)
    if ckpt == "full":  # recomputation stops early (torch's non-reentrant checkpoint): the block's last
        # collective, the MLP's output reduction, is not redone
        if sp:  # an MoE block without shared experts redoes its attention's reduce-scatter all the same
            bwd += each("all_gather", gathers + plain, "recomputation (all-gather)")
            bwd += op("reduce_scatter", n_layers, "recomputation (reduce-scatter)")
        else:
            bwd += op("all_reduce", n_layers, "recomputation (attention output)")
    if has_embedding:
        fwd += op("reduce_scatter" if sp else "all_reduce", 1, "embedding forward")
        bwd += op("all_gather", 1, "embedding backward") if sp else 0.0
    if has_head:
        fwd += op("all_gather", 1, "head forward") if sp else 0.0
        bwd += op("reduce_scatter" if sp else "all_reduce", 1, "head input gradient")
        bwd += op("all_gather", 1, "head backward (input, gathered again)") if sp else 0.0
        # two calls: the max, then the sums (parallel.layers.cross_entropy)
        fwd += op("all_reduce", 1, "cross-entropy max", CE_MAX_BYTES_PER_TOKEN * tokens)
        fwd += op("all_reduce", 1, "cross-entropy sums", CE_SUMS_BYTES_PER_TOKEN * tokens)
    return fwd, bwd, (regather, scatter)
