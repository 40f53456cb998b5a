"""Bytes held and bytes sent per rank equal the ZeRO formulas; accumulation communicates once."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel, model_state_bytes, step_sent_bytes, topk_sent_bytes

from .toy import BATCH, adamw, batches, make_model, reference_run

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _zdp(stage, **kw):
    model = make_model()
    return ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, **kw),
        dp_group=dist.group.WORLD,
        optimizer_factory=adamw,
        units=list(model.blocks),
    )


def _one_step(zdp, x, y):
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = x.shape[0] // dp
    loss = nn.functional.mse_loss(zdp(x[rank * per : (rank + 1) * per]).float(), y[rank * per : (rank + 1) * per])
    zdp.backward(loss)
    return zdp.step()


def _held(precision):
    out = {}
    ((x, y),) = batches(1)
    for stage in range(4):
        zdp = _zdp(stage, precision=precision)
        _one_step(zdp, x, y)  # Adam's moments exist from the first step on
        psi = sum(b.layout.padded_numel for b in zdp.buckets)
        out[stage] = (zdp.held_bytes(), psi)
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_state_bytes_per_rank_equal_zero_formulas(precision):
    dp = 4
    for stage, (held, psi) in run_ranks(_held, dp, precision)[1].items():
        want = model_state_bytes(psi, stage, dp, param_bytes=BYTES[precision])
        assert held == pytest.approx(want, abs=0), (stage, held, want)
    if precision == "bf16":  # 2 + 4 + 12 bytes per parameter at stage 0: fp32 gradient accumulation
        assert model_state_bytes(1, 0, dp, param_bytes=2)["total"] == 18


def _sent(configs):
    ((x, y),) = batches(1)
    out = []
    for stage, comm_dtype, compression in configs:
        zdp = _zdp(stage, comm_dtype=comm_dtype, compression=compression, topk_ratio=0.05)
        counter = comm.CommCounter()
        with counter:
            _one_step(zdp, x, y)
        psi = sum(b.layout.padded_numel for b in zdp.buckets)
        in_units = sum(b.layout.padded_numel for b in zdp.buckets if b.layout.unit < len(zdp.units))
        out.append((counter.sent_bytes("world"), psi, in_units, [b.layout.padded_numel for b in zdp.buckets]))
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_bytes_sent_per_step_equal_ring_theory(dp):
    f = (dp - 1) / dp
    norm_allreduce = 2 * f * 4  # one fp32 scalar, stages 1-3
    configs = [(s, None, None) for s in range(4)] + [(0, "bf16", None), (0, None, "topk")]
    *plain, (half, *_), (topk, _, _, sizes) = run_ranks(_sent, dp, configs)[0]
    sent = dict(enumerate(plain))
    for stage, (got, psi, in_units, _) in sent.items():
        want = step_sent_bytes(psi, stage, dp, regathered_psi=in_units) + (norm_allreduce if stage else 0)
        assert got == pytest.approx(want, rel=1e-12), stage
    psi, in_units = sent[3][1], sent[3][2]  # only stage 3 buckets by unit
    assert sent[1][0] == pytest.approx(sent[0][0] + norm_allreduce)  # RS + AG = one all-reduce
    assert sent[3][0] / sent[0][0] == pytest.approx(1 + 0.5 * in_units / psi, rel=1e-3)  # ≈ 1.5×
    # bf16 on the wire halves stage 0's traffic
    assert half == pytest.approx(sent[0][0] / 2)
    # top-k: (N-1)·k·(4 + 4) bytes per bucket instead of 2(N-1)/N·n·4
    assert topk == pytest.approx(sum(topk_sent_bytes(n, 0.05, dp, 4) for n in sizes))
    assert topk < 0.05 * dp * 8 / (2 * 4) * sent[0][0] * 1.2


def _accumulate(stage, micro):
    dp, rank = dist.get_world_size(), dist.get_rank()
    zdp = _zdp(stage)
    counter = comm.CommCounter()
    losses = []
    for x, y in batches(3):
        per = BATCH // dp // micro
        mine = slice(rank * per * micro, (rank + 1) * per * micro)
        xs, ys = x[mine], y[mine]
        counter.reset()
        with counter:
            for m in range(micro):
                ctx = zdp.no_sync() if m < micro - 1 else torch.enable_grad()
                with ctx:
                    loss = nn.functional.mse_loss(zdp(xs[m * per : (m + 1) * per]), ys[m * per : (m + 1) * per])
                    zdp.backward(loss / micro)
            zdp.step()
        losses.append(loss.item())
    grad_calls = counter.calls("world", "all_reduce" if stage == 0 else "reduce_scatter")
    return {n: p.numpy() for n, p in zdp.full_parameters().items()}, grad_calls, len(zdp.buckets)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulating_four_micro_batches_equals_one_big_batch(stage):
    _, _, ref_params = reference_run(steps=3)
    for params, grad_calls, n_buckets in run_ranks(_accumulate, 2, stage, 4):
        for name, p in ref_params.items():
            torch.testing.assert_close(torch.from_numpy(params[name]), p, atol=1e-5, rtol=0)
        # stages 0-1 communicate gradients once per step; 2-3 once per micro-batch
        assert grad_calls == n_buckets * (1 if stage <= 1 else 4)


def _gathered_during_forward():
    zdp = _zdp(3)
    seen = []

    def gathered():  # units whose full parameters occupy memory (gathered, or prefetch in flight)
        return sorted(
            u for u, bs in enumerate(zdp._unit_buckets) if any(b.flat_param.untyped_storage().nbytes() for b in bs)
        )

    for block in zdp.module.blocks:  # runs after ZeRO's own pre-hook: this block is gathered
        block.register_forward_pre_hook(lambda *_: seen.append(gathered()))
    ((x, y),) = batches(1)
    _one_step(zdp, x, y)
    return seen, gathered(), len(zdp.units)


def test_stage3_holds_only_the_running_unit_its_prefetch_and_the_root():
    seen, after_step, n_units = run_ranks(_gathered_during_forward, 2)[0]
    root = n_units
    assert seen == [[0, 1, root], [1, 2, root], [2, root]]
    assert after_step == []


def _in_flight_before_backward_ends(stage, overlap):
    zdp = _zdp(stage, overlap=overlap)
    seen = []
    # the input layer's gradients are among the last of backward: by then later buckets are on the wire
    zdp.module.inp.weight.register_post_accumulate_grad_hook(
        lambda _: seen.append(sum(b._pending is not None for b in zdp.buckets))
    )
    ((x, y),) = batches(1)
    _one_step(zdp, x, y)
    return seen[0], len(zdp.buckets)


@pytest.mark.parametrize("stage", [0, 2])
def test_overlap_launches_bucket_collectives_during_backward(stage):
    in_flight, n_buckets = run_ranks(_in_flight_before_backward_ends, 2, stage, True)[0]
    assert 1 <= in_flight <= n_buckets  # launched, not yet waited for
    assert run_ranks(_in_flight_before_backward_ends, 2, stage, False)[0][0] == 0


class _Recomputed(nn.Module):
    """The toy with full activation recomputation: each block under a non-reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.toy = make_model()
        self.blocks = self.toy.blocks

    def forward(self, x):
        x = self.toy.inp(x)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return self.toy.head(x).squeeze(-1)


