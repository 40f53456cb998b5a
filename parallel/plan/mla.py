"""What DeepSeek's multi-head latent attention (:mod:`parallel.layers.mla`, ``kv_lora_rank > 0``) saves for
backward, eager and compiled (the attention row of :mod:`.memory`'s table; docs/planner.md)."""

from __future__ import annotations

from .shape import ModelShape


def mla_activation_bytes(
    shape, sb: float, tp: int, e: int, checkpointing: str = "none", sp: int = 1, compiled: bool = False
) -> float:
    """What one MLA layer's attention saves for ``sb`` tokens on one TP rank: per head its query, its
    key, the expanded ``[k_nope, v]`` (v is a view of it), the core's output and ``o_proj``'s input (a
    copy: the heads are contiguous per head, not per token) — under ``selective`` the core's inputs and
    output only: the query, ``[k_nope, v]``, the output — and, replicated on every TP rank, each latent's
    fp32 norm input, normalised and weighted outputs and fp32 rstd; under sequence parallelism (``sp`` =
    tp) those of the rank's ``sb/sp`` tokens only. Eager keeps RoPE's fp32 cos/sin tables (not the rotary
    key: they multiply its fp32 copy), priced as ``4·rope`` per token (the tables' ``8·s·rope`` at
    micro-batch 2); under ``selective`` the recomputed core's rotary key instead: a view of the bf16
    down-projection output, which it keeps whole (``e·(kv_lora + rope)`` per token; in fp32 the latent
    norm's input is that output already, so ``4·rope`` more), or under sequence
    parallelism the gathered key (``e·sb·rope``, the whole sequence). ``compiled`` (the block one graph):
    the same per head (under ``selective`` the caller takes off ``o_proj``'s input, as for every compiled
    block); each latent's norm keeps its input in the compute dtype (the down-projection's output, the
    rotary key a view of it), its weighted output and rstd: RMSNorm's compiled rule; under ``selective``
    with sequence parallelism also the gathered rotary key."""
    shape = ModelShape.of(shape)
    qk, v = shape.qk_v_head_dims
    nope = shape.qk_nope_head_dim
    per_head = qk + nope + 2 * v if checkpointing == "selective" else 2 * qk + nope + 3 * v
    latents, rope = shape.q_lora_rank + shape.kv_lora_rank, shape.qk_rope_head_dim
    norms = 2 * e * latents + e * rope if compiled else (4 + 2 * e) * latents
    replicated = norms + 4 * (1 + bool(shape.q_lora_rank))
    if checkpointing == "selective" and sp > 1:  # the gathered rotary key, the recomputed core's input
        rotary = e * sb * rope
    elif compiled:
        rotary = 0.0
    elif checkpointing == "selective":  # the down-projection's output, of which the rotary key is a view
        rotary = e * sb * (rope + (shape.kv_lora_rank if e < 4 else 0))  # fp32: the norm's input holds it
    else:  # RoPE's cos/sin tables
        rotary = 4 * sb * rope / sp
    return e * sb * shape.n_heads * per_head / tp + sb * replicated / sp + rotary
