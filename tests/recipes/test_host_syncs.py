"""Host synchronisations per training step (issue 12 §2), counted on a real multi-rank step.

On a GPU every ``.item()``/``.tolist()``/``nonzero``/``float(tensor)`` stalls the
stream until the device catches up. :class:`parallel.testing.HostSyncCounter`
counts them around ``Trainer.train_step`` on gloo ranks (TP=2 and PP=2, so the
vocabulary-parallel embedding and cross-entropy and the pipeline all run).

Before issue 12: 2 reads per micro-batch (token ids, targets) + 1 per
cross-entropy backward (``nonzero``) + 3 per step (norm, skip, loss).
Now: none per micro-batch; per step at most the loss/norm read of a *logged*
step (``read=True``: one) and, with a non-fused optimizer (the CPU path),
the skip decision (one); with torch's fused AdamW (the trainer's GPU path) the
skip is decided on the device: zero reads on an unlogged step.
"""

import pytest
import torch

from parallel.testing import HostSyncCounter, run_ranks
from recipes.config import RecipeConfig

from .test_train_e2e import tiny_recipe


def _count(rc: RecipeConfig, run_dir: str, fused: bool):
    from recipes.trainer import Trainer

    trainer = Trainer(rc, run_dir)
    if fused:  # what the trainer builds on a GPU, here on the CPU: AdamW with a device-side skip
        opt = trainer.zero.optimizer
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
        trainer.zero.optimizer = torch.optim.AdamW(groups, fused=True)
    trainer.train_step(0)  # warm up: the optimizer state exists
    counts = {}
    for read in (False, True):
        with HostSyncCounter() as syncs:
            rec = trainer.train_step(1 + read, read=read)
        counts[read] = syncs.calls
    return counts, torch.is_tensor(rec["loss"])


@pytest.mark.parametrize("fused", [False, True])
def test_host_reads_per_step_are_the_minimum(tmp_path, fused):
    rc = tiny_recipe(dp=1, pp=2, tp=2, zero=1, train__micro_batch=2, train__global_batch=8)
    for counts, loss_is_tensor in run_ranks(_count, 4, rc, str(tmp_path), fused, timeout=240):
        assert not loss_is_tensor  # read=True: the logged record holds numbers
        skip_read = {} if fused else {"__bool__": 1}  # the skip decision of a non-fused optimizer
        assert counts[False] == skip_read, counts  # an unlogged step: 4 micro-batches, no read
        assert counts[True] == {"tolist": 1, **skip_read}, counts  # a logged step: one read more