def _backward_gathers(recompute: bool):
    model = _Recomputed() if recompute else make_model()
    zdp = ZeroDataParallel(
        model, ZeroConfig(stage=3), dp_group=dist.group.WORLD, optimizer_factory=adamw, units=list(model.blocks)
    )
    n_units = len(zdp.units)
    peak = [0]

    def sample(*_):  # block units whose full parameters occupy memory now (gathered or gather in flight)
        held = sum(any(b.flat_param.untyped_storage().nbytes() for b in bs) for bs in zdp._unit_buckets[:n_units])
        peak[0] = max(peak[0], held)

    for p in zdp.module.parameters():
        p.register_hook(sample)  # before each gradient is accumulated
    for block in zdp.module.blocks:
        block.register_forward_pre_hook(sample)  # in backward: the recomputation, after ZeRO's pre-hook
    ((x, y),) = batches(1)
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = x.shape[0] // dp
    loss = nn.functional.mse_loss(zdp(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
    counter = comm.CommCounter()
    peak[0] = 0
    with counter:
        zdp.backward(loss)
    zdp.step()
    block_buckets = sum(len(bs) for bs in zdp._unit_buckets[:n_units])
    return counter.calls("world", "all_gather"), peak[0], block_buckets


@pytest.mark.parametrize("recompute", [False, True])
def test_stage3_backward_gathers_each_unit_once_even_under_full_recomputation(recompute):
    """Issue 12 §3.2: the recomputed forward's pre-hook used to prefetch the next unit, whose backward
    was over, and nothing freed it: every unit ended up gathered (twice the all-gathers)."""
    for gathers, peak, block_buckets in run_ranks(_backward_gathers, 2, recompute):
        assert gathers == block_buckets  # each unit's buckets once (the root stays gathered from forward)
        assert peak <= 2  # the unit whose backward runs and the prefetched one before it
