"""Host synchronisations per training step (issue 12 §2), counted on a real multi-rank step.

On a GPU every ``.item()``/``.tolist()``/``nonzero``/``float(tensor)`` stalls the
stream until the device catches up. :class:`parallel.testing.HostSyncCounter`
counts them around ``Trainer.train_step`` on gloo ranks (TP=2 and PP=2, so the
vocabulary-parallel embedding and cross-entropy and the pipeline all run).

Before issue 12: 2 reads per micro-batch (token ids, targets) + 1 per
cross-entropy backward (``nonzero``) + 3 per step (norm, skip, loss).
Now: none per micro-batch; per step at most the loss/norm read of a *logged*
step (``read=True``: one) and, with a non-fused optimizer, the skip decision
(one); with torch's fused AdamW (what the trainer builds on CPU and GPU) the
skip is decided on the device. An unlogged step that does not clip computes no
norm at all (issue 17), so it reads nothing with either optimizer; one that clips
reads the skip flag only with a non-fused optimizer.
"""

import pytest
import torch

from parallel.testing import HostSyncCounter, run_ranks
from recipes.config import RecipeConfig

from .test_train_e2e import tiny_recipe


def _count(rc: RecipeConfig, run_dir: str, fused: bool):
    from recipes.training.trainer import Trainer

    trainer = Trainer(rc, run_dir)
    # fused: what the trainer builds (AdamW with a device-side skip); else the foreach loop
    opt = trainer.engine.zero.optimizer
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
    kind = {"fused": True} if fused else {"foreach": True}
    trainer.engine.zero.optimizer = torch.optim.AdamW(groups, **kind)
    trainer.train_step(0)  # warm up: the optimizer state exists
    counts = {}
    for read in (False, True):
        with HostSyncCounter() as syncs:
            rec = trainer.train_step(1 + read, read=read)
        counts[read] = syncs.calls
    return counts, torch.is_tensor(rec["loss"])


@pytest.mark.parametrize("fused,clip", [(False, 0.0), (True, 0.0), (False, 1.0)])
def test_host_reads_per_step_are_the_minimum(tmp_path, fused, clip):
    rc = tiny_recipe(dp=1, pp=2, tp=2, zero=1, train__micro_batch=2, train__global_batch=8, train__grad_clip=clip)
    for counts, loss_is_tensor in run_ranks(_count, 4, rc, str(tmp_path), fused, timeout=240):
        assert not loss_is_tensor  # read=True: the logged record holds numbers
        skip_read = {} if fused else {"__bool__": 1}  # the skip decision of a non-fused optimizer
        unlogged = skip_read if clip else {}  # no clipping: an unlogged step computes no norm
        assert counts[False] == unlogged, counts  # an unlogged step: 4 micro-batches
        assert counts[True] == {"tolist": 1, **skip_read}, counts  # a logged step: one read more


def _fused_skip():
    """bf16 ZeRO-1 with fused AdamW: an inf gradient on rank 1 skips the step on the device."""
    import torch.distributed as dist
    from torch import nn

    from parallel.zero import ZeroConfig, ZeroDataParallel
    from tests.parallel.zero.toy import batches, make_model

    model = make_model()
    zdp = ZeroDataParallel(
        model,
        ZeroConfig(stage=1, precision="bf16"),
        dp_group=dist.group.WORLD,
        optimizer_factory=lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
    )
    ((x, y),) = batches(1)

    def step(poison: bool):
        hook = None
        if poison and dist.get_rank() == 1:
            hook = zdp.module.head.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
        zdp.backward(nn.functional.mse_loss(zdp(x).float(), y))
        if hook:
            hook.remove()
        with HostSyncCounter() as syncs:
            stats = zdp.step()
        return stats, syncs.total

    step(False)  # the optimizer state exists
    snapshot = lambda: (
        [b.master.clone() for b in zdp.buckets],
        [{k: v.clone() for k, v in zdp.optimizer.state[b.master].items()} for b in zdp.buckets],
    )
    masters, states = snapshot()
    bad, bad_reads = step(True)
    after_masters, after_states = snapshot()
    unchanged = all(torch.equal(a, b) for a, b in zip(masters, after_masters)) and all(
        torch.equal(s[k], t[k]) for s, t in zip(states, after_states) for k in s
    )
    good, _ = step(False)
    changed = not all(torch.equal(a, b.master) for a, b in zip(masters, zdp.buckets))
    return bool(bad["skipped"]), bad_reads, unchanged, bool(good["skipped"]), changed


def test_fused_optimizer_skips_a_non_finite_step_on_the_device_without_changing_anything():
    for skipped, reads, unchanged, good_skipped, changed in run_ranks(_fused_skip, 2, timeout=120):
        assert skipped and reads == 0 and unchanged  # weights, moments and step count as they were
        assert not good_skipped and changed
