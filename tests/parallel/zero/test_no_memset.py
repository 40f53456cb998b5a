"""No per-step memset of the gradient buffers (issue 34 item 3), and gradient accumulation still exact.

A step's first gradient of each slot is written into ``flat_grad`` / ``grad_shard``, later ones added;
only what no gradient reached (an unused parameter) is zeroed, just before it is read. The first test
counts every ``fill_`` / ``zero_`` (and ``zeros``) a step dispatches and fails on one over a bucket's
gradient buffer; the second compares each rank's reduced gradient, step by step under accumulation,
with one process's over the global batch — with a parameter used only by a later micro-batch, then
by none (a stale value from the step before would show), then by all.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel

from .toy import BATCH, D, Toy, adamw, batches

MICRO = 4
FILLS = {"fill_", "zero_", "zeros", "zeros_like", "new_zeros"}


class FillCounter(TorchDispatchMode):
    """Elements written by fills, in total and over the given storages (a bucket's gradient buffers)."""

    def __init__(self, storages):
        super().__init__()
        self.storages = storages
        self.total = self.on_buckets = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in FILLS:
            t = out if torch.is_tensor(out) else args[0]
            self.total += t.numel()
            if t.untyped_storage().data_ptr() in self.storages:
                self.on_buckets += t.numel()
        return out


class SometimesExtra(Toy):
    """The toy model with one more layer that a micro-batch uses only when told (``extra``)."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(D, D)

    def forward(self, x, extra: bool = True):
        x = self.inp(x)
        if extra:
            x = x + self.extra(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1)


def _engine(stage, **cfg):
    torch.manual_seed(0)
    model = SometimesExtra()
    zdp = ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, bucket_mb=cfg.pop("bucket_mb", 0.0005), **cfg),
        dp_group=dist.group.WORLD,
        optimizer_factory=adamw,
        units=list(model.blocks) if stage == 3 else None,
    )
    return zdp


def _accumulate(zdp, x, y, uses=(True,) * MICRO):
    """One step's micro-batches of this rank's slice of the global batch, under no_sync but the last."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = BATCH // dp
    xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    for i, (xm, ym, use) in enumerate(zip(xs.chunk(MICRO), ys.chunk(MICRO), uses)):
        with zdp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
            zdp.backward(nn.functional.mse_loss(zdp(xm, use), ym) / MICRO)


def _fills(stage, cfg):
    zdp = _engine(stage, **cfg)
    bufs = [t for b in zdp.buckets for t in (b.flat_grad, b.grad_shard) if t is not None]
    counts = []
    for x, y in batches(steps=3):
        storages = {t.untyped_storage().data_ptr() for t in bufs}
        with FillCounter(storages) as fc:
            _accumulate(zdp, x, y)
            zdp.step()
        counts.append((fc.on_buckets, fc.total))
    return counts, sum(p.numel() for p in zdp.module.parameters())


@pytest.mark.parametrize(
    "stage, cfg",
    [
        (0, {}),
        (1, {}),
        (1, dict(precision="bf16")),
        (2, {}),
        (2, dict(accumulate="unsharded")),
        (3, {}),
        (3, dict(accumulate="unsharded", precision="bf16")),
        (2, dict(offload="optimizer")),
    ],
    ids=["z0", "z1", "z1-bf16", "z2", "z2-unsharded", "z3", "z3-unsharded-bf16", "z2-offload"],
)
def test_no_step_zeroes_a_gradient_buffer(stage, cfg):
    for counts, psi in run_ranks(_fills, 2, stage, cfg, timeout=120):
        for step, (on_buckets, total) in enumerate(counts):
            assert on_buckets == 0, f"step {step}: {on_buckets} gradient-buffer elements zeroed"
            if step:  # after the first step (the optimizer's state is created zeroed): nothing gradient-sized
                assert total < psi / 10, f"step {step}: {total} elements filled, the model has {psi}"


def _grads_vs_one_process(stage, cfg):
    import parallel.zero.engine as zero_engine

    zdp = _engine(stage, **cfg)
    dtype = zdp.param_dtype
    ref = SometimesExtra().to(dtype)
    seen = []
    exact_sq = zero_engine.local_sq_norm
    zero_engine.local_sq_norm = lambda grads, ranges: seen.append([g.clone() for g in grads]) or exact_sq(grads, ranges)
    # a later micro-batch only, then no micro-batch (its slot must read 0, not last step's), then all
    uses = [(False, True, False, True), (False,) * MICRO, (True,) * MICRO, (True, False, True, False)]
    dp = dist.get_world_size()
    try:
        for (x, y), use in zip(batches(steps=len(uses)), uses):
            ref.load_state_dict(zdp.full_parameters())  # the same point of the trajectory
            want = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}  # fp32, as ZeRO accumulates
            for xr, yr in zip(x.chunk(dp), y.chunk(dp)):  # every rank's micro-batches, one by one
                for xm, ym, u in zip(xr.chunk(MICRO), yr.chunk(MICRO), use):
                    ref.zero_grad()
                    (nn.functional.mse_loss(ref(xm.to(dtype), u), ym) / MICRO).backward()
                    for n, p in ref.named_parameters():
                        if p.grad is not None:
                            want[n] += p.grad.float()
            _accumulate(zdp, x, y, use)
            zdp.step()
            for b, g in zip(zdp.buckets, seen.pop()):
                flat = torch.zeros(b.layout.padded_numel)
                for s in b.layout.slots:
                    flat[s.offset : s.end] = want[s.name].reshape(-1) / dp
                torch.testing.assert_close(g, flat[b.lo : b.hi], rtol=1e-5, atol=1e-7)
    finally:
        zero_engine.local_sq_norm = exact_sq


@pytest.mark.parametrize(
    "stage, cfg",
    [
        (0, {}),
        (1, {}),
        (2, {}),
        (2, dict(accumulate="unsharded")),
        (3, {}),
        (3, dict(accumulate="unsharded")),
        (1, dict(offload="optimizer")),
        (0, dict(overlap=False)),
        (1, dict(precision="bf16", bucket_mb=25)),
    ],
    ids=["z0", "z1", "z2", "z2-unsharded", "z3", "z3-unsharded", "z1-offload", "z0-no-overlap", "z1-bf16"],
)
def test_accumulated_gradients_equal_one_process(stage, cfg):
    run_ranks(_grads_vs_one_process, 2, stage, cfg, timeout=120)
