"""parallel.overlap: the engine does what the table says, and the planner prices what the table says.

Engine checks record the order of launches and compute on two gloo ranks (one spawn for all);
planner checks flip one row and see the plan move the right way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import parallel.overlap as ov
import parallel.plan.buffers as plan_buffers
import parallel.plan.cp as plan_cp
import parallel.plan.exposure as plan_exposure
import parallel.plan.offload as plan_offload
import parallel.plan.pipeline as plan_pipeline
import parallel.plan.stage as plan_stage
from parallel.plan import Layout, Training, plan_layout
from parallel.testing import run_ranks

from .plan.test_planner import HW, SHAPE, count

EXPOSED = dict(hidden_behind="")


# ------------------------------------------------------------------------- the table itself


def test_rows_say_when_they_hide():
    assert ov.DP_REDUCTION.hidden(True) and not ov.DP_REDUCTION.hidden(False)
    assert ov.ZERO3_GATHER.hidden(False)  # prefetch does not depend on comm.overlap
    for row in (ov.TP_COLLECTIVES, ov.PIPELINE_P2P, ov.ULYSSES_ALL_TO_ALL, ov.OFFLOAD_STEP):
        assert not row.hidden(True) and row.exposed(3.0, 10.0) == 3.0
    assert ov.RING_ATTENTION.exposed(3.0, 1.0) == 2.0 and ov.RING_ATTENTION.exposed(3.0, 10.0) == 0.0
    # hidden parts share one window; exposed ones add up
    assert ov.exposed_sharing(5.0, (ov.DP_REDUCTION, 3.0), (ov.ZERO3_GATHER, 4.0)) == 2.0
    assert ov.exposed_sharing(5.0, (ov.DP_REDUCTION, 3.0), (ov.ZERO3_GATHER, 4.0), overlap=False) == 3.0


def test_docs_show_the_table():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    assert ov.table_markdown() in docs, "regenerate docs/planner.md's 'What overlaps' from parallel.overlap"


# ------------------------------------------------------------------------- the planner reads it


def _plan(layout, hw=HW, **training):
    return plan_layout(SHAPE, layout, Training(16, 2, **{"precision": "bf16", **training}), hw, count)


SLOW = dataclasses.replace(HW, intra_node_gbps=0.05, inter_node_gbps=0.05)


def test_dp_reduction_row_drives_the_overlap_flag(monkeypatch):
    buckets = {"bucket_mb": 0.01}  # several: the last bucket's reduction always follows backward
    on, off = (_plan(Layout(dp=8, zero=2), SLOW, overlap=o, **buckets).step["dp_exposed_s"] for o in (True, False))
    assert on < off
    monkeypatch.setattr(plan_exposure, "DP_REDUCTION", dataclasses.replace(ov.DP_REDUCTION, needs_overlap_flag=False))
    assert _plan(Layout(dp=8, zero=2), SLOW, overlap=False, **buckets).step["dp_exposed_s"] == pytest.approx(on)


@pytest.mark.parametrize("overlap", [True, False])
def test_zero3_prefetch_hides_gathers_whatever_the_flag(monkeypatch, overlap):
    hidden = _plan(Layout(dp=8, zero=3), SLOW, overlap=overlap).step["dp_exposed_s"]
    monkeypatch.setattr(plan_exposure, "ZERO3_GATHER", dataclasses.replace(ov.ZERO3_GATHER, **EXPOSED))
    assert _plan(Layout(dp=8, zero=3), SLOW, overlap=overlap).step["dp_exposed_s"] > hidden


def test_prefetch_depth_sizes_the_gathered_buffers(monkeypatch):
    one = _plan(Layout(dp=8, zero=3)).ranks[0].memory["buffers"]
    monkeypatch.setattr(plan_buffers, "ZERO3_PREFETCH_UNITS", ov.ZERO3_PREFETCH_UNITS + 1)
    unit = count(range(0, 1), False, False, 1).numel * 2  # bf16
    assert _plan(Layout(dp=8, zero=3)).ranks[0].memory["buffers"] == pytest.approx(one + unit)


@pytest.mark.parametrize(
    ("module", "row", "layout", "key"),
    [
        (plan_stage, "TP_COLLECTIVES", Layout(tp=4), "step_time_s"),
        (plan_pipeline, "PIPELINE_P2P", Layout(pp=4), "pipeline_s"),
    ],
)
def test_exposed_rows_hidden_would_shorten_the_step(monkeypatch, module, row, layout, key):
    exposed = _plan(layout, SLOW).step[key]
    monkeypatch.setattr(module, row, dataclasses.replace(getattr(ov, row), hidden_behind="compute"))
    assert _plan(layout, SLOW).step[key] < exposed


@pytest.mark.parametrize(
    ("module", "row", "layout", "key"),
    [
        (plan_cp, "RING_ATTENTION", Layout(cp=2), "step_time_s"),
        (plan_stage, "TP_SP_BACKWARD", Layout(tp=4, sequence_parallel=True), "step_time_s"),
        (plan_offload, "OFFLOAD_PARAM_PAGING", Layout(dp=8, zero=3, offload="optimizer+params"), "offload_s"),
    ],
)
def test_hidden_rows_exposed_would_lengthen_the_step(monkeypatch, module, row, layout, key):
    hidden = _plan(layout, SLOW).step[key]
    monkeypatch.setattr(module, row, dataclasses.replace(getattr(ov, row), **EXPOSED))
    assert _plan(layout, SLOW).step[key] > hidden


# ------------------------------------------------------------------------- the engine does it


def _zero_order(stage: int, overlap: bool, depth: int | None = None):
    """Events of one micro-batch: ("gather", unit) when a gather launches, ("fwd"/"bwd", unit)
    at a block's compute, ("reduce", bucket) when a reduction launches."""
    import torch.distributed as dist

    import parallel.zero.units as units
    from parallel.zero import ZeroConfig, ZeroDataParallel
    from parallel.zero.bucket import FlatBucket

    from .zero.toy import adamw, batches, make_model

    if depth is not None:
        units.ZERO3_PREFETCH_UNITS = depth
    model = make_model()
    blocks = list(model.blocks)
    zdp = ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, bucket_mb=1e-4, overlap=overlap),
        dp_group=dist.group.WORLD,
        optimizer_factory=adamw,
        units=blocks,
    )
    events = []
    start, launch = FlatBucket.start_gather, FlatBucket.launch_reduction

    def start_gather(b):
        if not (b.gathered or b._gather is not None):
            events.append(("gather", b.layout.unit))
        start(b)

    def launch_reduction(b):
        events.append(("reduce", b.layout.index))
        launch(b)

    FlatBucket.start_gather, FlatBucket.launch_reduction = start_gather, launch_reduction
    for u, blk in enumerate(blocks):
        blk.fc.register_forward_hook(lambda *_, u=u: events.append(("fwd", u)))
        blk.fc.register_full_backward_hook(lambda *_, u=u: events.append(("bwd", u)))
    model.inp.register_full_backward_pre_hook(lambda *_: events.append(("bwd", "inp")))
    x, y = batches(steps=1)[0]
    loss = ((zdp(x) - y) ** 2).mean()
    fwd_events = list(events)
    zdp.backward(loss)
    FlatBucket.start_gather, FlatBucket.launch_reduction = start, launch
    return fwd_events, events[len(fwd_events) :]


