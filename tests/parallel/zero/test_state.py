"""Optimizer state: gathered whole it equals one process's; it reshards to another DP size and stage."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroConfigError, ZeroDataParallel

from .toy import BATCH, adamw, batches, make_model, reference_param_groups, reference_run


def _numpy(tree):
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return tree.numpy() if torch.is_tensor(tree) else tree


def _torch(tree):
    if isinstance(tree, dict):
        return {k: _torch(v) for k, v in tree.items()}
    return torch.from_numpy(tree) if hasattr(tree, "dtype") and not isinstance(tree, float) else tree


def _zdp(stage):
    model = make_model()
    return ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, bucket_mb=0.0005),
        dp_group=dist.group.WORLD,
        optimizer_factory=adamw,
        units=list(model.blocks),
    )


def _steps(zdp, first, last):
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = BATCH // dp
    for x, y in batches()[first:last]:
        zdp.backward(nn.functional.mse_loss(zdp(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]))
        zdp.step()


def _save(stage, steps):
    zdp = _zdp(stage)
    _steps(zdp, 0, steps)
    return _numpy(zdp.full_state_dict())


def _resume(stage, full, first):
    zdp = _zdp(stage)
    zdp.load_full_state_dict(_torch(full))
    _steps(zdp, first, 10)
    return _numpy(zdp.full_parameters())


def _reference_state(steps):
    model = make_model()
    opt = adamw(reference_param_groups(model))
    for x, y in batches()[:steps]:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step(), opt.zero_grad()
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: s for p, s in opt.state.items()}


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_state_equals_one_process_and_reshards_from_dp2_to_dp4(stage):
    full = run_ranks(_save, 2, stage, 3)[0]
    for name, ref in _reference_state(3).items():
        got = _torch(full["optimizer"][name])
        assert float(got["step"]) == float(ref["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[key], ref[key], atol=1e-6, rtol=1e-5)
    # resume at another DP size and stage: the run continues as if never interrupted
    _, _, ref_params = reference_run()
    for params in run_ranks(_resume, 4, {1: 3, 3: 1}[stage], full, 3):
        for name, p in ref_params.items():
            torch.testing.assert_close(torch.from_numpy(params[name]), p, atol=1e-5, rtol=0)


def _per_rank_roundtrip():
    zdp = _zdp(2)
    _steps(zdp, 0, 3)
    saved = zdp.state_dict()
    fresh = _zdp(2)
    fresh.load_state_dict(saved)
    _steps(fresh, 3, 10)
    other = _zdp(1)
    try:
        other.load_state_dict(saved)
        refused = ""
    except ZeroConfigError as e:
        refused = str(e)
    return _numpy(fresh.full_parameters()), refused


def test_per_rank_state_round_trips_and_refuses_another_layout():
    _, _, ref_params = reference_run()
    for params, refused in run_ranks(_per_rank_roundtrip, 2):
        for name, p in ref_params.items():
            torch.testing.assert_close(torch.from_numpy(params[name]), p, atol=1e-5, rtol=0)
        assert "stage 2 dp 2" in refused and "stage 1 dp 2" in refused and "reshard" in refused


def _shard_cover(stage):
    zdp = _zdp(stage)
    owned = {}
    for shard in zdp.shards():
        assert shard.master.numel() == shard.hi - shard.lo and shard.master.dtype == torch.float32
        for slot, p in zip(shard.slots, shard.params):
            lo, hi = max(slot.offset, shard.lo), min(slot.end, shard.hi)
            owned[slot.name] = owned.get(slot.name, 0) + max(0, hi - lo)
            assert tuple(p.shape) == slot.shape
        assert zdp.shard_optimizer_state(shard) == {}  # no state before the first step
        shard.master.fill_(0.5)  # a load writes the masters, then publishes them
    zdp.publish_masters()
    return owned, all(bool((p == 0.5).all()) for p in zdp.module.parameters()) if stage < 3 else None


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_public_shard_view_covers_every_parameter_once_over_the_dp_group_and_publishes(stage):
    """The checkpoint interface (shards / shard_optimizer_state / publish_masters): at stage 0 every
    rank owns every element; from stage 1 the DP ranks' shards partition each parameter."""
    results = run_ranks(_shard_cover, 2, stage, timeout=60)
    numels = {n: p.numel() for n, p in make_model().named_parameters()}
    total = {n: sum(r[0].get(n, 0) for r in results) for n in numels}
    assert total == {n: numels[n] * (2 if stage == 0 else 1) for n in numels}
    assert all(r[1] for r in results)
