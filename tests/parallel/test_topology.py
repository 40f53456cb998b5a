"""The process grid: pure arithmetic, no processes."""

import itertools

import pytest

from parallel.topology import AXES, Coords, Topology, TopologyError

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]
SIZES = [(1, 1, 1), (2, 1, 1), (1, 3, 1), (1, 1, 4), (2, 2, 2), (3, 2, 4), (4, 5, 2), (2, 3, 1)]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dp,pp,tp", SIZES)
def test_grid_properties(dp, pp, tp, order):
    t = Topology(dp, pp, tp, order=order)
    assert t.world_size == dp * pp * tp
    seen = set()
    for r in range(t.world_size):
        c = t.coords(r)
        assert t.rank(dp=c.dp, pp=c.pp, tp=c.tp) == r
        seen.add((c.dp, c.pp, c.tp))
    assert len(seen) == t.world_size  # bijective

    for axis in AXES:
        groups = t.groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(t.world_size)), f"{axis} groups do not partition the world"
        assert all(len(g) == t.size(axis) for g in groups)
        for g in groups:
            cs = [t.coords(r) for r in g]
            others = [a for a in AXES if a != axis]
            # members differ only along `axis`, listed in order of its index
            assert len({tuple(c[a] for a in others) for c in cs}) == 1
            assert [c[axis] for c in cs] == list(range(t.size(axis)))
            for r in g:
                assert t.group_of(axis, r) == g

    # DP groups of the same (pp, tp) hold matching ranks: rank(dp=i) in order
    for g in t.groups("dp"):
        c0 = t.coords(g[0])
        assert g == [t.rank(dp=i, pp=c0.pp, tp=c0.tp) for i in range(dp)]

    # model-parallel group: every (pp, tp) of one dp index
    mp = t.model_parallel_groups
    assert sorted(r for g in mp for r in g) == list(range(t.world_size))
    for g in mp:
        assert len({t.coords(r).dp for r in g}) == 1 and len(g) == pp * tp
        assert t.group_of("mp", g[0]) == g

    # embedding group = first and last stage of the same pipeline
    for g, pipe in zip(t.embedding_groups, t.groups("pp")):
        assert g == sorted({pipe[0], pipe[-1]})
        assert t.is_first_stage(pipe[0]) and t.is_last_stage(pipe[-1])
        assert t.group_of("embedding", pipe[0]) == g

    # pipeline neighbours walk each pipe in order
    for pipe in t.groups("pp"):
        assert t.prev_rank(pipe[0]) is None and t.next_rank(pipe[-1]) is None
        for a, b in zip(pipe, pipe[1:]):
            assert t.next_rank(a) == b and t.prev_rank(b) == a


def test_default_order_formula():
    t = Topology(dp=3, pp=4, tp=2)
    for p, d, k in itertools.product(range(4), range(3), range(2)):
        assert t.rank(dp=d, pp=p, tp=k) == (p * 3 + d) * 2 + k


def test_2x2x2_by_hand():
    t = Topology(2, 2, 2)
    assert t.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.model_parallel_groups == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert t.embedding_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.coords(6) == Coords(dp=1, pp=1, tp=0)
    assert t.next_rank(2) == 6 and t.prev_rank(6) == 2


