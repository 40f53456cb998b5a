"""Boxes of flat ranges and their global placement, checked against torch's own indexing."""

import math
import random

import pytest
import torch

from parallel.checkpoint import CheckpointError, flat_range_boxes, to_global, tp_placement


def _read_boxes(t: torch.Tensor, boxes):
    return torch.cat([t[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes])


@pytest.mark.parametrize("seed", range(40))
def test_boxes_tile_the_flat_range_in_memory_order(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
    n = math.prod(shape)
    start = rng.randint(0, n - 1)
    end = rng.randint(start + 1, n)
    t = torch.arange(n).view(shape)
    boxes = flat_range_boxes(shape, start, end)
    assert torch.equal(_read_boxes(t, boxes), torch.arange(start, end))
    assert len(boxes) <= 2 * len(shape) - 1  # a leading and a trailing partial part per dimension, one middle


def test_whole_rows_are_one_box_and_bad_ranges_are_refused():
    assert flat_range_boxes((4, 3), 3, 9) == [((1, 0), (2, 3))]
    assert flat_range_boxes((4, 3), 5, 5) == []
    with pytest.raises(CheckpointError, match=r"\[2, 13\).*\(4, 3\)"):
        flat_range_boxes((4, 3), 2, 13)


@pytest.mark.parametrize("dim", [0, 1])
def test_tp_placement_matches_torch_chunk(dim):
    full = torch.arange(8 * 6).view(8, 6)
    for r, shard in enumerate(full.chunk(2, dim=dim)):
        place = tp_placement(shard.shape, dim, r, 2)
        assert place.global_shape == (8, 6)
        box = to_global(((0, 0), tuple(shard.shape)), place)
        assert torch.equal(full[tuple(slice(o, o + s) for o, s in zip(*box))], shard)


def test_vocabulary_padding_rows_are_cut():
    # vocabulary 5 padded to 8 rows over tp 2: rank 1 holds rows 4..7, only row 4 is real
    place = tp_placement((4, 3), 0, 1, 2, rows=5)
    assert place.global_shape == (5, 3)
    assert to_global(((0, 0), (4, 3)), place) == ((4, 0), (1, 3))
    assert to_global(((1, 0), (3, 3)), place) is None
    with pytest.raises(CheckpointError, match="dim 1"):
        to_global(((0, 0), (1, 4)), place)
