"""The planner's communication buffers against what the real engine holds (gloo, dp = 2)."""

import pytest
import torch
from torch import nn

from parallel.overlap import REDUCTIONS_IN_FLIGHT
from parallel.testing import run_ranks
from parallel.zero import ZeroDataParallel
from parallel.zero.packing import reduction_buffer_bytes

from ..zero.toy import adamw


def _pending_bytes_peak(stage):
    import torch.distributed as dist

    torch.manual_seed(0)  # six equal buckets (one weight each): the count shows in the bytes
    model = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(6)))
    zdp = ZeroDataParallel(
        model, dp_group=dist.group.WORLD, stage=stage, optimizer_factory=adamw, bucket_mb=1e-4, overlap=True
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
