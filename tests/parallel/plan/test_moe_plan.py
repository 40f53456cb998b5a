"""The MoE planner numbers against Mixtral's published sizes, our built models and the byte counter."""

import pytest
import torch
import torch.distributed as dist

from models.config import preset
from models.transformer import build_model
from parallel import comm
from parallel.layers.moe import MoELayer
from parallel.plan.moe import (
    MoEShape,
    all_to_all_payload_bytes,
    all_to_all_seconds,
    expert_state_bytes_per_rank,
    flops_per_token,
    param_counts,
)
from parallel.testing import run_ranks


def test_mixtral_8x7b_total_and_active_parameters():
    n = param_counts(MoEShape.of(preset("mixtral_8x7b")))
    assert n["total"] / 1e9 == pytest.approx(46.7, abs=0.05)  # Mistral AI: 46.7B total
    assert n["active"] / 1e9 == pytest.approx(12.9, abs=0.05)  # 12.9B used per token
    assert flops_per_token(preset("mixtral_8x7b")) < 6 * n["total"] / 3  # active, not total


@pytest.mark.parametrize(
    "cfg",
    [
        preset("mixtral_tiny"),
        preset("gpt_tiny", moe_experts=4, moe_top_k=1, moe_every=2, moe_shared_experts=1, moe_d_ff=48),
    ],
    ids=["mixtral_tiny", "gpt_moe_every2_shared"],
)
def test_counts_equal_the_built_model(cfg):
    model = build_model(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n = param_counts(MoEShape.of(cfg))
    assert (n["total"], n["expert"]) == (total, expert)


def test_expert_state_shrinks_with_ep_and_edp():
    s = MoEShape.of(preset("mixtral_8x7b"))
    one = expert_state_bytes_per_rank(s, ep=1, dp=8, zero=1)
    assert expert_state_bytes_per_rank(s, ep=8, dp=8, zero=1) == pytest.approx(
        one / 8 * (2 + 4 + 12) / (2 + 4 + 12 / 8)
    )
    assert all_to_all_seconds(1e9, 1, 1e9) == 0 and all_to_all_seconds(1e9, 4, 1e9) == 0.75


T, D = 10, 12


def _bytes_rank(cfg):
    torch.manual_seed(0)
    layer = MoELayer(D, cfg.moe_config(), ep_group=dist.group.WORLD)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    counter = comm.CommCounter()
    with counter:
        layer(x).sum().backward()
    return counter.payload_bytes(op="all_to_all")


def test_all_to_all_bytes_equal_theory():
    cfg = preset("mixtral_tiny", n_layers=1, d_model=D, moe_experts=4, moe_top_k=2)
    got = run_ranks(_bytes_rank, 2, cfg, timeout=120)
    assert sum(got) == 2 * all_to_all_payload_bytes(MoEShape.of(cfg), T)  # every routed row out and back
    assert min(got) > 0