def test_other_order_by_hand():
    # pipeline fastest: the two stages of a pipeline are adjacent ranks
    t = Topology(2, 2, 2, order="pp-tp-dp")
    assert t.groups("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_gpt3_layout_first_and_last_groups():
    t = Topology(64, 35, 8)
    assert t.world_size == 17920
    assert t.groups("tp")[0] == list(range(8))
    assert t.groups("tp")[-1] == list(range(17912, 17920))
    assert t.groups("dp")[0] == [8 * i for i in range(64)]
    assert t.groups("dp")[-1] == [34 * 512 + 7 + 8 * i for i in range(64)]
    assert t.groups("pp")[0] == [512 * i for i in range(35)]
    assert t.groups("pp")[-1] == [511 + 512 * i for i in range(35)]
    assert t.embedding_groups[0] == [0, 34 * 512]
    assert t.model_parallel_groups[0][:9] == [0, 1, 2, 3, 4, 5, 6, 7, 512]
    assert len(t.groups("tp")) == 2240 and len(t.groups("dp")) == 280 and len(t.groups("pp")) == 512


def test_auto_dp():
    assert Topology(None, 35, 8, world_size=17920).dp == 64
    assert Topology("auto", 2, 2, world_size=8).dp == 2


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(dp=64, pp=35, tp=8, world_size=8), "world size 8 ≠ dp 64 × pp 35 × tp 8 = 17920"),
        (dict(dp=64, pp=35, tp=8, world_size=8), "multiple of 280"),
        (dict(dp=None, pp=3, tp=2, world_size=8), "not divisible by pp 3 × tp 2 = 6"),
        (dict(dp=None, pp=2, tp=2), "needs the world size"),
        (dict(dp=0, pp=1, tp=1), "dp must be a positive integer, got 0"),
        (dict(dp=1, pp=-2, tp=1), "pp must be a positive integer, got -2"),
        (dict(dp=1, pp=1, tp=2.0), "tp must be a positive integer, got 2.0"),
        (dict(dp=1, pp=1, tp=True), "tp must be a positive integer, got True"),
        (dict(dp="2", pp=1, tp=1), "dp must be a positive integer"),
        (dict(dp=1, pp=1, tp=1, order="tp-dp"), "order must name each of dp, pp, tp"),
        (dict(dp=1, pp=1, tp=1, order="tp-cp-dp-pp-cp"), "order must name each of dp, pp, tp"),
    ],
)
def test_bad_sizes_are_refused_with_numbers(kwargs, needle):
    with pytest.raises(TopologyError) as e:
        Topology(**kwargs)
    assert needle in str(e.value)


def test_bad_lookups():
    t = Topology(2, 2, 2)
    with pytest.raises(TopologyError, match="rank 8 out of range for world size 8"):
        t.coords(8)
    with pytest.raises(TopologyError, match="tp index 2 out of range"):
        t.rank(tp=2)
    with pytest.raises(TopologyError, match="unknown axis"):
        t.groups("xp")


def test_describe_names_nodes_and_flags_tp_crossing_nodes():
    text = Topology(2, 2, 2).describe(gpus_per_node=4)
    assert "node 0: 0:(0,0,0) 1:(0,0,1) 2:(1,0,0) 3:(1,0,1)" in text
    assert "node 1: 4:(0,1,0)" in text
    assert "every TP group stays inside one node" in text
    bad = Topology(1, 1, 8).describe(gpus_per_node=4)
    assert "1 of 1 TP groups cross a node boundary" in bad
    big = Topology(64, 35, 8).describe()
    assert "2240 node(s)" in big and "more nodes" in big and len(big.splitlines()) < 20
    assert "world size 17920" in repr(Topology(64, 35, 8))


def test_describe_says_gpus_only_for_gpu_ranks():
    assert "1 node(s) × 8 GPUs;" in Topology(2, 2, 2).describe(8)
    cpu = Topology(1, 2, 2).describe(4, device="cpu")
    assert "1 node(s) × 4 CPU processes;" in cpu and "GPU" not in cpu


def test_docstring_examples_hold():
    import doctest

    import parallel.topology

    result = doctest.testmod(parallel.topology)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "cp-tp-pp-dp", "dp-cp-pp-tp", "tp-dp-pp"])
