"""Context parallelism in the planner. A cp rank holds ``s/cp`` tokens of each sample, so everything
sized by the sequence is that of the local shape (:func:`local_shape`); its queries still attend over
the whole sequence. Traffic comes from the layer's own byte formulas
(:func:`parallel.layers.ring_attention.ring_bytes`, ``ulysses_bytes``); a ring hop hides behind one
block's attention (:data:`parallel.overlap.RING_ATTENTION`), Ulysses' all-to-alls do not.
"""

from __future__ import annotations

import dataclasses

from ..dims import ParallelDims, cp_seq_len_problem, local_seq_len
from ..layers.ring_attention import ring_bytes, ulysses_bytes
from ..overlap import RING_ATTENTION
from .hardware import Hardware
from .traffic import AxisTraffic


def local_shape(shape, cp: int):
    """The shape one cp rank sees: the same model on ``seq_len/cp`` tokens per sample."""
    return shape if cp == 1 else dataclasses.replace(shape, seq_len=local_seq_len(shape.seq_len, cp))


def attention_flops(shape, micro_batch: int, cp: int, tp: int) -> float:
    """Forward attention FLOPs (``QKᵀ`` and ``PV``) of one layer on one rank: its ``s/cp`` queries
    against all ``s`` keys."""
    return micro_batch * local_seq_len(shape.seq_len, cp) * 4 * shape.seq_len * shape.d_model / tp


def extra_activation_bytes(shape, micro_batch: int, dims: ParallelDims, *, checkpointing: str, e: int) -> float:
    """What a layer saves beyond the local shape's :func:`~parallel.plan.memory.layer_activation_bytes`:
    under Ulysses without recomputation a second copy of the attention output (``e·b·(s/cp)·h/t``) and the
    two int64 index vectors that reorder the gathered sequence (``16·s``); the ring nothing."""
    if not dims.ulysses or checkpointing != "none":
        return 0.0
    return e * micro_batch * dims.local_seq_len * shape.d_model / dims.tp + 16 * shape.seq_len


def cp_traffic(
    shape, axis: AxisTraffic, hw: Hardware, dims: ParallelDims, *, n_layers, mb, m, e, ckpt, peak_flops
) -> tuple[float, float]:
    """The cp group's traffic of a chunk of ``n_layers`` layers (``axis`` accumulates all ``m``
    micro-batches' bytes); returns the seconds per micro-batch (forward, backward) compute does not hide."""
    cp, tp = axis.group_size, dims.tp
    if cp == 1 or n_layers == 0:
        return 0.0, 0.0
    s_local, kv_heads, hd = dims.local_seq_len, shape.n_kv_heads // tp, shape.head_dim
    recompute = ckpt in ("selective", "full")
    count = n_layers * m
    if dims.ulysses:
        u = ulysses_bytes(mb, shape.n_heads // tp, kv_heads, s_local, hd, cp, e)
        payload = u["forward"] / 4 * cp / (cp - 1)  # one of the four all-to-alls, as its buffer
        fwd = 4 * axis.add("all_to_all", payload, 4 * count, hw, "Ulysses q, k, v in and output back (forward)")
        bwd = 4 * axis.add("all_to_all", payload, 4 * count, hw, "Ulysses gradients (backward)")
        if recompute:
            bwd += 4 * axis.add("all_to_all", payload, 4 * count, hw, "Ulysses recomputation")
        return n_layers * fwd, n_layers * bwd
    rb = ring_bytes(mb, kv_heads, s_local, hd, cp, e)
    kv, dkv = rb["kv"], rb["kv"] / e * 4
    block = attention_flops(shape, mb, cp, tp) / cp / peak_flops  # one ring step's compute, forward
    hop = axis.add("p2p", kv, (cp - 1) * count, hw, "ring K/V blocks (forward)")
    fwd = (cp - 1) * RING_ATTENTION.exposed(hop, block)
    hop_b = axis.add("p2p", kv, (cp - 1) * count, hw, "ring K/V blocks (backward)")
    hop_g = axis.add("p2p", dkv, (cp - 1) * count, hw, "ring dK/dV accumulators, fp32 (backward)")
    bwd = hop_g  # the last hop (dK/dV home) has no compute left to hide behind
    for step in range(cp):  # step t posts the next K/V (t < cp−1) and passes an accumulator on (t ≥ 2)
        bwd += RING_ATTENTION.exposed(hop_b * (step < cp - 1) + hop_g * (step >= 2), 2 * block)
    if recompute:
        axis.add("p2p", kv, (cp - 1) * count, hw, "ring K/V blocks (recomputation)")
        bwd += fwd
    return n_layers * fwd, n_layers * bwd


def cp_choices(shape, world_size: int, tp: int, gpus_per_node: int, *, min_local_seq: int = 1024) -> list[int]:
    """The cps :func:`~parallel.plan.search.recommend` tries at this tp: powers of two that divide the
    world after tp, fit the node beside tp, split the sequence and leave each rank ≥ ``min_local_seq`` tokens."""
    out, cp = [1], 2
    while tp * cp <= gpus_per_node and (world_size // tp) % cp == 0:
        if not cp_seq_len_problem(shape.seq_len, cp) and local_seq_len(shape.seq_len, cp) >= min_local_seq:
            out.append(cp)
        cp *= 2
    return out
