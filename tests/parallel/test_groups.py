"""Real process groups on 8 gloo ranks, and the byte counter's figures."""

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.groups import build_groups, default_backend
from parallel.testing import run_ranks
from parallel.topology import Topology


def _group_sums():
    topo = Topology(2, 2, 2)
    g = build_groups(topo)
    me = dist.get_rank()
    out = {}
    for axis in ("tp", "dp", "pp", "mp", "embedding"):
        t = torch.tensor([float(me)])
        comm.all_reduce(t, group=g.group(axis))
        out[axis] = t.item()
    return g.coords, out


def test_all_reduce_inside_each_group_sums_exactly_its_members():
    topo = Topology(2, 2, 2)
    results = run_ranks(_group_sums, 8)
    for rank, (coords, sums) in enumerate(results):
        assert coords == topo.coords(rank)
        for axis in ("tp", "dp", "pp", "mp", "embedding"):
            members = topo.group_of(axis, rank)
            assert sums[axis] == float(sum(members)), (rank, axis, members)


def _pipeline_p2p():
    g = build_groups(Topology(2, 2, 2))
    me = dist.get_rank()
    counter = comm.CommCounter()
    with counter:
        if g.is_first_stage:
            payload = torch.arange(6, dtype=torch.float32) + 100 * me
            works = comm.exchange(sends=[(payload, g.next_rank)], group=g.pp)
            got = None
        else:
            buf = torch.empty(6)
            works = comm.exchange(recvs=[(buf, g.prev_rank)], group=g.pp)
        for w in works:
            w.wait()
        if not g.is_first_stage:
            got = buf.tolist()
        # a blocking send back up the pipe, to exercise send/recv too
        if g.is_first_stage:
            back = torch.empty(2, dtype=torch.float64)
            comm.recv(back, src=g.next_rank, group=g.pp)
            got = back.tolist()
        else:
            comm.send(torch.tensor([me, me], dtype=torch.float64), dst=g.prev_rank, group=g.pp)
    return got, counter.sent_bytes("pp"), counter.recv_bytes("pp"), counter.calls("pp")


def test_p2p_between_pipeline_neighbours_and_its_bytes():
    topo = Topology(2, 2, 2)
    results = run_ranks(_pipeline_p2p, 8)
    for rank, (got, sent, recvd, calls) in enumerate(results):
        if topo.is_first_stage(rank):
            nxt = topo.next_rank(rank)
            assert got == [float(nxt), float(nxt)]
            assert sent == 6 * 4 and recvd == 2 * 8
        else:
            prev = topo.prev_rank(rank)
            assert got == [float(i + 100 * prev) for i in range(6)]
            assert sent == 2 * 8 and recvd == 6 * 4
        assert calls == 2


