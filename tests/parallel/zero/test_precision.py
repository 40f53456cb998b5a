"""Mixed precision: bf16 trains, fp16 overflow on one rank skips the step on all."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.testing import run_ranks
from parallel.zero import DynamicLossScaler, ZeroConfig, ZeroDataParallel

from .toy import adamw, batches, make_model


def _zdp(stage, precision, optimizer_factory=adamw, loss_scaler=None, **settings):
    model = make_model()
    return ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, precision=precision, **settings),
        dp_group=dist.group.WORLD,
        optimizer_factory=optimizer_factory,
        units=list(model.blocks),
        loss_scaler=loss_scaler,
    )


def _my_half(t):
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = t.shape[0] // dp
    return t[rank * per : (rank + 1) * per]


def _overfit(precision, steps=10):
    ((x, y),) = batches(1)
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
    ((x, y),) = batches(1)
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


class _Recorder(torch.optim.Optimizer):
    """Keeps the gradient ZeRO hands the optimizer (this rank's fp32 shard), changes nothing."""

    def __init__(self, groups):
        super().__init__(groups, {})
        self.seen = []

    def step(self, closure=None):
        self.seen = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def _accumulated_grads(micro, comm_dtype):
    dp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 16, generator=g), torch.randn(2, generator=g)) for _ in range(micro * dp)]
    # the reference: every micro-batch's bf16 gradient (the same bf16 weights, the same kernels), summed in fp64
    ref_model = make_model().to(torch.bfloat16)
    ref = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in ref_model.named_parameters()}
    for x, y in data:
        ref_model.zero_grad()
        (nn.functional.mse_loss(ref_model(x.to(torch.bfloat16)).float(), y) / micro).backward()
        for n, p in ref_model.named_parameters():
            ref[n] += p.grad.double()
    errors = {}
    for stage in range(4):
        zdp = _zdp(stage, "bf16", comm_dtype=comm_dtype, optimizer_factory=_Recorder)
        for m in range(micro):
            x, y = data[rank * micro + m]
            with zdp.no_sync() if m < micro - 1 else torch.enable_grad():
                zdp.backward(nn.functional.mse_loss(zdp(x).float(), y) / micro)
        zdp.step()
        got, want = [], []
        for b, grad in zip(
            [b for b in zdp.buckets if b.layout.weight_decay] + [b for b in zdp.buckets if not b.layout.weight_decay],
            zdp.optimizer.seen,
        ):
            flat = torch.zeros(b.layout.padded_numel, dtype=torch.float64)
            for s in b.layout.slots:
                flat[s.offset : s.end] = ref[s.name].reshape(-1) / dp
            got.append(grad.double())
            want.append(flat[b.lo : b.hi])
        got, want = torch.cat(got), torch.cat(want)
        errors[stage] = float((got - want).norm() / want.norm())
    return errors


def test_bf16_gradients_accumulate_over_24_micro_batches_in_fp32():
    """Issue 12 §3.3: accumulated in bf16, 24 micro-batches drift ~5e-3 from the fp32 sum; the fp32
    main gradient (and the default fp32 wire) leave only fp32 rounding."""
    for errors in run_ranks(_accumulated_grads, 2, 24, None, timeout=120):
        assert all(e < 1e-5 for e in errors.values()), errors
    # bf16 on the wire, asked for: one bf16 rounding of the accumulated sum, still no accumulation drift
    for errors in run_ranks(_accumulated_grads, 2, 24, "bf16", timeout=120):
        assert all(e < 4e-3 for e in errors.values()), errors
