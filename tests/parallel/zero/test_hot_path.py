"""The step does only the work it must (issue 17 item 2): the norm only when something needs it,
as one fused reduction; reductions in flight capped; stage 1 in place."""

import contextlib

import pytest
import torch

from parallel import comm
from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel
from parallel.zero.norm import local_sq_norm

from .toy import adamw, batches, make_model


def _train(zdp: ZeroDataParallel, micro: int = 4, norm: bool = True):
    for x, y in batches(steps=3):
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = i == micro - 1
            with zdp.no_sync() if not last else torch.enable_grad():
                zdp.backward(((zdp(xm) - ym) ** 2).mean() / micro)
        stats = zdp.step(norm=norm)
    return stats, [p.detach().clone() for p in zdp.module.parameters()]


def _unread_step():
    import torch.distributed as dist

    def run(norm):
        zdp = ZeroDataParallel(make_model(), ZeroConfig(stage=1), dp_group=dist.group.WORLD, optimizer_factory=adamw)
        with comm.CommCounter() as counter:
            stats, params = _train(zdp, norm=norm)
        return stats, params, counter

    s_on, p_on, c_on = run(True)
    s_off, p_off, c_off = run(False)
    # stage 1 over 2 ranks: the norm's one scalar all-reduce per step is all that goes
    assert c_on.calls(op="all_reduce") == 3 and c_off.calls(op="all_reduce") == 0
    assert c_on.sent_bytes(op="reduce_scatter") == c_off.sent_bytes(op="reduce_scatter") > 0
    assert torch.is_tensor(s_on["grad_norm"]) and s_off["grad_norm"] is None and s_off["skipped"] is None
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    clipped = ZeroDataParallel(
        make_model(), ZeroConfig(stage=1, grad_clip=1.0), dp_group=dist.group.WORLD, optimizer_factory=adamw
    )
    stats, _ = _train(clipped, norm=False)
    assert torch.is_tensor(stats["grad_norm"])  # clipping needs the norm: computed anyway


def test_unread_step_skips_the_norm_and_changes_nothing_else():
    run_ranks(_unread_step, 2, timeout=60)


def test_fused_norm_equals_the_sum_of_slices():
    g = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ranges = [[(0, 10), (20, 1000)], [], [(5, 6), (7, 900)]]
    expected = sum(float(t[a:b].double().pow(2).sum()) for t, rs in zip(g, ranges) for a, b in rs)
    assert float(local_sq_norm(g, ranges)) == pytest.approx(expected, rel=1e-6)
    assert float(local_sq_norm([g[0].bfloat16()], [[(0, 1000)]])) == pytest.approx(
        float(g[0].bfloat16().double().pow(2).sum()), rel=1e-5
    )


def _in_flight_peak(stage):
    import torch.distributed as dist

    import parallel.zero.grads as engine
    from parallel.zero.theory import REDUCTIONS_IN_FLIGHT

    def run():
        zdp = ZeroDataParallel(
            make_model(),
            ZeroConfig(stage=stage, bucket_mb=1e-4, overlap=True),
            dp_group=dist.group.WORLD,
            optimizer_factory=adamw,
        )
        assert len(zdp.buckets) > REDUCTIONS_IN_FLIGHT + 1  # enough buckets for the cap to matter
        peak = [0]
        for b in zdp.buckets:
            launch = b.launch_reduction

            def counting(launch=launch):
                launch()
                peak[0] = max(peak[0], sum(x._pending is not None for x in zdp.buckets))

            b.launch_reduction = counting
        for x, y in batches(steps=3):
            for i, (xm, ym) in enumerate(zip(x.chunk(4), y.chunk(4))):
                zdp.backward(((zdp(xm) - ym) ** 2).mean() / 4)
            zdp.step()
        return peak[0], [b.master.detach().clone() for b in zdp.buckets]  # stage 3 frees module parameters

    capped = run()
    engine.REDUCTIONS_IN_FLIGHT = 10**6  # every bucket in flight until backward ends: the old behaviour
    try:
        uncapped = run()
    finally:
        engine.REDUCTIONS_IN_FLIGHT = REDUCTIONS_IN_FLIGHT
    return capped, uncapped, REDUCTIONS_IN_FLIGHT


