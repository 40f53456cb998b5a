"""MoE under ZeRO 0–3 at dp=4, ep=2: expert buckets over edp, dense over dp, one clipped norm.

Every stage trains a few AdamW steps, clipped so the global norm matters, exactly like one
process that runs each rank's batch through the full model (every expert) and averages.
"""

import pytest
import torch
from torch import nn

from parallel.groups import build_groups
from parallel.layers.moe import MoEConfig, MoELayer
from parallel.testing import run_ranks
from parallel.topology import Topology
from parallel.zero import ZeroConfig, ZeroDataParallel

D, T, DP, EP, STEPS, CLIP = 8, 6, 4, 2, 3, 0.05
CFG = MoEConfig(4, 12, top_k=2, num_shared_experts=1, z_loss_weight=1e-3, aux_loss_weight=0.1)


class Net(nn.Module):
    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.moe = MoELayer(D, CFG, ep_group=ep_group)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.moe(torch.tanh(self.inp(x))))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def _reference():
    model = Net()
    model.moe.aux_loss_scale = 1 / DP  # the aux loss of each rank's batch, averaged like its main loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        for r in range(DP):
            x, y = _batch(step, r)
            (nn.functional.mse_loss(model(x), y) / DP).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_all_stages():
    groups = build_groups(Topology(dp=DP, ep=EP))
    out = {}
    for stage in (0, 1, 2, 3):
        model = Net(groups.ep)
        zdp = ZeroDataParallel(
            model,
            ZeroConfig(stage=stage, grad_clip=CLIP),
            dp_group=groups.dp,
            expert_group=groups.edp,
            ep_group=groups.ep,
            optimizer_factory=_adamw,
            units=[model.moe] if stage == 3 else None,
        )
        norms = []
        for step in range(STEPS):
            x, y = _batch(step, groups.dp_rank)
            zdp.backward(nn.functional.mse_loss(zdp(x), y))
            norms.append(float(zdp.step()["grad_norm"]))
        out[stage] = (norms, zdp.full_parameters(), groups.ep_rank)
    return out


def test_moe_zero_stages_match_one_process():
    ref_norms, ref_params = _reference()
    L = CFG.num_experts // EP
    for per_stage in run_ranks(_train_all_stages, DP, timeout=300):
        for stage, (norms, params, ep_rank) in per_stage.items():
            assert norms == pytest.approx(ref_norms, rel=1e-5), stage
            assert set(params) == set(ref_params)
            for name, p in params.items():
                want = ref_params[name]
                if name.startswith("moe.experts."):
                    want = want[ep_rank * L : (ep_rank + 1) * L]
                assert torch.allclose(p, want, atol=1e-5), (stage, name, (p - want).abs().max())
