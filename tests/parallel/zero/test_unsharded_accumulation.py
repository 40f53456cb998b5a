"""ZeRO-2/3 with ``accumulate="unsharded"`` (issue 17 item 4): FSDP2's accumulation — the full fp32
gradient kept across micro-batches, one reduce-scatter per step — equals the default, sends
what theory says, and holds what theory says while accumulating."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.comm import SENT_FRACTION
from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel
from parallel.zero.layout import ZeroConfigError
from parallel.zero.theory import accumulation_grad_bytes, grad_reductions_per_step

from .toy import adamw, batches, make_model

M = 4  # micro-batches per step


def _run(accumulate: str, precision: str = "fp32", stage: int = 3):
    model = make_model()
    zdp = ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, precision=precision, accumulate=accumulate),
        dp_group=dist.group.WORLD,
        optimizer_factory=adamw,
        units=list(model.blocks),
    )
    dp, rank = dist.get_world_size(), dist.get_rank()
    counter, held = comm.CommCounter(), 0
    for x, y in batches(steps=3):
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        with counter:
            for i, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M))):
                with zdp.no_sync() if i < M - 1 else contextlib.nullcontext():
                    zdp.backward(((zdp(xm).float() - ym) ** 2).mean() / M)
                    held = max(held, sum(b.acc.numel() * 4 for b in zdp.buckets if b.acc is not None))
            zdp.step()
    assert all(b.acc is None for b in zdp.buckets)  # freed by the step's reduce-scatter
    psi = sum(b.layout.padded_numel for b in zdp.buckets)
    rs = counter.sent_bytes(op="reduce_scatter") / 3
    params = [b.master.detach().clone() for b in zdp.buckets]  # this rank's fp32 shards (stage 3 frees the rest)
    return params, rs, counter.sent_bytes(op="all_gather") / 3, held, psi


def _both(precision, stage):
    return _run("sharded", precision, stage), _run("unsharded", precision, stage)


@pytest.mark.parametrize("stage,precision,tol", [(3, "fp32", 1e-6), (3, "bf16", 1e-3), (2, "fp32", 1e-6)])
def test_unsharded_accumulation_equals_sharded_and_theory(stage, precision, tol):
    dp = 2
    for sharded, unsharded in run_ranks(_both, dp, precision, stage, timeout=120):
        for a, b in zip(sharded[0], unsharded[0]):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)
        psi = sharded[4]
        for (_, rs, _, _, _), mode in ((sharded, "sharded"), (unsharded, "unsharded")):
            want = grad_reductions_per_step(stage, M, mode) * SENT_FRACTION["reduce_scatter"](dp) * psi * 4
            assert rs == pytest.approx(want, abs=0), mode
        assert unsharded[1] * M == sharded[1]  # one reduce-scatter per step instead of M
        assert unsharded[2] == sharded[2]  # parameters gathered as before
        assert sharded[3] == 0 and unsharded[3] == accumulation_grad_bytes(psi, stage, "unsharded")


def test_unsharded_accumulation_is_refused_below_stage_2():
    with pytest.raises(ZeroConfigError, match="stage=2 or 3"):
        ZeroDataParallel(
            make_model(), ZeroConfig(stage=1, accumulate="unsharded"), dp_group=None, optimizer_factory=adamw
        )
    assert accumulation_grad_bytes(1000, 1, "unsharded") == 0 and grad_reductions_per_step(1, 4, "unsharded") == 1
    with pytest.raises(ZeroConfigError, match="accumulate must be"):
        ZeroDataParallel(make_model(), ZeroConfig(stage=3, accumulate="full"), dp_group=None, optimizer_factory=adamw)
    with pytest.raises(ValueError):
        grad_reductions_per_step(3, 4, "full")


def test_uninitialised_gradient_buffers_send_zeros_where_no_gradient_was_copied():
    from parallel.zero.bucket import _zero_unwritten
    from parallel.zero.layout import ParamSlot

    slots = [ParamSlot("a", (2,), 1, 2), ParamSlot("b", (3,), 3, 3), ParamSlot("c", (2,), 8, 2)]
    flat = torch.full((12,), float("nan"))
    flat[1:3], flat[8:10] = 1.0, 2.0  # a and c were copied in; b had no gradient
    _zero_unwritten(flat, slots, [True, False, True])
    want = torch.tensor([0, 1, 1, 0, 0, 0, 0, 0, 2, 2, 0, 0], dtype=flat.dtype)
    torch.testing.assert_close(flat, want)