@pytest.mark.parametrize("stage", [2, 3])
def test_reduce_scatter_temporaries_in_flight_are_capped(stage):
    """Stages 2-3 reduce-scatter from a temporary full gradient: with overlap, at most
    REDUCTIONS_IN_FLIGHT (+ the one being launched) are alive, not every bucket until backward
    ends (which held 4·Ψ bytes); the planner's buffers count this cap. Same result either way."""
    for (peak, ours), (old_peak, old), cap in run_ranks(_in_flight_peak, 2, stage, timeout=90):
        assert 1 <= peak <= cap + 1 < old_peak
        for a, b in zip(ours, old):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _second_communicating_backward(stage, overlap):
    import torch.distributed as dist

    zdp = ZeroDataParallel(
        make_model(), ZeroConfig(stage=stage, overlap=overlap), dp_group=dist.group.WORLD, optimizer_factory=adamw
    )
    (x, y), *_ = batches(steps=1)
    zdp.backward(((zdp(x) - y) ** 2).mean())  # communicates: this step's one reduction starts
    with pytest.raises(RuntimeError, match="no_sync"):
        zdp.backward(((zdp(x) - y) ** 2).mean())  # its gradients would race with that reduction
    return True


@pytest.mark.parametrize("stage,overlap", [(0, True), (1, False)])
def test_a_second_communicating_backward_is_refused(stage, overlap):
    """Stages 0-1 reduce once per step: a second backward outside ``no_sync`` before the step
    is refused on every rank (it would add into a bucket whose reduction is in flight)."""
    assert run_ranks(_second_communicating_backward, 2, stage, overlap, timeout=60) == [True, True]


def _one_rank_accumulates_without_no_sync(stage):
    import torch.distributed as dist

    def run(use_no_sync):
        zdp = ZeroDataParallel(
            make_model(), ZeroConfig(stage=stage, precision="bf16"), dp_group=dist.group.WORLD, optimizer_factory=adamw
        )
        (x, y), *_ = batches(steps=1)
        for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            with zdp.no_sync() if use_no_sync and i == 0 else contextlib.nullcontext():
                zdp.backward(((zdp(xm) - ym) ** 2).mean())
        zdp.step()
        return [p.detach().clone() for p in zdp.module.parameters()]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("stage", [0, 1])
def test_one_rank_needs_no_no_sync(stage):
    """dp=1 (16-bit: hooks on every backward): nothing is reduced before the step, so backwards
    outside ``no_sync`` accumulate exactly as inside it (not refused, not lost)."""
    assert run_ranks(_one_rank_accumulates_without_no_sync, 1, stage, timeout=60) == [True]


def _stage1_in_place():
    import torch.distributed as dist

    from parallel.comm import gloo

    gloo.GLOO_GATHER_BY_BROADCAST_BYTES = 0  # the path of large buckets (gloo's own is not in place)
    zdp = ZeroDataParallel(make_model(), ZeroConfig(stage=1), dp_group=dist.group.WORLD, optimizer_factory=adamw)
    fresh = []
    original, clone = torch.empty, torch.Tensor.clone
    x, y = batches(steps=1)[0]
    zdp.backward(((zdp(x) - y) ** 2).mean())
    torch.empty = lambda *a, **k: fresh.append(a) or original(*a, **k)  # no buffer for a shard
    torch.Tensor.clone = lambda t, *a, **k: fresh.append(t.shape) or clone(t, *a, **k)  # nor a copy of it
    try:
        shards = [(b, b.main_grad()) for b in zdp.buckets if b.finish_reduction() is None]
        zdp.step(norm=False)
    finally:
        torch.empty, torch.Tensor.clone = original, clone
    return [(g.untyped_storage() is b.flat_grad.untyped_storage(), g.storage_offset() - b.lo) for b, g in shards], fresh


def test_stage1_reduces_and_gathers_in_place():
    """ZeRO-1 in fp32 reduce-scatters into this rank's range of the gradient buffer and gathers the
    parameters from this rank's range of the flat parameters: no fresh host buffer (page faults at
    every step; docs/performance.md, sixth round) and no copy of the shard."""
    for views, fresh in run_ranks(_stage1_in_place, 2, timeout=60):
        assert views and all(same and offset == 0 for same, offset in views)
        assert fresh == []


