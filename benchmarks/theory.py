"""What each suite row should send and idle, from first principles (pure functions).

Ring algorithms throughout: on a group of ``N`` ranks an all-reduce sends
``2ρ·B`` per rank and a reduce-scatter or all-gather ``ρ·B``, ``ρ = (N-1)/N``.
All figures are bytes sent per rank per optimizer step (the mean over ranks).
"""

from __future__ import annotations

from parallel.comm import SENT_FRACTION
from parallel.layers.cross_entropy import CE_ALL_REDUCE_BYTES_PER_TOKEN
from parallel.zero.policy import policy
from parallel.zero.theory import grad_reductions_per_step, step_sent_bytes


def bubble_fraction(pp: int, m: int, vpp: int = 1) -> float:
    """Idle share of a 1F1B step with ``m`` micro-batches over ``pp`` stages:
    ``(p-1)/(m+p-1)``; interleaving ``vpp`` chunks per rank shrinks the fill and
    drain to ``(p-1)/(v·m+p-1)``.

    >>> bubble_fraction(2, 8)
    0.1111111111111111
    """
    if min(pp, m, vpp) < 1:
        raise ValueError(f"pp, m and vpp must be ≥ 1, got pp={pp} m={m} vpp={vpp}")
    return (pp - 1) / (vpp * m + pp - 1)


def dp_bytes(
    psi: int,
    stage: int,
    dp: int,
    m: int,
    regathered_psi: int | None = None,
    param_bytes: int = 4,
    accumulate: str = "sharded",
) -> float:
    """ZeRO traffic on the DP group for one step of ``m`` accumulated micro-batches
    (fp32, ``psi`` parameters on this rank). Stages 0–1 communicate once per step;
    stage 2 reduce-scatters every micro-batch into its gradient shard and
    all-gathers the updated parameters once; stage 3 does its whole exchange
    (reduce-scatter, forward and backward all-gathers) every micro-batch, except
    that the parameters outside the blocks are gathered once per step; with
    ``accumulate="unsharded"`` stage 2's and 3's gradients are reduce-scattered once per step
    (:func:`parallel.zero.theory.grad_reductions_per_step`)."""
    pol = policy(stage)
    if not pol.reduce_every_microbatch:
        return step_sent_bytes(psi, stage, dp, param_bytes)
    rho = SENT_FRACTION["reduce_scatter"](dp)
    reductions = grad_reductions_per_step(stage, m, accumulate)
    if not pol.gathers_per_unit:
        return reductions * rho * psi * param_bytes + SENT_FRACTION["all_gather"](dp) * psi * param_bytes
    # blocks: reduce-scatter + forward and backward gathers every micro-batch; the rest (embedding,
    # head) is gathered once per step and stays until the optimizer step
    rest = 0 if regathered_psi is None else psi - regathered_psi
    skipped_reductions = m - reductions
    return (
        m * step_sent_bytes(psi, 3, dp, param_bytes, regathered_psi=regathered_psi)
        - (m - 1) * rho * rest * param_bytes
        - skipped_reductions * rho * psi * param_bytes
    )


def tp_bytes(
    tp: int, m: int, micro_batch: int, seq: int, d_model: int, layers: int, first: bool, last: bool, act_bytes: int = 4
) -> float:
    """Megatron TP traffic of one stage for ``m`` micro-batches: per micro-batch the
    embedding's all-reduce (2ρA) if ``first``, two all-reduces each way per block
    (8ρA), and if ``last`` the head input's backward all-reduce (2ρA) plus the
    vocabulary-parallel cross-entropy's three fp32 ``[b, s]`` all-reduces
    (max, sum of exponentials, target logit: 2ρ·12·b·s bytes) — the sum of
    ``TransformerStage``'s documented figures. ``A`` is one activation ``[b, s, d]``."""
    rho = SENT_FRACTION["reduce_scatter"](tp)  # an all-reduce sends 2ρ
    a = micro_batch * seq * d_model * act_bytes
    per_mb = rho * a * (8 * layers + (2 if first else 0) + (2 if last else 0))
    if last:
        per_mb += 2 * rho * CE_ALL_REDUCE_BYTES_PER_TOKEN * micro_batch * seq
    return m * per_mb


def pp_bytes(pp: int, m: int, micro_batch: int, seq: int, d_model: int, vpp: int = 1, act_bytes: int = 4) -> float:
    """Point-to-point traffic per rank of a pipeline of ``pp·vpp`` virtual stages:
    each of the ``pp·vpp − 1`` boundaries carries ``m`` activations forward and
    ``m`` gradients back, spread over ``pp`` ranks (the suite's steps are unread:
    no 4-byte loss broadcast, :class:`parallel.engine.PendingLoss`)."""
    a = micro_batch * seq * d_model * act_bytes
    return 2 * (pp * vpp - 1) * m * a / pp
