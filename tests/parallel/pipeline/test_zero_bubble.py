"""Zero-bubble ZB-H1: the schedule is deadlock-free with a third of 1F1B's bubble at 1F1B's peak
memory (the paper's closed form), and the split backward computes exactly a plain backward's
gradients, each once, B doing no weight-gradient work."""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.memory import PeakSavedMeter
from parallel.pipeline.schedules import (
    BackwardInput,
    BackwardWeight,
    Compute,
    Forward,
    ScheduleError,
    SendGrad,
    build_schedule,
    one_f_one_b,
    zb_h1,
    zb_h1_makespan,
)
from parallel.pipeline.simulator import simulate
from parallel.pipeline.split_backward import SavedTensorStash, backward_input, backward_weight
from parallel.testing import run_ranks

SIZES = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (1, 2, 3, 4, 6, 8, 13, 16)]


@pytest.mark.parametrize("p, m", SIZES)
def test_zb_h1_is_deadlock_free_with_1f1b_memory_and_a_smaller_bubble(p, m):
    zb, ref = simulate(zb_h1(p, m)), simulate(one_f_one_b(p, m))  # B = W = F (backward = 2F)
    assert max(zb.peak_activations) == max(ref.peak_activations) == min(p, m)  # the first stage's
    assert all(pk <= min(p, m) for pk in zb.peak_activations)
    assert zb.busy == pytest.approx(ref.busy)  # the same work, split
    if p > 1:
        assert zb.bubble_fraction < ref.bubble_fraction
    if m >= p:  # Qi et al. §2.1: bubble (p − 1)(F + B − W), a third of 1F1B's (p − 1)(F + B + W)
        assert zb.makespan == pytest.approx(zb_h1_makespan(p, m, 1.0, 1.0, 1.0))
        assert zb.makespan - 3 * m == pytest.approx((ref.makespan - 3 * m) / 3)
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize("f, b, w", [(1.0, 1.5, 0.5), (1.0, 1.2, 0.8), (2.0, 2.0, 1.0), (1.0, 0.8, 0.8)])
@pytest.mark.parametrize("p, m", [(2, 2), (3, 7), (4, 8), (6, 12)])
def test_closed_form_with_unequal_costs_and_latency_still_beats_1f1b(f, b, w, p, m):
    zb = simulate(zb_h1(p, m), forward=f, backward=b + w, weight=w)
    assert zb.makespan == pytest.approx(zb_h1_makespan(p, m, f, b, w))  # holds while W ≤ B
    lat = 0.1 * f  # and with transfer latency, still ahead of 1F1B
    slow, ref = (
        simulate(s, forward=f, backward=b + w, weight=w, p2p_latency=lat) for s in (zb_h1(p, m), one_f_one_b(p, m))
    )
    assert slow.makespan < ref.makespan


def test_w_after_b_after_forward_and_sends_right_after_b():
    for s, actions in enumerate(zb_h1(4, 8)):
        order = [a for a in actions if isinstance(a, Compute)]
        seen = set()
        for a in order:
            need = {BackwardInput: (Forward, a.mb), BackwardWeight: (BackwardInput, a.mb)}.get(type(a))
            assert need is None or need in seen, (s, a)
            seen.add((type(a), a.mb))
        if s > 0:  # the input gradient leaves right after B, before any W
            for i, a in enumerate(actions):
                if isinstance(a, BackwardInput):
                    assert actions[i + 1] == SendGrad(a.mb, 0, s - 1)
    from parallel.pipeline.schedules import schedule_problem

    assert schedule_problem("zb-h1", 2, 2, prefix="parallel.") == (
        "parallel.pp_schedule=zb-h1 runs one model chunk per rank, not parallel.vpp=2: use "
        "parallel.vpp=1, or parallel.pp_schedule=interleaved for virtual stages"
    )
    with pytest.raises(ScheduleError, match="zb-h1 runs one model chunk per rank"):
        build_schedule("zb-h1", 2, 4, vpp=2)
    assert build_schedule("zb-h1", 3, 5) == zb_h1(3, 5)


def test_simulator_refuses_w_before_b_and_a_half_split():
    good = zb_h1(2, 2)
    w_first = [
        good[0],
        [
            BackwardWeight(0) if a == BackwardInput(0) else BackwardInput(0) if a == BackwardWeight(0) else a
            for a in good[1]
        ],
    ]
    with pytest.raises(ScheduleError, match="BackwardWeight.*before its BackwardInput|before its RecvGrad"):
        simulate(w_first)
    no_w = [good[0], [a for a in good[1] if a != BackwardWeight(1)]]
    with pytest.raises(
        ScheduleError, match=r"micro-batch 1, chunk 0\) needs exactly one Backward or one BackwardInput"
    ):
        simulate(no_w)