def _abandoned_step(comm_dtype):
    import torch.distributed as dist

    zdp = ZeroDataParallel(
        make_model(), ZeroConfig(stage=1, comm_dtype=comm_dtype), dp_group=dist.group.WORLD, optimizer_factory=adamw
    )
    x, y = batches(steps=1)[0]
    zdp.backward(((zdp(x) - y) ** 2).mean())  # communicating: reductions in flight
    pending = sum(b._pending is not None for b in zdp.buckets)
    zdp.zero_grad()  # the step is abandoned: what is in flight is waited for and dropped
    left = sum(b._pending is not None for b in zdp.buckets)
    # forgotten without a memset (issue 34): no slot written, no .grad kept; the next backward's writes
    forgotten = not any(any(b.written) for b in zdp.buckets) and all(p.grad is None for p in zdp.module.parameters())
    zdp.backward(((zdp(x) - y) ** 2).mean())
    fresh = ZeroDataParallel(
        make_model(), ZeroConfig(stage=1, comm_dtype=comm_dtype), dp_group=dist.group.WORLD, optimizer_factory=adamw
    )
    fresh.backward(((fresh(x) - y) ** 2).mean())
    for b, f in zip(zdp.buckets, fresh.buckets):
        b.finish_reduction()
        f.finish_reduction()
        forgotten = forgotten and torch.equal(b._stage1_shard, f._stage1_shard)  # nothing of the abandoned step
    own = [b._stage1_shard.untyped_storage() is b.flat_grad.untyped_storage() for b in zdp.buckets]
    return pending, left, forgotten, own


@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_zero_grad_waits_for_reductions_in_flight_and_a_16bit_shard_is_its_own(comm_dtype):
    """zero_grad() between a communicating backward and the step waits for the reductions in flight
    (on NCCL the in-place reduce-scatter would otherwise write into the buffer later) and forgets them; the
    stage-1 shard is a view of flat_grad in fp32 and its own copy with a 16-bit wire (the wire copy
    of the whole bucket is then freed at the wait, as the planner counts)."""
    for pending, left, forgotten, own in run_ranks(_abandoned_step, 2, comm_dtype, timeout=60):
        assert pending > 0 and left == 0 and forgotten
        assert all(own) if comm_dtype == torch.float32 else not any(own)


def _reset_mid_accumulation(dp: int, how: str):
    """fp32 stage 0: micro-batch 1 under no_sync, then the user touches ``.grad``, then micro-batch 2
    twice (quiet, then communicating). ``how="zero_grad"``: ``model.zero_grad()`` drops micro-batch 1, so
    the step's gradient is micro-batch 2's twice; ``"data"``: ``p.grad.data = p.grad.data.clone()`` (the
    same object on other storage) keeps it, so the step's gradient is 1 + 2 + 2. By parameter name (every
    rank runs the same data, so the DP mean is that too)."""
    import torch.distributed as dist

    (x, y), group = batches(steps=1)[0], dist.group.WORLD if dp > 1 else None
    zdp = ZeroDataParallel(make_model(), ZeroConfig(stage=0), dp_group=group, optimizer_factory=adamw)
    x1, x2 = x.chunk(2)
    y1, y2 = y.chunk(2)
    with zdp.no_sync():
        zdp.backward(((zdp(x1) - y1) ** 2).mean())
    if how == "zero_grad":
        zdp.module.zero_grad()  # .grad is None: the hooks must take the next gradient in afresh
    else:
        for p in zdp.module.parameters():  # no longer a view of the flat buffer: taken in afresh
            p.grad.data = p.grad.data.clone()
    with zdp.no_sync():
        zdp.backward(((zdp(x2) - y2) ** 2).mean())
    zdp.backward(((zdp(x2) - y2) ** 2).mean())
    grads = zdp._finish_gradients()  # averaged over DP
    got = {s.name: g[s.offset : s.end].clone() for b, g in zip(zdp.buckets, grads) for s in b.layout.slots}
    ref = make_model()
    (2 * ((ref(x2) - y2) ** 2).mean() + (((ref(x1) - y1) ** 2).mean() if how == "data" else 0)).backward()
    return {n: (got[n], p.grad.reshape(-1)) for n, p in ref.named_parameters()}


@pytest.mark.parametrize("how", ["zero_grad", "data"])
@pytest.mark.parametrize("dp", [1, 2])
def test_a_grad_reset_mid_accumulation_is_taken_in_afresh(dp, how):
    for pairs in run_ranks(_reset_mid_accumulation, dp, dp, how, timeout=60):
        for name, (got, want) in pairs.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
