"""Mixed precision: bf16 trains, fp16 overflow on one rank skips the step on all."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.testing import run_ranks
from parallel.zero import DynamicLossScaler, ZeroDataParallel

from .toy import adamw, batches, make_model


def _zdp(stage, precision, **kw):
    model = make_model()
    return ZeroDataParallel(model, dp_group=dist.group.WORLD, stage=stage, optimizer_factory=adamw,
                            units=list(model.blocks), precision=precision, **kw)


def _my_half(t):
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = t.shape[0] // dp
    return t[rank * per:(rank + 1) * per]


def _overfit(precision, steps=10):
    (x, y), = batches(1)
    out = {}
    for stage in range(4):
        zdp = _zdp(stage, precision)
        losses = []
        for _ in range(steps):
            loss = nn.functional.mse_loss(zdp(_my_half(x)).float(), _my_half(y))
            zdp.backward(loss)
            zdp.step()
            losses.append(loss.item())
        dtypes = {p.dtype for p in zdp.module.parameters()}
        out[stage] = (losses, dtypes, {b.master.dtype for b in zdp.buckets})
    return out


def test_bf16_runs_on_bf16_params_with_fp32_master_and_the_loss_falls_like_fp32():
    fp32 = run_ranks(_overfit, 2, "fp32")[0]
    for stage, (losses, dtypes, masters) in run_ranks(_overfit, 2, "bf16")[0].items():
        assert dtypes == {torch.bfloat16} and masters == {torch.float32}
        assert losses[-1] < 0.2 * losses[0], losses
        # same trajectory as fp32 within bf16's rounding (8 bits of mantissa)
        assert losses == pytest.approx(fp32[stage][0], rel=0.1, abs=2e-3), (stage, losses, fp32[stage][0])


def _inject_inf(stage):
    (x, y), = batches(1)
    zdp = _zdp(stage, "fp16", loss_scaler=DynamicLossScaler(scale=2.0**10, hysteresis=1))
    before = {n: p.clone() for n, p in zdp.full_parameters().items()}
    head = zdp.module.head.weight  # from stage 1 on it lies in rank 1's shard only
    if dist.get_rank() == 1:  # only rank 1 overflows, in one element
        hook = head.register_hook(lambda g: g.index_fill(1, torch.tensor([g.shape[1] - 1]), float("inf")))
    zdp.backward(nn.functional.mse_loss(zdp(_my_half(x)).float(), _my_half(y)))
    bad = zdp.step()
    if dist.get_rank() == 1:
        hook.remove()
    unchanged = all(torch.equal(before[n], p) for n, p in zdp.full_parameters().items())
    zdp.backward(nn.functional.mse_loss(zdp(_my_half(x)).float(), _my_half(y)))
    good = zdp.step()
    changed = not all(torch.equal(before[n], p) for n, p in zdp.full_parameters().items())
    return bad, unchanged, good, changed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_inf_on_one_rank_skips_the_step_on_all_and_backs_off_the_scale(stage):
    for bad, unchanged, good, changed in run_ranks(_inject_inf, 2, stage):
        assert bad["skipped"] and unchanged and bad["loss_scale"] == 2.0**9
        assert not good["skipped"] and changed and good["loss_scale"] == 2.0**9
        assert good["grad_norm"] > 0 and good["grad_norm"] < float("inf")
