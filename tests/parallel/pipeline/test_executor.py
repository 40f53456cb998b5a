"""The executor trains the same model as one process, holds what the simulator says,
and moves the bytes theory says."""

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.partition import partition_layers, stage_chunks
from parallel.pipeline.schedules import Compute, batches, build_schedule
from parallel.pipeline.simulator import simulate
from parallel.testing import run_ranks

from .toy import ACTIVATION_SHAPE, Stage, data, loss_fn, make_groups, reference


def _pipeline_step(n_layers, pp, m, schedule, vpp=1, tp=1, tied=True, pp_layers=None, count=False):
    topo, groups = make_groups(pp, tp)
    stage = topo.coords(dist.get_rank()).pp
    ranges = partition_layers(n_layers, pp, vpp=vpp, pp_layers=pp_layers)
    last_v = pp * vpp - 1
    chunks = [
        Stage(n_layers, layers, first=(c * pp + stage == 0), last=(c * pp + stage == last_v), tied=tied)
        for c, layers in enumerate(stage_chunks(ranges, pp, stage))
    ]
    actions = build_schedule(schedule, pp, m, vpp)[stage]
    ex = PipelineExecutor(
        chunks,
        actions,
        pp_group=groups["pp"],
        activation_shape=ACTIVATION_SHAPE,
        dtype=torch.float32,
        loss_fn=loss_fn,
        tp_group=groups["tp"] if tp > 1 else None,
        embedding_group=groups.get("embedding") if tied else None,
        record_timeline=True,
    )
    xs, ys = data(m)
    counter = comm.CommCounter()
    with counter:  # inputs only where the first virtual stage lives, targets where the last
        loss = ex.run(xs if stage == 0 else None, ys if stage == pp - 1 else None)
    grads = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()}
    # evaluation: the same forwards without backward gives the same loss and moves no gradient
    timeline, peak = ex.timeline, ex.peak_activations
    eval_loss = ex.run(xs if stage == 0 else None, ys if stage == pp - 1 else None, forward_only=True)
    assert abs(eval_loss.item() - loss.item()) < 1e-6
    assert ex.peak_activations == 0
    for c in chunks:
        for n, p in c.named_parameters():
            assert torch.equal(p.grad, grads[n]), n
    ex.timeline = timeline
    # the recorded timeline is the action list, in order, one span after the other
    assert [sp.action for sp in ex.timeline] == [a if isinstance(a, Compute) else tuple(a) for a in batches(actions)]
    assert all(a.end <= b.start for a, b in zip(ex.timeline, ex.timeline[1:]))
    return dict(stage=stage, loss=loss.item(), grads=grads, peak=peak, counter=counter.summary() if count else None)


def _sweep(pp, schedule, ms, vpp=1, n_layers=4):
    return [_pipeline_step(n_layers, pp, m, schedule, vpp) for m in ms]


def _assert_matches(results, n_layers, m, tied=True):
    ref_loss, ref_grads = reference(n_layers, m, tied)
    seen = set()
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-5)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(ref_grads)  # every parameter lives on some stage


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_same_loss_and_gradients_as_one_process_and_simulated_memory(pp, schedule):
    vpp = 2 if schedule == "interleaved" else 1
    ms = [4, 8] if schedule == "interleaved" else [1, 4, 8]
    per_rank = run_ranks(_sweep, pp, pp, schedule, ms, vpp, 8, timeout=60)
    for i, m in enumerate(ms):
        results = [rank[i] for rank in per_rank]
        _assert_matches(results, 8, m)
        sim = simulate(build_schedule(schedule, pp, m, vpp))
        assert [r["peak"] for r in results] == sim.peak_activations


def test_uneven_and_explicit_splits_untied_head():
    per_rank = run_ranks(_pipeline_step, 3, 7, 3, 4, "1f1b", tied=False, timeout=60)
    _assert_matches(per_rank, 7, 4, tied=False)
    assert [len({n.split(".")[1] for n in r["grads"] if n.startswith("blocks")}) for r in per_rank] == [3, 2, 2]
    per_rank = run_ranks(_pipeline_step, 2, 5, 2, 4, "1f1b", pp_layers=[1, 4], timeout=60)
    _assert_matches(per_rank, 5, 4)
    assert sorted(n for n in per_rank[0]["grads"] if n.startswith("blocks")) == [
        "blocks.0.linear.bias",
        "blocks.0.linear.weight",
    ]


def _tp_sweep(m):
    return [
        _pipeline_step(4, 2, m, schedule, vpp, tp=2, count=True)
        for schedule, vpp in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1))
    ]


def test_tensor_parallel_scatter_gather_sends_one_tp_share():
    # dp=1, pp=2, tp=2: each TP rank runs a full replica of its stage; the activation is
    # replicated, so each TP rank sends half of it and the receiver all-gathers.
    m = 4
    per_rank = run_ranks(_tp_sweep, 4, m, timeout=60)
    full_bytes = torch.Size(ACTIVATION_SHAPE).numel() * 4
    for i, vpp in enumerate((1, 1, 2, 1)):
        results = [rank[i] for rank in per_rank]
        _assert_matches(results, 4, m)
        # stage 0 sends vpp activations (and, interleaved, vpp − 1 gradients) per micro-batch;
        # stage 1 the mirror image
        transfers = m * (2 * vpp - 1)
        for r in results:
            pp_sent = r["counter"]["pp"]["send"]
            assert pp_sent["calls"] == transfers
            assert pp_sent["payload_bytes"] == transfers * full_bytes // 2  # half: one TP share
            gathered = r["counter"]["tp"]["all_gather"]
            assert gathered["calls"] == transfers and gathered["payload_bytes"] == transfers * full_bytes


