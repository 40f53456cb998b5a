"""Issue 12 §3.4: under gradient accumulation through the pipeline executor, ZeRO 0–1 launch each
bucket's DP reduction during the last backward of its chunk (not after the step), once per step,
and the step still equals one process."""

import pytest
import torch
from torch import nn

from parallel import comm
from parallel.groups import build_groups
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.partition import partition_layers, stage_chunks
from parallel.pipeline.schedules import build_schedule
from parallel.testing import run_ranks
from parallel.topology import Topology
from parallel.zero import ZeroConfig, ZeroDataParallel

from ..pipeline.toy import ACTIVATION_SHAPE, Stage, data, loss_fn

LAYERS, M, LR = 4, 4, 0.1


class _Chunks(nn.Module):
    def __init__(self, chunks):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def forward(self, x, chunk: int):
        return self.chunks[chunk](x)


class _View(nn.Module):  # what the executor calls: chunk c through ZeRO's forward
    def __init__(self, zdp, c):
        super().__init__()
        object.__setattr__(self, "zdp", zdp)
        self.inner, self.c = zdp.module.chunks[c], c

    def forward(self, x):
        return self.zdp(x, chunk=self.c)


def _step(stage, schedule, vpp):
    dp, pp = 2, 2
    g = build_groups(Topology(dp, pp, 1))
    ranges = partition_layers(LAYERS, pp, vpp=vpp)
    last_v = pp * vpp - 1
    chunks = [
        Stage(LAYERS, layers, first=c * pp + g.pp_rank == 0, last=c * pp + g.pp_rank == last_v, tied=False)
        for c, layers in enumerate(stage_chunks(ranges, pp, g.pp_rank))
    ]
    zdp = ZeroDataParallel(
        _Chunks(chunks),
        ZeroConfig(stage=stage, bucket_mb=1e-3),
        dp_group=g.dp,
        clip_groups=[g.pp],
        optimizer_factory=lambda groups: torch.optim.SGD(groups, lr=LR),
    )
    events = []
    for b in zdp.buckets:
        launch = b.launch_reduction
        b.launch_reduction = lambda launch=launch, b=b: (events.append(("launch", b.layout.index)), launch())[1]
    ex = PipelineExecutor(
        [_View(zdp, c) for c in range(vpp)],
        build_schedule(schedule, pp, M, vpp)[g.pp_rank],
        pp_group=g.pp,
        activation_shape=ACTIVATION_SHAPE,
        dtype=torch.float32,
        loss_fn=loss_fn,
        final_backward=lambda chunk: zdp.sync_gradients(),
    )
    backward = ex._backward
    ex._backward = lambda a: (backward(a), events.append(("backward", a.chunk)))
    xs, ys = data(dp * M)
    mine = slice(g.dp_rank * M, (g.dp_rank + 1) * M)
    counter = comm.CommCounter()
    with counter:
        with zdp.no_sync():
            ex.run(xs[mine] if g.pp_rank == 0 else None, ys[mine] if g.pp_rank == pp - 1 else None)
        events.append(("step",))
        zdp.step()
    grad_op = "all_reduce" if stage == 0 else "reduce_scatter"
    params = {n.split(".", 2)[2]: p for n, p in zdp.full_parameters().items()}  # drop "chunks.<c>."
    return events, counter.calls("dp", grad_op), len(zdp.buckets), params


@pytest.mark.parametrize("stage, schedule, vpp", [(0, "1f1b", 1), (1, "interleaved", 2)])
def test_dp_reduction_launches_during_each_chunks_last_backward(stage, schedule, vpp):
    ref = Stage(LAYERS, range(LAYERS), first=True, last=True, tied=False)
    xs, ys = data(2 * M)
    (sum(loss_fn(ref(x), y) for x, y in zip(xs, ys)) / (2 * M)).backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    want = dict(ref.named_parameters())
    for events, grad_calls, n_buckets, params in run_ranks(_step, 4, stage, schedule, vpp, timeout=120):
        launches = [i for i, e in enumerate(events) if e[0] == "launch"]
        assert len(launches) == n_buckets == grad_calls  # every bucket once per step
        assert launches[-1] < events.index(("step",))  # none waits for the optimizer step ...
        backwards = [i for i, e in enumerate(events) if e[0] == "backward"]
        assert launches[0] < backwards[-1]  # ... and they start while backward still runs
        for c in range(vpp):  # each launch inside the last backward of some chunk, after that chunk's others
            last = max(i for i in backwards if events[i] == ("backward", c))
            before = max((i for i in backwards if i < last), default=-1)
            assert any(before < i < last for i in launches), (c, events)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name].detach(), atol=1e-6, rtol=0)
