"""init_parameters_ keys a parameter on its full name (``prefix``): two blocks initialised one by one
differ, their gathered weights agree at every tp, and pieces drawn alike are refused where the model is
put together. The pieces' checkpoint names do not depend on the pipeline split."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.engine import ModelChunks
from parallel.layers import LayerConfigError, LayerNorm, ParallelMLP, gather_full_tensor, init_parameters_
from parallel.layers.init import check_distinct_init
from parallel.pieces import chunks_from_pieces, piece_prefix
from parallel.testing import run_ranks

D, F = 8, 32


class Block(nn.Module):
    def __init__(self, tp_group=None):
        super().__init__()
        self.norm = LayerNorm(D)
        self.mlp = ParallelMLP(D, F, tp_group=tp_group)


def _blocks(tp_group=None, prefixed=True, n=2):
    return [
        init_parameters_(
            Block(tp_group), seed=0, tp_group=tp_group, prefix=piece_prefix("blocks", i) if prefixed else ""
        )
        for i in range(n)
    ]


def _full(blocks, tp_group=None):
    return [{n: gather_full_tensor(p, tp_group) for n, p in b.named_parameters()} for b in blocks]


def test_two_blocks_with_one_seed_differ_when_prefixed():
    a, b = _full(_blocks())
    assert not torch.equal(a["mlp.fc_in.weight"], b["mlp.fc_in.weight"])
    same_a, same_b = _full(_blocks(prefixed=False))
    assert torch.equal(same_a["mlp.fc_in.weight"], same_b["mlp.fc_in.weight"])  # what the refusal is about


def test_blocks_drawn_alike_are_refused_where_the_model_is_put_together():
    blocks = _blocks(prefixed=False)
    with pytest.raises(
        LayerConfigError, match=r"blocks\.0\.mlp\.fc_in\.weight and blocks\.1\.mlp\.fc_in\.weight.*prefix='blocks\.1\.'"
    ):
        chunks_from_pieces(nn.Identity(), blocks, nn.Identity(), pp=1, pp_rank=0)
    chunks_from_pieces(nn.Identity(), _blocks(), nn.Identity(), pp=1, pp_rank=0)  # prefixed: accepted
    shared = _blocks(n=1)[0]
    check_distinct_init({"a.": shared, "b.": shared})  # one module in two places: meant to be alike


def _tp2_full():
    group = dist.group.WORLD
    return _full(_blocks(group), group)


def test_prefixed_blocks_agree_at_every_tp():
    single = _full(_blocks())
    for rank_full in run_ranks(_tp2_full, 2, timeout=60):
        for one, two in zip(single, rank_full):
            for name in one:
                torch.testing.assert_close(two[name], one[name], atol=0, rtol=0, msg=name)


def test_piece_checkpoint_names_do_not_depend_on_the_pipeline_split():
    first, last, blocks = nn.Linear(2, 2), nn.Linear(2, 2), [nn.Linear(2, 2) for _ in range(4)]

    def names(pp, vpp=1):
        out = set()
        for rank in range(pp):
            chunks = chunks_from_pieces(first, blocks, last, pp=pp, pp_rank=rank, vpp=vpp)
            out |= set(ModelChunks(chunks).global_names().values())
        return out

    one = names(1)
    assert one == names(2) == names(2, vpp=2) == names(4)
    assert "blocks.3.weight" in one and "first.bias" in one and "last.weight" in one