def _tp_and_ring_order():
    """(async flag of every TP collective, plain and sequence parallel), the ring's post/compute/wait order."""
    import sys

    import torch.distributed as dist

    import parallel.comm.collectives as collectives
    from parallel import comm
    from parallel.layers.linear import ColumnParallelLinear, RowParallelLinear

    calls, call = [], collectives._call

    def recording(label, name, async_op, *args, **kwargs):
        calls.append((name, async_op))
        return call(label, name, async_op, *args, **kwargs)

    ring = sys.modules["parallel.layers.ring_attention"]  # the package exports a function of the same name
    collectives._call = recording
    torch.manual_seed(0)
    tp = {}
    for sp in (False, True):
        col = ColumnParallelLinear(8, 16, tp_group=dist.group.WORLD, sequence_parallel=sp)
        row = RowParallelLinear(16, 8, tp_group=dist.group.WORLD, sequence_parallel=sp)
        x = torch.randn(2, 4, 8, requires_grad=True)
        calls.clear()
        out = row(torch.relu(col(x)))
        fwd = list(calls)
        out.sum().backward()
        tp[sp] = (fwd, calls[len(fwd) :])
    collectives._call = call

    order, exchange, attend = [], comm.exchange, ring._attend

    def posting(*a, **k):
        order.append("post")
        works = exchange(*a, **k)
        return [_Logged(w, order) for w in works]

    def attending(*a, **k):
        order.append("compute")
        return attend(*a, **k)

    comm.exchange, ring._attend = posting, attending
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    ring.ring_attention(q, k, v, dist.group.WORLD)
    comm.exchange, ring._attend = exchange, attend
    return tp, order