def _bad_input(case):
    topo, groups = make_groups(2)
    stage = topo.coords(dist.get_rank()).pp
    chunks = [Stage(4, range(2 * stage, 2 * stage + 2), first=stage == 0, last=stage == 1, tied=False)]
    kwargs = dict(pp_group=groups["pp"], activation_shape=ACTIVATION_SHAPE, dtype=torch.float32, loss_fn=loss_fn)
    counter = comm.CommCounter()
    try:
        with counter:
            if case == "vpp":
                partition_layers(6, 2, vpp=2)
            elif case == "interleaved_m":
                build_schedule("interleaved", 2, 3, 2)
            elif case == "pp_gt_layers":
                partition_layers(3, 4)
            elif case == "chunks":
                PipelineExecutor(chunks, build_schedule("interleaved", 2, 2, 2)[stage], **kwargs)
            elif case == "pp":
                PipelineExecutor(chunks, build_schedule("1f1b", 4, 4), **kwargs)
            elif case == "peers":  # another stage's list: its peers give it away
                PipelineExecutor(chunks, build_schedule("1f1b", 3, 3)[stage + 1], **kwargs)
            elif case == "inputs":
                xs, ys = data(3)
                PipelineExecutor(chunks, build_schedule("1f1b", 2, 4)[stage], **kwargs).run(xs, ys)
    except ValueError as e:
        return type(e).__name__, str(e), counter.calls("pp")
    return None


@pytest.mark.parametrize(
    "case, words",
    [
        ("vpp", ["vpp=2 does not divide", "[3, 3]"]),
        ("interleaved_m", ["m=3", "pp=2", "m=2 or 4"]),
        ("pp_gt_layers", ["4", "3 layers"]),
        ("chunks", ["chunks [1]", "1 chunk"]),
        ("inputs", ["4 micro-batches", "has 3"]),
        ("pp", ["schedule has 4 stages", "group has 2 ranks", "pp=2"]),
        ("peers", ["names peer stage", "pipeline of 2 ranks"]),
    ],
)
def test_bad_input_fails_on_every_rank_before_any_p2p(case, words):
    results = run_ranks(_bad_input, 2, case, timeout=30)
    if case == "inputs":  # only the first stage reads inputs, only the last targets
        assert [r is not None for r in results] == [True, True]
    for r in results:
        assert r is not None and r[2] == 0, r
        assert all(w in r[1] for w in words), r[1]


class _SlowOnce(torch.autograd.Function):
    """Identity whose first backward sleeps (a slow stage)."""

    slept = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if not _SlowOnce.slept:
            _SlowOnce.slept = True
            import time

            time.sleep(0.4)
        return g


def _slow_peer_rank():
    n_layers, pp, vpp, m = 4, 2, 2, 4
    topo, groups = make_groups(pp, 1)
    stage = topo.coords(dist.get_rank()).pp
    ranges = partition_layers(n_layers, pp, vpp=vpp)
    chunks = [
        Stage(n_layers, layers, first=(c * pp + stage == 0), last=(c * pp + stage == 3), tied=False)
        for c, layers in enumerate(stage_chunks(ranges, pp, stage))
    ]
    if stage == 1:  # the last virtual stage's backward of micro-batch 0 is slow
        head = chunks[1]
        chunks[1] = torch.nn.Sequential(
            head, type("Slow", (torch.nn.Module,), {"forward": lambda s, x: _SlowOnce.apply(x)})()
        )
    ex = PipelineExecutor(
        chunks,
        build_schedule("interleaved", pp, m, vpp)[stage],
        pp_group=groups["pp"],
        activation_shape=ACTIVATION_SHAPE,
        dtype=torch.float32,
        loss_fn=loss_fn,
        record_timeline=True,
    )
    xs, ys = data(m)
    comm.barrier()
    ex.run(xs if stage == 0 else None, ys if stage == pp - 1 else None)
    return {
        (type(s.action).__name__, s.action.mb, s.action.chunk): (
            s.start + ex.timeline_origin,
            s.end + ex.timeline_origin,
        )
        for s in ex.timeline
        if isinstance(s.action, Compute)
    }


def test_a_computation_does_not_wait_for_a_receive_it_does_not_read():
    # interleaved, stage 0: [SendA(1,1), RecvG(0,1)] F(2,0) B(0,1). F(2,0) reads nothing from that batch, so it runs
    # while stage 1's slow B(0,1) (0.4 s) still computes the gradient; awaiting the whole batch (the simulator's
    # rendezvous, the executor before issue 17's fourth round) would start it only after. Stage 1 posts the
    # receive of A(1,1) with its previous batch, so stage 0's send of it completes at once.
    s0, s1 = run_ranks(_slow_peer_rank, 2, timeout=120)
    slow_end = s1[("Backward", 0, 1)][1]
    assert s1[("Backward", 0, 1)][1] - s1[("Backward", 0, 1)][0] >= 0.35
    assert s0[("Forward", 2, 0)][0] < slow_end - 0.3
    assert s0[("Backward", 0, 1)][0] >= slow_end  # what reads the gradient waits for it