# ------------------------------------------------------------------ the split backward
class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _Net(nn.Module):
    """LayerNorm, two linears and a residual; ``shared``: one more weight used twice (two frontier
    nodes in one group; W then also recomputes the input gradient between its two uses)."""

    def __init__(self, shared: bool, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.shared = nn.Parameter(torch.randn(d, d) / d) if shared else None

    def forward(self, x):
        h = x + self.down(torch.tanh(self.up(self.norm(x))))
        return h if self.shared is None else torch.tanh(h @ self.shared) @ self.shared + h


def _matmuls(ops):
    return sum(n for k, n in ops.items() if k in ("mm", "addmm", "bmm"))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("stash", [False, True])
def test_split_backward_equals_backward_each_gradient_once_and_b_computes_no_weight_gradient(shared, stash):
    x0, gy = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)), torch.randn(2, 3, 8)
    ref = _Net(shared)
    x = x0.clone().requires_grad_()
    out = ref(x)
    with _Count() as full:
        out.backward(gy)
    net, xs = _Net(shared), x0.clone().requires_grad_()
    calls = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    keep = SavedTensorStash() if stash else None
    with keep.hooks() if keep else contextlib.nullcontext():
        out = net(xs)
    with _Count() as b_ops:
        dx, work = backward_input(out, gy, xs, net.parameters(), keep)
    assert all(p.grad is None for p in net.parameters()) and not calls  # B accumulates nothing
    torch.testing.assert_close(dx, x.grad)
    with _Count() as w_ops:
        backward_weight(work)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert sorted(map(id, calls)) == sorted(map(id, net.parameters()))  # each hook once
    n_weights = 2 + 2 * shared  # weight-gradient products: up, down (and both uses of shared)
    assert _matmuls(b_ops.ops) == _matmuls(full.ops) - n_weights  # B: input gradients only
    # W: the weight gradients; nothing else unless a weight feeds the input path twice
    assert _matmuls(w_ops.ops) == n_weights + shared


def test_output_independent_of_the_input_runs_the_whole_backward_in_b():
    net = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = net(torch.ones(2, 4)) + 0 * x.detach()
    dx, work = backward_input(out, torch.ones(2, 4), x, net.parameters())
    assert dx is None and work is None and net.weight.grad is not None


def test_planner_prices_zb_h1_below_1f1b_at_the_same_peak():
    from parallel.plan.pipeline import pipeline_time

    for pp, m, f, b, d in [(4, 8, 1.0, 2.0, 0.1), (8, 16, 1.0, 2.3, 0.05), (3, 2, 0.5, 1.5, 0.0)]:
        exact = pipeline_time("zb-h1", pp, m, 1, f, b, d)  # the planner's closed form
        one = pipeline_time("1f1b", pp, m, 1, f, b, d)
        assert exact[0] < one[0] and exact[1] < one[1] and max(exact[2]) == max(one[2])


# ------------------------------------------------------------- measured activation memory
def _peak_saved_bytes(pp, m):
    import torch.distributed as dist

    from parallel.pipeline.executor import PipelineExecutor
    from parallel.pipeline.partition import partition_layers, stage_chunks

    from .toy import ACTIVATION_SHAPE, Stage, data, loss_fn, make_groups

    topo, groups = make_groups(pp)
    stage = topo.coords(dist.get_rank()).pp
    ranges = partition_layers(8, pp)
    chunk = Stage(8, stage_chunks(ranges, pp, stage)[0], first=stage == 0, last=stage == pp - 1, tied=False)
    xs, ys = data(m)
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        ex = PipelineExecutor(
            [chunk],
            build_schedule(schedule, pp, m)[stage],
            pp_group=groups["pp"],
            activation_shape=ACTIVATION_SHAPE,
            dtype=torch.float32,
            loss_fn=loss_fn,
        )
        with PeakSavedMeter(chunk.parameters()) as meter:
            ex.run(xs if stage == 0 else None, ys if stage == pp - 1 else None)
        import gc

        gc.collect()
        assert meter.live == 0, (schedule, meter.live)  # everything released by the end of the step
        out[schedule] = (meter.peak, ex.peak_activations)
    return out