class _Logged:
    def __init__(self, work, order):
        self.work, self.order = work, order

    def wait(self, *a, **k):
        self.order.append("wait")
        return self.work.wait(*a, **k)


def _engine(_=None):
    return {
        "z3": _zero_order(3, True),
        "z3_depth2": _zero_order(3, True, depth=2),
        "z2_on": _zero_order(2, True),
        "z2_off": _zero_order(2, False),
        "tp_ring": _tp_and_ring_order(),
    }


@pytest.fixture(scope="module")
def engine():
    return run_ranks(_engine, 2, timeout=120)[0]


def _at(events, e):
    return events.index(e)


@pytest.mark.parametrize("depth", [1, 2])
def test_zero3_gathers_unit_k_plus_depth_before_unit_k_computes(engine, depth):
    from .zero.toy import BLOCKS

    fwd, bwd = engine["z3" if depth == 1 else "z3_depth2"]
    for u in range(BLOCKS - depth):
        assert _at(fwd, ("gather", u + depth)) < _at(fwd, ("fwd", u))
    for u in range(depth, BLOCKS):  # backward: unit u − depth prefetched before unit u's backward ends
        assert _at(bwd, ("gather", u - depth)) < _at(bwd, ("bwd", u))
    if depth == 1:  # the table's depth, and no deeper: unit 2 is not gathered before unit 0 computes
        assert _at(fwd, ("gather", 2)) > _at(fwd, ("fwd", 0))
    assert ov.ZERO3_PREFETCH_UNITS == 1


def test_dp_reduction_launches_inside_backward_only_with_overlap(engine):
    _, on = engine["z2_on"]
    _, off = engine["z2_off"]
    reduces = lambda ev: [i for i, e in enumerate(ev) if e[0] == "reduce"]  # noqa: E731
    assert ov.DP_REDUCTION.hidden(True) and reduces(on)[0] < _at(on, ("bwd", "inp"))
    assert not ov.DP_REDUCTION.hidden(False) and reduces(off)[0] > _at(off, ("bwd", "inp"))
    assert len(reduces(on)) == len(reduces(off)) > 2


def test_tp_collectives_block_except_sequence_parallel_column_backward(engine):
    tp, _ = engine["tp_ring"]
    fwd, bwd = tp[False]
    assert fwd and bwd and not any(a for _, a in fwd + bwd)  # TP_COLLECTIVES: exposed
    fwd, bwd = tp[True]
    assert not any(a for _, a in fwd)
    # TP_SP_BACKWARD: the column layer's input re-gather and input-gradient reduce-scatter run async
    assert sorted(n for n, a in bwd if a) == ["all_gather", "reduce_scatter"]
    assert not ov.TP_COLLECTIVES.hidden() and ov.TP_SP_BACKWARD.hidden()


def test_ring_posts_the_next_hop_before_this_blocks_compute(engine):
    _, order = engine["tp_ring"]
    order = [x for i, x in enumerate(order) if i == 0 or x != order[i - 1]]  # one "wait" per handle
    assert order == ["post", "compute", "wait", "compute"]  # cp = 2: one hop, hidden behind block 0
    assert ov.RING_ATTENTION.hidden()
