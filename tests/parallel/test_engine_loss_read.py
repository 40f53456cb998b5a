"""The step's loss collectives run only when the loss is read (issue 17).

An unread ``StepEngine.step(read=False)`` issues no loss collective; reading its record
later (:func:`parallel.engine.read_stats`) broadcasts the last stage's value over PP and
all-reduces it over DP, once, and gives the global-batch mean one process computes.
"""

from __future__ import annotations

import pytest

from examples import pipeline_pieces as ex
from parallel.testing import run_ranks

READS = (False, False, True, False)  # steps 1, 2 and 4 unread, step 3 read


def _steps(dp: int, pp: int):
    import torch.distributed as dist

    from parallel import comm
    from parallel.engine import PendingLoss, StepEngine, read_stats
    from parallel.groups import build_groups
    from parallel.layers.cross_entropy import vocab_parallel_cross_entropy
    from parallel.topology import Topology
    from parallel.zero import ZeroConfig

    groups = build_groups(Topology(dp, pp, 1, world_size=dist.get_world_size()))
    first, blocks, last = ex.build_pieces()
    engine = StepEngine.from_pieces(
        first,
        blocks,
        last,
        loss_fn=lambda logits, targets: vocab_parallel_cross_entropy(logits, targets).mean(),
        pp_group=groups.pp,
        microbatches=ex.GLOBAL_BATCH // dp // ex.MICRO_BATCH,
        dp_group=groups.dp,
        activation_shape=(ex.MICRO_BATCH, ex.SEQ, ex.D_MODEL),
        zero=ZeroConfig(stage=1, grad_clip=None),  # no clipping: an unread step needs no norm (issue 17)
        optimizer_factory=ex.optimizer,
    )
    recs, step_calls = [], []
    for step, read in enumerate(READS):
        x, y = ex.global_batch(step)
        rows = slice(groups.dp_rank * ex.GLOBAL_BATCH // dp, (groups.dp_rank + 1) * ex.GLOBAL_BATCH // dp)
        with comm.CallRecorder() as rec_calls:
            recs.append(
                engine.step(list(x[rows].split(ex.MICRO_BATCH)), list(y[rows].split(ex.MICRO_BATCH)), read=read)
            )
        step_calls.append([c.describe() for c in rec_calls.calls if c.op not in ("send", "recv")])
    assert [isinstance(r["loss"], PendingLoss) for r in recs] == [not r for r in READS]
    with comm.CallRecorder() as first_read:  # in step order on every rank, after the later steps
        losses = [read_stats(r)["loss"] for r in recs]
    with comm.CallRecorder() as second_read:
        again = [read_stats(r)["loss"] for r in recs]
    read_calls = [c.describe() for c in first_read.calls]
    return losses, again, step_calls, read_calls, len(second_read.calls)


@pytest.mark.parametrize("dp,pp", [(2, 2)])
def test_unread_steps_issue_no_loss_collective_and_read_later_as_one_process(dp, pp):
    single = ex.train_one_process()[: len(READS)]
    for losses, again, step_calls, read_calls, second in run_ranks(_steps, dp * pp, dp, pp, timeout=120):
        assert losses == pytest.approx(single, abs=1e-5)  # every rank, every step: the global-batch mean
        assert again == losses and second == 0  # a record is reduced once
        for read, calls in zip(READS, step_calls):
            scalars = [c for c in calls if c.startswith(("broadcast(1 ", "all_reduce(1 "))]
            # no clipping: an unread step has no scalar collective at all; a read one has the loss's two
            # (broadcast over PP, all-reduce over DP) beside the gradient norm's all-reduces
            assert (scalars == []) if not read else {"broadcast(1 × float32) on pp"} <= set(scalars), calls
            assert ("all_reduce(1 × float32) on dp" in scalars) == read, calls
        # reading the three unread records: for each, the pipeline's broadcast, then DP's all-reduce
        assert read_calls == ["broadcast(1 × float32) on pp", "all_reduce(1 × float32) on dp"] * 3
