"""``recommend`` searches ZeRO-2/3's gradient accumulation (sharded: a reduce-scatter every micro-batch;
unsharded: the full fp32 gradient held, one reduce-scatter per step) where the stage takes it, and each
ZeRO-2/3 plan's advice prices the other choice as the planner prices that plan itself."""

import dataclasses

import pytest

from parallel.plan import Layout, Training, candidate_layouts, hardware_profile, plan_layout, recommend
from parallel.plan.advice import GB, accumulation_choice, dp_sent_bytes
from parallel.plan.search import accumulations, other_accumulation
from parallel.zero.theory import accumulation_grad_bytes

from .test_recommend import SHAPE, count

HW = dataclasses.replace(hardware_profile("a100_80gb"), memory_bytes=3e9)


@pytest.fixture(scope="module")
def plans():
    return recommend(SHAPE, 8, Training(64, 1), HW, count, top=400, micro_batches=(1, 2), zeros=(1, 2, 3))


def test_both_accumulations_are_searched_only_where_the_stage_takes_them(plans):
    seen = {(p.layout["zero"], p.layout["accumulate"]) for p in plans}
    assert seen == {(1, "sharded"), (2, "sharded"), (2, "unsharded"), (3, "sharded"), (3, "unsharded")}
    assert accumulations(("sharded", "unsharded"), 1, "none") == ("sharded",)
    assert accumulations(("sharded", "unsharded"), 3, "optimizer") == ("sharded",)  # offload refuses unsharded
    assert accumulations("unsharded", 2, "none") == ("unsharded",)
    offloaded = candidate_layouts(SHAPE, 8, HW, zeros=(2, 3), offload="optimizer")
    assert offloaded and {lay.accumulate for lay in offloaded} == {"sharded"}


def test_unsharded_is_priced_only_where_sharded_fits_over_several_micro_batches(plans):
    def key(p):
        return repr(({**p.layout, "accumulate": None}, p.training))

    sharded = {key(p): p for p in plans if p.layout["accumulate"] == "sharded"}
    unsharded = [p for p in plans if p.layout["accumulate"] == "unsharded"]
    assert unsharded and all(key(p) in sharded for p in unsharded)  # its sharded twin fits too
    for p in unsharded:
        twin = sharded[key(p)]
        assert p.grad_accum > 1 and dp_sent_bytes(p) < dp_sent_bytes(twin) and p.peak_memory > twin.peak_memory
    one_micro_batch = recommend(SHAPE, 8, Training(8, 1), HW, count, top=400, micro_batches=(1,), zeros=(2, 3))
    at_dp8 = {p.layout["accumulate"] for p in one_micro_batch if p.layout["dp"] == 8}
    assert at_dp8 == {"sharded"}  # one micro-batch per step: the same bytes, more memory
    assert all(p.grad_accum > 1 for p in one_micro_batch if p.layout["accumulate"] == "unsharded")


def test_advice_prices_the_other_accumulation_as_its_own_plan(plans):
    noted = [p for p in plans[:5] if p.layout["zero"] >= 2] or [p for p in plans if p.layout["zero"] >= 2][:3]
    top = recommend(SHAPE, 8, Training(64, 1), HW, count, top=5, micro_batches=(1, 2), zeros=(1, 2, 3))
    for p in top:
        assert any("accumulating" in a for a in p.advice) == (p.layout["zero"] >= 2)
    for p in noted:
        layout = {k: v for k, v in p.layout.items() if k != "pp_layers"}
        other_acc = "unsharded" if p.layout["accumulate"] == "sharded" else "sharded"
        tr = Training(**p.training)
        other = plan_layout(SHAPE, Layout(**{**layout, "accumulate": other_acc}), tr, HW, count)
        assert other_accumulation(SHAPE, p, HW, count).ranks == other.ranks
        line = accumulation_choice(p, other, HW)
        assert f"with parallel.zero_accumulate={other_acc} (" in line
        for plan in (p, other):
            sent, peak = dp_sent_bytes(plan), plan.peak_memory
            assert f"{sent / GB:.2f} GB sent" in line or f"{sent / 1e6:.2f} MB sent" in line
            assert f"peak {peak / GB:.2f} GB" in line or f"peak {peak / 1e6:.2f} MB" in line
        unsharded = p if p.layout["accumulate"] == "unsharded" else other
        held = accumulation_grad_bytes(unsharded.ranks[0].params.numel, p.layout["zero"], "unsharded")
        assert held > 0 and f"the full fp32 gradient held: {held / GB:.2f} GB" in line
        assert f"{p.grad_accum} reduce-scatters per step" in line and "1 reduce-scatter per step" in line
    assert noted
    assert other_accumulation(SHAPE, next(p for p in plans if p.layout["zero"] == 1), HW, count) is None


@pytest.mark.parametrize(
    "layout, mb, pp_layers",
    [
        (Layout(dp=2, pp=5, zero=3, accumulate="unsharded"), 1, None),  # uneven stages, m ≥ pp: in flight differs
        (Layout(pp=4, tp=2, schedule="interleaved", vpp=2, zero=0), 2, (6, 6, 6, 6)),
        (Layout(dp=2, pp=3, schedule="zb-h1", zero=1, offload="optimizer"), 1, None),
    ],
)
def test_alike_stages_are_priced_once_with_the_same_numbers(monkeypatch, layout, mb, pp_layers):
    """The planner prices one stage of each alike kind and copies it to the others (``recommend`` speed);
    every number equals pricing each stage on its own."""
    import parallel.plan.planner as P

    tr = Training(32, mb, checkpointing="selective")
    shared = plan_layout(SHAPE, layout, tr, HW, count, pp_layers=pp_layers).to_dict()
    monkeypatch.setattr(P, "alike_key", lambda ctx, chunks: tuple(v for v, _ in chunks))  # every stage its own
    alone = plan_layout(SHAPE, layout, tr, HW, count, pp_layers=pp_layers).to_dict()
    assert shared == alone
    if layout.schedule == "1f1b":  # 1F1B: alike stages hold different micro-batches in flight
        assert len({r["in_flight"] for r in alone["ranks"]}) > 1