def test_measured_peak_activation_memory_is_1f1bs():
    pp, m = 4, 8
    per_stage = run_ranks(_peak_saved_bytes, pp, pp, m, timeout=60)
    one = [r["1f1b"] for r in per_stage]
    zb = [r["zb-h1"] for r in per_stage]
    assert max(b for b, _ in zb) == max(b for b, _ in one)
    assert zb[0] == one[0]
    # B released what W does not read: the last stage holds 4 micro-batches in less than 4 × 1F1B's one
    assert zb[-1][0] < 0.6 * pp * one[-1][0]
    # later stages hold up to pp micro-batches (1F1B: pp − s), as the simulator says
    assert [n for _, n in zb] == simulate(zb_h1(pp, m)).peak_activations
    assert [n for _, n in one] == simulate(one_f_one_b(pp, m)).peak_activations


# ------------------------------------------------------------------ with ZeRO
def _zero_step(stage, pp, m, schedule="zb-h1"):
    from parallel import comm
    from parallel.groups import build_groups
    from parallel.pipeline.executor import PipelineExecutor
    from parallel.pipeline.partition import partition_layers, stage_chunks
    from parallel.topology import Topology
    from parallel.zero import ZeroConfig, ZeroDataParallel

    from ..zero.test_pipeline_overlap import _Chunks, _View
    from .toy import ACTIVATION_SHAPE, Stage, data, loss_fn

    dp, layers = 2, 4
    g = build_groups(Topology(dp, pp, 1))
    (mine,) = stage_chunks(partition_layers(layers, pp), pp, g.pp_rank)
    chunk = Stage(layers, mine, first=g.pp_rank == 0, last=g.pp_rank == pp - 1, tied=False)
    zdp = ZeroDataParallel(
        _Chunks([chunk]),
        ZeroConfig(stage=stage, bucket_mb=1e-3),
        dp_group=g.dp,
        clip_groups=[g.pp],
        units=list(chunk.blocks.values()) if stage == 3 else None,
        optimizer_factory=lambda groups: torch.optim.SGD(groups, lr=0.1),
    )
    events = []
    for b in zdp.buckets:
        launch = b.launch_reduction
        b.launch_reduction = lambda launch=launch: (events.append("launch"), launch())[1]
    ex = PipelineExecutor(
        [_View(zdp, 0)],
        build_schedule(schedule, pp, m)[g.pp_rank],
        pp_group=g.pp,
        activation_shape=ACTIVATION_SHAPE,
        dtype=torch.float32,
        loss_fn=loss_fn,
        final_backward=lambda chunk: zdp.sync_gradients(),
    )
    for name in ("_backward_input", "_backward_weight"):
        run = getattr(ex, name)
        setattr(ex, name, lambda a, run=run, name=name: (events.append(name), run(a))[1])
    xs, ys = data(dp * m)
    rows = slice(g.dp_rank * m, (g.dp_rank + 1) * m)
    counter = comm.CommCounter()
    with counter, zdp.no_sync():
        ex.run(xs[rows] if g.pp_rank == 0 else None, ys[rows] if g.pp_rank == pp - 1 else None)
    events.append("step")
    with counter:
        zdp.step()
    params = {n.split(".", 2)[2]: p.detach().clone() for n, p in zdp.full_parameters().items()}
    return g.pp_rank, events, len(zdp.buckets), params


@pytest.mark.parametrize("stage, pp", [(0, 2), (1, 4), (2, 2), (3, 2)])
def test_zero_stages_see_each_gradient_once_and_equal_one_process(stage, pp):
    from .toy import Stage, data, loss_fn

    m, dp = 4, 2
    ref = Stage(4, range(4), first=True, last=True, tied=False)
    xs, ys = data(dp * m)
    (sum(loss_fn(ref(x), y) for x, y in zip(xs, ys)) / (dp * m)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    want = dict(ref.named_parameters())
    for pp_rank, events, n_buckets, params in run_ranks(_zero_step, dp * pp, stage, pp, m, timeout=120):
        for name, p in params.items():
            torch.testing.assert_close(p, want[name].detach(), atol=1e-5, rtol=1e-5, msg=name)
        launches = [i for i, e in enumerate(events) if e == "launch"]
        # ZeRO 0-1 reduce each bucket once per step, from inside the last weight-gradient pass
        # (the first stage's last B, which runs its whole backward); 2-3 once per micro-batch
        assert len(launches) == n_buckets * (1 if stage < 2 else m)
        assert launches[-1] < events.index("step")
        if stage < 2:
            last = "_backward_input" if pp_rank == 0 else "_backward_weight"
            final = max(i for i, e in enumerate(events) if e == last)
            assert all(i > final for i in launches)
