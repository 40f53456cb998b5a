"""fp16 through ``StepEngine``: ZeRO owns the loss scale, applying it once and removing it once.

The scale grows every clean step here (``growth_interval=1``), so a loss or gradient that kept
the scale, or lost it twice, would be off by a growing power of two: the logged loss must follow
the fp32 one-process trajectory within fp16's rounding, at one process and at dp=2 × pp=2.
"""

from __future__ import annotations

import pytest

from examples import pipeline_pieces as ex
from parallel.testing import run_ranks

STEPS = 4
START_SCALE = 2.0**10


def _fp16_steps(dp: int, pp: int):
    import torch.distributed as dist

    from parallel.engine import StepEngine
    from parallel.groups import build_groups
    from parallel.layers.cross_entropy import vocab_parallel_cross_entropy
    from parallel.topology import Topology
    from parallel.zero import ZeroConfig
    from parallel.zero.scaler import DynamicLossScaler

    groups = build_groups(Topology(dp, pp, 1, world_size=dist.get_world_size()))
    first, blocks, last = ex.build_pieces()
    engine = StepEngine.from_pieces(
        first,
        blocks,
        last,
        loss_fn=lambda logits, targets: vocab_parallel_cross_entropy(logits.float(), targets).mean(),
        pp_group=groups.pp,
        microbatches=ex.GLOBAL_BATCH // dp // ex.MICRO_BATCH,
        dp_group=groups.dp,
        activation_shape=(ex.MICRO_BATCH, ex.SEQ, ex.D_MODEL),
        zero=ZeroConfig(stage=1, precision="fp16", grad_clip=1e9),  # clipping reads the unscaled norm
        optimizer_factory=ex.optimizer,
        loss_scaler=DynamicLossScaler(scale=START_SCALE, growth_interval=1, hysteresis=1),
        compute_dtype=__import__("torch").float16,
    )
    losses, scales, norms = [], [], []
    for step in range(STEPS):
        x, y = ex.global_batch(step)
        rows = slice(groups.dp_rank * ex.GLOBAL_BATCH // dp, (groups.dp_rank + 1) * ex.GLOBAL_BATCH // dp)
        rec = engine.step(list(x[rows].split(ex.MICRO_BATCH)), list(y[rows].split(ex.MICRO_BATCH)))
        losses.append(float(rec["loss"]))
        scales.append(rec["loss_scale"])
        norms.append(float(rec["grad_norm"]))
        assert not bool(rec["skipped"])
    return losses, scales, norms


def test_fp16_loss_scale_is_applied_and_removed_once():
    single = ex.train_one_process()[:STEPS]  # fp32, one process
    one = run_ranks(_fp16_steps, 1, 1, 1, timeout=180)
    grid = run_ranks(_fp16_steps, 4, 2, 2, timeout=180)
    for losses, scales, norms in one + grid:
        assert losses == pytest.approx(single, rel=2e-2)  # fp16 rounding, not a power of two
        assert scales == [START_SCALE * 2.0 ** (i + 1) for i in range(STEPS)]  # grew after every clean step
        # the unscaled norm of the whole model (scaled it would be ≥ 2^10 times larger; one stage's, smaller),
        # clip_groups not given: the engine sums the norm over the pipeline itself
        assert norms == pytest.approx(one[0][2], rel=2e-2)
    assert all(r == grid[0] for r in grid)  # every rank logs the same step