def _counted_collectives(numel):
    g = build_groups(Topology(2, 1, 4))  # tp groups of 4, dp groups of 2
    counter = comm.CommCounter()
    x = torch.ones(numel)
    with counter:
        comm.all_reduce(x, group=g.tp)
        out = torch.empty(numel // 4)
        comm.reduce_scatter(out, torch.ones(numel), group=g.tp)
        full = torch.empty(numel * 2)
        comm.all_gather(full, torch.ones(numel), group=g.dp)
        comm.broadcast(x, src=g.topology.rank(dp=0, tp=g.tp_rank), group=g.dp)
        counter.enabled = False
        comm.all_reduce(x, group=g.tp)  # paused: not counted
        counter.enabled = True
        comm.all_reduce(x, group=g.pp)  # size-1 group: nothing moves
    assert torch.equal(out, torch.full((numel // 4,), 4.0))
    return counter.summary(), counter.sent_bytes("tp"), counter.sent_bytes("dp"), counter.sent_bytes()


def test_byte_counter_matches_ring_theory():
    numel = 1024
    b = numel * 4
    for summary, tp_sent, dp_sent, total in run_ranks(_counted_collectives, 8, numel):
        assert summary["tp"]["all_reduce"]["calls"] == 1
        assert summary["tp"]["all_reduce"]["payload_bytes"] == b
        assert tp_sent == pytest.approx(2 * 3 / 4 * b + 3 / 4 * b)
        assert dp_sent == pytest.approx(1 / 2 * 2 * b + 1 / 2 * b)
        assert total == pytest.approx(tp_sent + dp_sent)
        assert "pp" not in summary


def _wrong_world():
    build_groups(Topology(64, 35, 8))


def test_world_mismatch_is_an_error_on_every_rank_not_a_hang():
    with pytest.raises(Exception, match="world size 4 ≠ dp 64 × pp 35 × tp 8 = 17920"):
        run_ranks(_wrong_world, 4, timeout=20)


def test_default_backend_follows_the_hardware():
    expected = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    assert default_backend() == expected


def _two_topologies():
    a = build_groups(Topology(4, 1, 1))
    b = build_groups(Topology(1, 1, 4))
    ta, tb = torch.ones(1), torch.ones(1)
    comm.all_reduce(ta, group=a.tp)
    comm.all_reduce(tb, group=b.tp)
    return ta.item(), tb.item()


def test_two_topologies_coexist_in_one_process():
    assert run_ranks(_two_topologies, 4) == [(1.0, 4.0)] * 4


def _middle_stage_groups():
    g = build_groups(Topology(1, 3, 1))
    t = torch.ones(1)
    if g.embedding is not None:
        comm.all_reduce(t, group=g.embedding)
    return g.coords.pp, g.embedding is None, t.item()


def test_middle_pipeline_stages_have_no_embedding_group():
    assert run_ranks(_middle_stage_groups, 3) == [(0, False, 2.0), (1, True, 1.0), (2, False, 2.0)]


def _timed_wait():
    import time as _time

    g = build_groups(Topology(2, 1, 1))
    counter = comm.CommCounter()
    with counter:
        if dist.get_rank() == 1:
            _time.sleep(1.0)  # rank 0 waits for it inside the all-reduce
        comm.all_reduce(torch.ones(4), group=g.dp)
        h = comm.all_reduce(torch.ones(4), group=g.dp, async_op=True)
        h.wait()
    return counter.wait_seconds("dp"), counter.wait_seconds()


def test_counter_reports_time_blocked_in_communication():
    (w0, total0), (w1, _) = run_ranks(_timed_wait, 2)
    assert w0 >= 0.9 and total0 == w0  # rank 0 was blocked while rank 1 slept
    assert w1 < 0.9


def test_control_tensors_live_where_the_backend_wants_them():
    def check():
        return str(comm.device_for()), str(comm.device_for(build_groups(Topology(2, 1, 1)).dp))

    assert run_ranks(check, 2) == [("cpu", "cpu")] * 2  # gloo; under NCCL: this rank's GPU


def test_more_local_ranks_than_gpus_is_refused_with_the_numbers_before_set_device(monkeypatch):
    """Under NCCL, LOCAL_RANK 2 of 4 on a 2-GPU node must not reach torch.cuda.set_device."""
    from parallel import groups

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"runs 4 ranks .*LOCAL_RANK=2.* sees 2 GPU.*--nproc-per-node=2"):
        groups.init_distributed(backend="nccl")
    assert calls == []
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 0 of the same over-full node refuses too
    with pytest.raises(ValueError, match="runs 4 ranks"):
        groups.init_distributed(backend="nccl")


def test_as_many_local_ranks_as_gpus_pass_the_check():
    from parallel.groups import check_local_gpus

    check_local_gpus(7, 8, 8)
    check_local_gpus(0, 1, 8)
    with pytest.raises(ValueError, match="sees 0 GPU"):
        check_local_gpus(0, 1, 0)


def _count_new_group_calls(dp, pp, tp, cp=1, ep=1):
    calls = []
    real = dist.new_group

    def counting(ranks=None, **kw):
        calls.append((kw.get("group_desc"), tuple(ranks)))
        return real(ranks, **kw)

    dist.new_group = counting
    try:
        g = build_groups(Topology(dp, pp, tp, cp, ep))
    finally:
        dist.new_group = real
    sums = {}
    for axis in ("dp", "cp", "dpcp", "ep", "edp"):  # the groups work, and hold their members
        t = torch.tensor([1.0, float(dist.get_rank())])
        comm.all_reduce(t, group=g.group(axis))
        sums[axis] = t.tolist()
    same = g.dpcp is g.dp, g.edp is g.dpcp
    ranks = {a: (g.group(a) and dist.get_process_group_ranks(g.group(a))) for a in ("cp", "dpcp", "ep", "edp")}
    return calls, sums, same, ranks


@pytest.mark.parametrize("layout", [(2, 2, 2), (8, 1, 1), (1, 4, 2), (2, 1, 1, 2, 2), (4, 1, 1, 1, 2)])
def test_each_rank_creates_only_its_own_groups(layout):
    """Group creation costs a rank one new_group per group it belongs to (≤ 9), not one per
    group in the world (issue 12 §3.8: 3,608 per rank at DP64×PP35×TP8); the derived
    groups are the same object where they hold the same ranks (dpcp at cp=1, edp at ep=1)."""
    topo = Topology(*layout)
    for rank, (calls, sums, same, ranks) in enumerate(run_ranks(_count_new_group_calls, topo.world_size, *layout)):
        c = topo.coords(rank)
        middle = 0 < c.pp < topo.pp - 1
        expected = ["tp", "cp", "dp"] + (["dpcp"] if topo.cp > 1 else []) + ["ep"]
        expected += (["edp"] if topo.ep > 1 else []) + ["pp", "mp"] + ([] if middle else ["embedding"])
        assert [d for d, _ in calls] == expected
        assert all(rank in r for _, r in calls)
        assert same == (topo.cp == 1, topo.ep == 1)
        for axis, (count, rank_sum) in sums.items():
            members = topo.group_of(axis, rank)
            assert (count, rank_sum) == (topo.size(axis), sum(members)), axis
        for axis, r in ranks.items():
            assert sorted(r) == sorted(topo.group_of(axis, rank)), axis


def test_group_creation_per_rank_is_independent_of_the_world_size():
    from parallel.groups import my_group_ranks

    big = Topology(64, 35, 8)
    assert [len(r) for r in my_group_ranks(big, 8704).values()] == [8, 1, 64, 1, 35, 280]  # a middle stage
    assert [len(r) for r in my_group_ranks(big, 17919).values()] == [8, 1, 64, 1, 35, 280, 2]
    mixed = Topology(16, 4, 8, 2, 4)  # cp=2, ep=4: every derived group of its own
    sizes = {a: len(r) for a, r in my_group_ranks(mixed, 777).items()}
    assert sizes == {"tp": 8, "cp": 2, "dp": 16, "dpcp": 32, "ep": 4, "edp": 8, "pp": 4, "mp": 32, "embedding": 2}
