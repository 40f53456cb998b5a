"""Context parallelism in the planner. A cp rank holds ``s/cp`` tokens of each sample, so everything
sized by the sequence is that of the local shape (:func:`local_shape`); its queries still attend over
the whole sequence. Traffic comes from the layer's own byte formulas
(:func:`parallel.layers.ring_attention.ring_bytes`, ``ulysses_bytes``), at the attention's head widths
(multi-head latent attention: q and k ``nope + rope`` wide over every head, v ``v_head_dim``); a ring hop hides behind one
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
    against all ``s`` keys (``2·H·(qk + v)`` per query-key pair; ``4·d`` when both widths are ``d/H``)."""
    qk, v = shape.qk_v_head_dims
    return micro_batch * local_seq_len(shape.seq_len, cp) * 2 * shape.seq_len * shape.n_heads * (qk + v) / tp


def extra_activation_bytes(shape, micro_batch: int, dims: ParallelDims, *, checkpointing: str, e: int) -> float:
    """What a layer saves beyond the local shape's :func:`~parallel.plan.memory.layer_activation_bytes`:
    under Ulysses without recomputation a second copy of the attention output (``e·b·(s/cp)·H·v/t``) and the
    two int64 index vectors that reorder the gathered sequence (``16·s``); the ring nothing."""
    if not dims.ulysses or checkpointing != "none":
        return 0.0
    out_width = shape.n_heads * shape.qk_v_head_dims[1]
    return e * micro_batch * dims.local_seq_len * out_width / dims.tp + 16 * shape.seq_len


def cp_traffic(
    shape, axis: AxisTraffic, hw: Hardware, dims: ParallelDims, *, n_layers, mb, m, e, ckpt, peak_flops
) -> tuple[float, float]:
    """The cp group's traffic of a chunk of ``n_layers`` layers (``axis`` accumulates all ``m``
    micro-batches' bytes); returns the seconds per micro-batch (forward, backward) compute does not hide."""
    cp, tp = axis.group_size, dims.tp
    if cp == 1 or n_layers == 0:
        return 0.0, 0.0
    s_local, kv_heads, (hd, v) = dims.local_seq_len, shape.attention_kv_heads // tp, shape.qk_v_head_dims
    recompute = ckpt in ("selective", "full")
    count = n_layers * m
    if dims.ulysses:
        u = ulysses_bytes(mb, shape.n_heads // tp, kv_heads, s_local, hd, cp, e, v_head_dim=v)
        payload = u["forward"] / 4 * cp / (cp - 1)  # one of the four all-to-alls (their mean), as its buffer
        fwd = 4 * axis.add("all_to_all", payload, 4 * count, hw, "Ulysses q, k, v in and output back (forward)")
        bwd = 4 * axis.add("all_to_all", payload, 4 * count, hw, "Ulysses gradients (backward)")
        if recompute:  # selective: q, k, v again, not the output (the checkpoint stops once its saved tensors are back)
            n, out = (4, 0.0) if ckpt == "full" else (3, mb * s_local * shape.n_heads // tp * v * e)
            again = (4 * payload - out) / n
            bwd += n * axis.add("all_to_all", again, n * count, hw, "Ulysses recomputation")
        return n_layers * fwd, n_layers * bwd
    rb = ring_bytes(mb, kv_heads, s_local, hd, cp, e, v_head_dim=v)
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
