"""A non-GPT model from parallel.layers (issue 13, level 2): a ViT at dp × tp = 2 × 2 equals one process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.groups import build_groups
from parallel.layers import init_parameters_
from parallel.params import wants_weight_decay
from parallel.testing import run_ranks
from parallel.topology import Topology

STEPS, STAGES = 4, (0, 1, 2, 3)


def load(name: str):
    path = Path(__file__).parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


vit = load("vit_tp")


def grid_losses() -> dict[int, list[float]]:
    groups = build_groups(Topology(dp=2, pp=1, tp=2))
    assert dist.get_world_size(groups.tp) == 2 and dist.get_world_size(groups.dp) == 2
    return {stage: vit.train(groups, stage=stage, steps=STEPS) for stage in STAGES}


def plain_torch_losses() -> list[float]:
    """The same model in one process with plain PyTorch: AdamW (no decay where the layers say so), clip_grad_norm_."""
    torch.manual_seed(0)
    model = init_parameters_(vit.ViT(), seed=0)
    decay = [p for p in model.parameters() if wants_weight_decay(p)]
    rest = [p for p in model.parameters() if not wants_weight_decay(p)]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=vit.LR, weight_decay=vit.WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        x, y = vit.batch(step, vit.GLOBAL_BATCH)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), vit.GRAD_CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def runs():
    ((one, plain),) = run_ranks(lambda: (vit.train(None, stage=0, steps=STEPS), plain_torch_losses()), 1, timeout=60)
    grid = run_ranks(grid_losses, 4, timeout=90)
    assert all(r == grid[0] for r in grid)  # every rank reports the global mean
    return one, grid[0], plain


def test_one_process_run_equals_plain_pytorch(runs):
    assert runs[0] == pytest.approx(runs[2], abs=1e-5, rel=0)


@pytest.mark.parametrize("stage", STAGES)
def test_vit_dp2_tp2_equals_one_process(runs, stage):
    one, grid, _ = runs
    assert grid[stage] == pytest.approx(one, abs=1e-5, rel=0)
    assert len(set(one)) == STEPS  # it trains: the losses move


def test_the_layers_are_split_over_tp():
    """At tp=2 each rank holds half of every TP-sharded weight (the 2 × 2 run is not 4 replicas)."""

    def shapes():
        groups = build_groups(Topology(dp=1, pp=1, tp=2))
        return {n: tuple(p.shape) for n, p in vit.ViT(tp_group=groups.tp).named_parameters()}

    (full,) = run_ranks(lambda: {n: tuple(p.shape) for n, p in vit.ViT().named_parameters()}, 1, timeout=60)
    half = run_ranks(shapes, 2, timeout=60)[0]
    assert half["blocks.0.attn.q.weight"] == (full["blocks.0.attn.q.weight"][0] // 2, full["blocks.0.attn.q.weight"][1])
    assert half["blocks.0.attn.out.weight"][1] * 2 == full["blocks.0.attn.out.weight"][1]
    assert half["blocks.0.mlp.fc_in.weight"][0] * 2 == full["blocks.0.mlp.fc_in.weight"][0]
    assert half["head.weight"] == full["head.weight"]
