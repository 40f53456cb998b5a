"""What each ZeRO stage does, in one table (see docs/architecture.md, "ZeRO").

=====  ==========  ==========  ==========  =============================  ===============================
stage  optimizer   gradients   parameters  gradient reduction             parameters gathered
=====  ==========  ==========  ==========  =============================  ===============================
0      replicated  replicated  replicated  all-reduce, once per step      never (every rank holds all)
1      sharded     replicated  replicated  reduce-scatter, once per step  all-gather after the step
2      sharded     sharded     replicated  reduce-scatter, every m-batch  all-gather after the step
3      sharded     sharded     sharded     reduce-scatter, every m-batch  per unit for fwd and bwd, freed
=====  ==========  ==========  ==========  =============================  ===============================

The engine, its buckets and the theory read these named properties, never the stage number.
"""

from __future__ import annotations

from dataclasses import dataclass

ZERO_STAGES = (0, 1, 2, 3)  # the one home of the stage numbers (config: parallel.zero)


@dataclass(frozen=True)
class StagePolicy:
    """One ZeRO stage's behaviour.

    ``shards_optimizer`` / ``shards_grads`` / ``shards_params``: each rank keeps only its 1/N
    shard of the optimizer state, the accumulated gradient, the parameters between uses.
    ``reduce``: the gradient collective (``all_reduce`` or ``reduce_scatter``).
    ``reduce_every_microbatch``: the gradient is reduced into the shard after each micro-batch
    (so a full-size gradient never outlives one backward).
    ``gathers_after_step``: the updated parameter shards are all-gathered once after the step.
    ``gathers_per_unit``: parameters are gathered per unit for forward and backward, then freed.
    """

    stage: int
    shards_optimizer: bool
    shards_grads: bool
    shards_params: bool
    reduce: str
    reduce_every_microbatch: bool
    gathers_after_step: bool
    gathers_per_unit: bool


POLICIES = {
    0: StagePolicy(0, False, False, False, "all_reduce", False, False, False),
    1: StagePolicy(1, True, False, False, "reduce_scatter", False, True, False),
    2: StagePolicy(2, True, True, False, "reduce_scatter", True, True, False),
    3: StagePolicy(3, True, True, True, "reduce_scatter", True, False, True),
}
assert tuple(POLICIES) == ZERO_STAGES


def policy(stage: int) -> StagePolicy:
    """The :class:`StagePolicy` of ``stage``; ``ValueError`` outside :data:`ZERO_STAGES`."""
    if stage not in POLICIES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    return POLICIES[stage]
