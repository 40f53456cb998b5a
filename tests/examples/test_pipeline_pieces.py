"""examples/pipeline_pieces.py: a model given as pieces trains at (dp, pp, tp) = (2, 2, 2)
exactly as in one process, and the pieces are split by the cost-balanced partitioner."""

from __future__ import annotations

import pytest
from torch import nn

from examples import pipeline_pieces as ex
from parallel.engine import chunks_from_pieces
from parallel.pipeline.partition import partition_layers
from parallel.testing import run_ranks


def test_pieces_at_dp2_pp2_tp2_train_like_one_process():
    grid = run_ranks(ex.train_grid, 8, timeout=60)
    single = ex.train_one_process()
    for rank_losses in grid:  # every rank reports the global-batch mean
        assert rank_losses == pytest.approx(single, abs=1e-5)
    assert single[-1] != single[0]  # it trained


@pytest.mark.parametrize("pp,vpp,head_cost", [(2, 1, 0.0), (3, 1, 2.0), (2, 2, 0.0)])
def test_chunks_follow_the_partitioner(pp, vpp, head_cost):
    first, last = nn.Identity(), nn.Identity()
    blocks = [nn.Linear(1, 1) for _ in range(8)]
    ranges = partition_layers(8, pp, vpp=vpp, head_cost=head_cost)
    seen = []
    for rank in range(pp):
        chunks = chunks_from_pieces(first, blocks, last, pp=pp, pp_rank=rank, vpp=vpp, head_cost=head_cost)
        assert len(chunks) == vpp
        for c, chunk in enumerate(chunks):
            virtual = c * pp + rank
            mods = list(chunk)
            assert (mods[0] is first) == (virtual == 0)
            assert (mods[-1] is last) == (virtual == len(ranges) - 1)
            held = [m for m in mods if m is not first and m is not last]
            assert held == [blocks[i] for i in ranges[virtual]]
            seen += held
    assert sorted(map(id, seen)) == sorted(map(id, blocks))  # every block once