@pytest.mark.parametrize("dp,pp,tp,cp,ep", [(2, 1, 1, 2, 1), (4, 2, 2, 2, 2), (4, 1, 2, 3, 4), (6, 2, 1, 1, 3)])
def test_cp_axis_and_derived_groups(dp, pp, tp, cp, ep, order):
    t = Topology(dp, pp, tp, cp, ep, order=order)
    assert t.world_size == dp * pp * tp * cp
    for r in range(t.world_size):
        c = t.coords(r)
        assert t.rank(dp=c.dp, pp=c.pp, tp=c.tp, cp=c.cp) == r
    for axis in AXES + ("dpcp", "ep", "edp"):
        groups = t.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(t.world_size)), axis
        assert all(len(g) == t.size(axis) for g in groups), axis
        for g in groups:
            assert all(t.group_of(axis, r) == g for r in g), axis
            cs = [t.coords(r) for r in g]
            if axis not in ("pp", "tp"):  # data-side groups never cross a model shard
                assert len({(c.pp, c.tp) for c in cs}) == 1
            if axis == "dpcp":
                assert [t.dpcp_index(r) for r in g] == list(range(dp * cp))
            if axis == "ep":  # ep consecutive dp indices, one cp slice
                assert len({c.cp for c in cs}) == 1 and [t.ep_index(r) for r in g] == list(range(ep))
                assert len({c.dp // ep for c in cs}) == 1
            if axis == "edp":  # the same expert shard, every copy and every cp slice
                assert len({t.ep_index(r) for r in g}) == 1 and [t.edp_index(r) for r in g] == list(
                    range(dp // ep * cp)
                )
    # the dense group is dp × cp; the expert groups split it: ep × edp covers it exactly once
    for g in t.groups("dpcp"):
        for r in g:
            assert set(t.group_of("ep", r)) <= set(g) and set(t.group_of("edp", r)) <= set(g)
        assert {(t.ep_index(r), t.edp_index(r)) for r in g} == {(e, k) for e in range(ep) for k in range(dp // ep * cp)}
    # pipeline neighbours keep the cp slice; tied embeddings pair the same slice
    for r in range(t.world_size):
        nxt = t.next_rank(r)
        if nxt is not None:
            assert t.coords(nxt).cp == t.coords(r).cp and t.prev_rank(nxt) == r
        assert len({t.coords(x).cp for x in t.group_of("embedding", r)}) == 1


def test_cp_default_order_formula_and_by_hand():
    t = Topology(dp=3, pp=2, tp=2, cp=2)
    for p, d, k, c in itertools.product(range(2), range(3), range(2), range(2)):
        assert t.rank(dp=d, pp=p, tp=k, cp=c) == ((p * 3 + d) * 2 + c) * 2 + k
    t = Topology(2, 1, 1, 2, 2)  # 4 ranks: tp=1, cp fastest, then dp
    assert t.groups("cp") == [[0, 1], [2, 3]]
    assert t.groups("dp") == [[0, 2], [1, 3]]
    assert t.groups("dpcp") == [[0, 1, 2, 3]]
    assert t.groups("ep") == [[0, 2], [1, 3]]
    assert t.groups("edp") == [[0, 1], [2, 3]]
    assert t.coords(3) == Coords(dp=1, pp=0, tp=0, cp=1)
    # an order without cp keeps every rank of the three-axis grid
    assert Topology(2, 2, 2, order="tp-dp-pp") == Topology(2, 2, 2) == Topology(2, 2, 2, order="tp-dp-cp-pp")
    assert "cp=2, ep=2" in repr(t) and "order='tp-cp-dp-pp'" in repr(t)
    assert "order='tp-dp-pp'" in repr(Topology(2, 2, 2))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(dp=2, pp=1, tp=2, cp=2, world_size=6), "world size 6 ≠ dp 2 × pp 1 × tp 2 × cp 2 = 8"),
        (dict(dp=None, pp=1, tp=2, cp=3, world_size=8), "not divisible by pp 1 × tp 2 × cp 3 = 6"),
        (dict(dp=6, cp=0), "cp must be a positive integer, got 0"),
        (dict(dp=6, ep=4), "ep 4 does not divide dp 6"),
        (dict(dp=6, ep=4), "divisors of dp 6: [1, 2, 3, 6]"),
        (dict(dp=None, cp=2, ep=3, world_size=8), "ep 3 does not divide dp 4"),
    ],
)
def test_bad_cp_and_ep_are_refused_with_numbers(kwargs, needle):
    with pytest.raises(TopologyError) as e:
        Topology(**kwargs)
    assert needle in str(e.value)


def test_describe_shows_cp_and_ep():
    text = Topology(2, 1, 2, 2, 2).describe(gpus_per_node=4)
    assert "node 0: 0:(0,0,0,0) 1:(0,0,1,0) 2:(0,0,0,1) 3:(0,0,1,1)" in text
    assert "rank:(dp,pp,tp,cp)" in text and "ep=2" in text and "2 rank(s) hold each expert shard" in text
