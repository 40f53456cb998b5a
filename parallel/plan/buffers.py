"""The communication buffers one rank allocates, as the engine allocates them."""

from __future__ import annotations

from ..overlap import ZERO3_PREFETCH_UNITS
from ..zero.compression import INDEX_BYTES
from ..zero.packing import comm_copy_bytes, reduction_buffer_bytes
from ..zero.policy import policy
from ..zero.theory import GRAD_BYTES, accumulation_grad_bytes
from . import memory as M
from . import moe as MoE
from .inputs import Setup
from .traffic import topk_kept


def buffer_bytes(ctx: Setup, params: M.StageParams, experts: M.StageParams) -> float:
    """Communication buffers, as the engine allocates them: stages 2–3's gradient reductions in flight
    and stages 0–1's wire copies (:mod:`parallel.zero.packing`, of the rank's real buckets), stage 3's
    gathered units (the computing and the prefetched ones; the rest, from the first forward to the step),
    Top-K's residual and gathered values, four p2p messages, unsharded accumulation's fp32 gradient."""
    L, tr, e, c, dp, edp = ctx.dims, ctx.tr, ctx.e, ctx.c, ctx.zdp, ctx.edp
    pol, bucket_bytes = policy(L.zero), ctx.bucket
    dense = M.zero_bucket_numels(params, dp, bucket_bytes, e, pol.gathers_per_unit)
    expert = M.zero_bucket_numels(experts, edp, bucket_bytes, e, pol.gathers_per_unit) if experts.numel else ()
    total = 0.0
    if dp > 1 and pol.shards_grads:
        if dense is None:  # classes unknown: the rank as buckets of at most bucket_bytes
            cap = M.padded(max(1, min(params.numel, int(bucket_bytes // e))), dp)
            sizes, groups = [cap] * -(-params.numel // cap), dp
        else:  # dense buckets sharded over DP, experts' over expert DP
            sizes = [n for unit in dense for n in unit] + [n for unit in expert or () for n in unit]
            groups = [dp] * sum(map(len, dense)) + [edp] * sum(map(len, expert or ()))
        sends_acc = L.accumulate == "unsharded" and c == GRAD_BYTES
        total += reduction_buffer_bytes(sizes, c, groups, sends_accumulator=sends_acc, overlap=tr.overlap)
    elif dp > 1 and not L.compression_enabled:  # stages 0-1: every bucket's wire copy until step()
        if dense is None:
            sizes = [M.padded(params.numel, dp), M.padded(experts.numel, edp) if experts.numel else 0]
        else:
            sizes = [n for unit in dense + (expert or ()) for n in unit]
        total += comm_copy_bytes(sizes, c)
    if pol.gathers_per_unit and dp > 1:
        if dense is None:
            total += (1 + ZERO3_PREFETCH_UNITS) * e * MoE.at_ep(ctx.count(range(0, 1), False, False, L.tp), L.ep).numel
        else:
            per_unit = [sum(u) for u in dense[:-1]]
            experts_unit = [sum(u) for u in expert[:-1]] if expert else [0]
            if tr.overlap:  # the block computing and the prefetched ones
                total += e * (1 + ZERO3_PREFETCH_UNITS) * (max(per_unit, default=0) + max(experts_unit, default=0))
            else:  # a block is freed only when backward ends (ZeroDataParallel._end_of_backward): all gathered
                total += e * (sum(per_unit) + sum(experts_unit))
            total += e * sum(dense[-1])  # the rest: gathered once per step, held until the optimizer step
    if L.compression_enabled:
        total += 4 * params.numel + dp * topk_kept(params.numel, tr.topk_ratio) * (c + INDEX_BYTES)
    if L.pp > 1:
        total += 4 * ctx.act_msg
    total += accumulation_grad_bytes((params + experts).numel, L.zero, L.accumulate)  # the full fp32 gradient
    return total
