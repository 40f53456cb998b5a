"""The planner's communication buffers against what the real engine holds (gloo, dp = 2)."""

import pytest
import torch
from torch import nn

from parallel.overlap import REDUCTIONS_IN_FLIGHT
from parallel.precision import DTYPE_BYTES
from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel
from parallel.zero.packing import comm_copy_bytes, reduction_buffer_bytes

from ..zero.toy import adamw, batches, make_model


def _pending_bytes_peak(stage):
    import torch.distributed as dist

    torch.manual_seed(0)  # six equal buckets (one weight each): the count shows in the bytes
    model = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(6)))
    zdp = ZeroDataParallel(
        model, ZeroConfig(stage=stage, bucket_mb=1e-4, overlap=True), dp_group=dist.group.WORLD, optimizer_factory=adamw
    )
    peak = [0]
    for b in zdp.buckets:
        launch = b.launch_reduction

        def counting(launch=launch):
            launch()  # each pending reduce-scatter holds its full gradient and the shard it lands in (fp32)
            pending = [x for x in zdp.buckets if x._pending is not None]
            peak[0] = max(peak[0], sum(4 * (x.layout.padded_numel + x.hi - x.lo) for x in pending))

        b.launch_reduction = counting
    for _ in range(2):
        zdp.backward(zdp(torch.randn(4, 16)).pow(2).mean())
        zdp.step()
    return peak[0], [b.layout.padded_numel for b in zdp.buckets]


@pytest.mark.parametrize("stage", [2, 3])
def test_reductions_in_flight_as_the_engine_holds_them(stage):
    """The engine launches a bucket's reduce-scatter before it waits for the oldest pending one:
    REDUCTIONS_IN_FLIGHT + 1 full gradients are alive right after a launch. The planner's bound
    (parallel.zero.packing.reduction_buffer_bytes) covers that peak; the largest
    REDUCTIONS_IN_FLIGHT alone (the old count) do not."""
    peak, numels = run_ranks(_pending_bytes_peak, 2, stage, timeout=90)[0]
    assert len(numels) >= REDUCTIONS_IN_FLIGHT + 2 and len(set(numels)) == 1
    largest = sorted(numels, reverse=True)
    old = sum(4 * (n + n // 2) for n in largest[:REDUCTIONS_IN_FLIGHT])
    assert old < peak <= reduction_buffer_bytes(numels, 4, 2)


def _wire_copies(stage):

    return {c: _wire_copies_at(stage, c) for c in ("fp32", "bf16")}


def _wire_copies_at(stage, comm_dtype):
    import torch.distributed as dist

    from parallel.zero import bucket as bucket_mod

    zdp = ZeroDataParallel(
        make_model(),
        ZeroConfig(stage=stage, precision="bf16", comm_dtype=comm_dtype, bucket_mb=1e-3),
        dp_group=dist.group.WORLD,
        optimizer_factory=adamw,
    )
    copies = {}
    real = bucket_mod.comm

    class Recording:  # the module's comm, recording each gradient sent that is not a bucket's flat_grad
        def __getattr__(self, name):
            return getattr(real, name)

        def all_reduce(self, t, *a, **k):
            self._note(t)
            return real.all_reduce(t, *a, **k)

        def reduce_scatter(self, out, t, *a, **k):
            self._note(t)
            return real.reduce_scatter(out, t, *a, **k)

        def _note(self, t):
            if all(t is not b.flat_grad for b in zdp.buckets):
                copies[t.data_ptr()] = t.nbytes  # launched at the last backward, waited for in step()

    bucket_mod.comm = Recording()
    try:
        x, y = next(iter(batches(steps=1)))
        zdp.backward(((zdp(x) - y) ** 2).mean())
        held = sum(copies.values())
        zdp.step()
    finally:
        bucket_mod.comm = real
    return held, [b.layout.padded_numel for b in zdp.buckets]


@pytest.mark.parametrize("stage", [0, 1])
def test_stage01_wire_copies_as_the_engine_holds_them(stage):
    """Stages 0-1 with 16-bit parameters accumulate in an fp32 flat_grad: sent as is in an fp32
    wire dtype (no copy), else every bucket's copy in the wire dtype, all alive from the last
    backward to step() (no in-flight cap). The planner's count (comm_copy_bytes) is those bytes."""
    for comm_dtype, (held, numels) in run_ranks(_wire_copies, 2, stage, timeout=90)[0].items():
        assert len(numels) > REDUCTIONS_IN_FLIGHT + 1
        assert held == comm_copy_bytes(numels, DTYPE_BYTES[comm_dtype])
        assert (held > 0) == (comm_dtype == "bf16")


@pytest.mark.parametrize("comm_dtype", ["fp32", "bf16"])
def test_planner_prices_stage1_wire_copies(comm_dtype):
    """gpt_tiny dp=2 ZeRO-1 bf16: the planner's buffers are the wire copies of the rank's buckets
    (none in an fp32 wire dtype: it planned a 52.4 MB ``comm.bucket_mb`` copy the engine never
    allocates; every bucket's 16-bit copy in a bf16 one: it planned 0)."""
    from parallel.plan.memory import zero_bucket_numels
    from recipes.config import model_config
    from recipes.tools.plan import meta_param_counter, plan_from_config
    from tests.recipes.test_dryrun import recipe

    rc = recipe("gpt_tiny", ["parallel.dp=2", "parallel.zero=1", "train.precision=bf16", f"comm.dtype={comm_dtype}"])
    count = meta_param_counter(model_config(rc.model))
    numels = zero_bucket_numels(count(range(0, 4), True, True, 1), 2, rc.comm.bucket_mb * 2**20, 2)
    expected = comm_copy_bytes([n for unit in numels for n in unit], DTYPE_BYTES[comm_dtype])
    assert plan_from_config(rc).ranks[0].memory["buffers"] == expected


def test_expert_buckets_are_sharded_over_expert_dp():
    """An MoE expert's bucket is reduce-scattered over expert DP (dp / ep): its shard is n / edp,
    not n / dp; the in-flight bound takes each bucket's own group."""
    dense, expert = 1024, 512
    got = reduction_buffer_bytes([dense, expert], 4, [8, 2])
    assert got == 4 * (dense + dense // 8) + 4 * (expert + expert // 2)
    assert got > reduction_buffer_bytes([dense, expert], 4, 8)


def _norm_on_unread_steps():
    import itertools

    import torch.distributed as dist

    from parallel.zero.scaler import DynamicLossScaler

    out = []
    for clip, precision, offload in itertools.product((0.0, 1.0), ("bf16", "fp16"), ("none", "optimizer")):
        zdp = ZeroDataParallel(
            make_model(),
            ZeroConfig(stage=1, precision=precision, grad_clip=clip or None, offload=offload),
            dp_group=dist.group.WORLD,
            optimizer_factory=adamw,
            loss_scaler=DynamicLossScaler() if precision == "fp16" else None,
        )
        x, y = next(iter(batches(steps=1)))
        zdp.backward(((zdp(x) - y) ** 2).mean())
        out.append(((clip, precision, offload), zdp.step(norm=False)["grad_norm"] is not None))
    return out


def test_norm_every_step_is_the_engines_condition():
    """planner.norm_every_step against a real ZeroDataParallel (dp = 1): an unread step
    (step(norm=False)) computes the norm exactly when the planner says every step does."""
    from parallel.plan.exposure import norm_every_step

    for (clip, precision, offload), computed in run_ranks(_norm_on_unread_steps, 1, timeout=90)[0]:
        assert computed == norm_every_step(clip, precision, offload), (clip, precision, offload)
