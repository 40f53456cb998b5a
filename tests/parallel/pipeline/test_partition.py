import itertools

import pytest

from parallel.pipeline.partition import PartitionError, partition_layers, stage_chunks, stage_costs


def _optimal_max_cost(n, pp, lc, extra):
    """Brute force over every contiguous split (small n only)."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        sizes = [b - a for a, b in zip((0,) + cuts, cuts + (n,))]
        best = min(best, max(e + s * lc for e, s in zip(extra, sizes)))
    return best


@pytest.mark.parametrize(
    "n, pp, emb, head",
    [
        (7, 3, 0, 0),
        (8, 4, 1, 1),
        (10, 3, 2.5, 0.5),
        (9, 4, 0, 3),
        (12, 5, 1.5, 1.5),
        (6, 6, 4, 4),
    ],
)
def test_balanced_split_is_optimal_and_covers_the_layers(n, pp, emb, head):
    ranges = partition_layers(n, pp, embedding_cost=emb, head_cost=head)
    assert [i for r in ranges for i in r] == list(range(n))
    assert all(len(r) >= 1 for r in ranges)
    extra = [0.0] * pp
    extra[0] += emb
    extra[-1] += head
    assert max(stage_costs(ranges, embedding_cost=emb, head_cost=head)) == _optimal_max_cost(n, pp, 1.0, extra)


def test_gpt3_96_layers_on_35_stages():
    ranges = partition_layers(96, 35)
    counts = [len(r) for r in ranges]
    assert sum(counts) == 96 and max(counts) - min(counts) == 1
    assert max(stage_costs(ranges)) == 3  # ceil(96 / 35): optimal
    # embedding and head weighed as ~2 layers each: the end stages take fewer blocks
    ranges = partition_layers(96, 35, embedding_cost=2.0, head_cost=2.0)
    costs = stage_costs(ranges, embedding_cost=2.0, head_cost=2.0)
    optimum = -(-(96 + 4) // 35)  # total cost spread evenly, rounded up to whole layers
    assert max(costs) <= optimum and max(costs) - min(costs) <= 2
    assert len(ranges[0]) == 1 and len(ranges[-1]) == 1


def test_explicit_pp_layers_and_virtual_stages():
    assert partition_layers(7, 3, pp_layers=[1, 2, 4]) == [range(0, 1), range(1, 3), range(3, 7)]
    ranges = partition_layers(8, 2, vpp=2, pp_layers=[6, 2])
    assert ranges == [range(0, 3), range(3, 4), range(4, 7), range(7, 8)]
    assert stage_chunks(ranges, 2, 0) == [range(0, 3), range(4, 7)]
    assert stage_costs(ranges, 2, head_cost=1.0) == [6.0, 3.0]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(n_layers=3, pp=4), ["4", "3 layers"]),
        (dict(n_layers=8, pp=2, vpp=8), ["16", "8 layers"]),
        (dict(n_layers=7, pp=3, pp_layers=[3, 3, 3]), ["sums to 9", "7 layers"]),
        (dict(n_layers=7, pp=3, pp_layers=[3, 4]), ["2 entries", "pp=3"]),
        (dict(n_layers=7, pp=3, pp_layers=[0, 3, 4]), ["pp_layers[0]"]),
        (dict(n_layers=6, pp=2, vpp=2), ["vpp=2 does not divide", "[3, 3]", "multiple of pp·vpp = 4"]),
        (dict(n_layers=8, pp=0), ["pp must be a positive integer"]),
    ],
)
def test_bad_splits_are_refused_with_the_numbers(kwargs, words):
    with pytest.raises(PartitionError) as e:
        partition_layers(**kwargs)
    assert isinstance(e.value, ValueError)
    assert all(w in str(e.value) for w in words), str(e.value)
