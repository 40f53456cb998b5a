"""A tiny model of Linear/LayerNorm "blocks", its data, and the single-process reference."""

from __future__ import annotations

import torch
from torch import nn

from parallel.params import mark_no_weight_decay

D, BLOCKS, BATCH, STEPS, LR, WD = 16, 3, 16, 10, 1e-2, 0.1


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        for p in (self.norm.weight, self.norm.bias, self.fc.bias):
            mark_no_weight_decay(p)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Toy(nn.Module):
    def __init__(self, d: int = D, blocks: int = BLOCKS):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 1)
        mark_no_weight_decay(self.head.bias)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1)


def make_model(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def batches(steps: int = STEPS, batch: int = BATCH, d: int = D, seed: int = 1):
    """``steps`` batches of the regression y = sin(x·w/√d); ``seed`` draws x, the task w is fixed."""
    w = torch.randn(d, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, d, generator=g)
        out.append((x, (x @ w / d**0.5).sin()))
    return out


def adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WD)


def reference_param_groups(model: nn.Module):
    from parallel.params import wants_weight_decay

    ps = [p for p in model.parameters()]
    return [
        {"params": [p for p in ps if wants_weight_decay(p)]},
        {"params": [p for p in ps if not wants_weight_decay(p)], "weight_decay": 0.0},
    ]


def reference_run(steps: int = STEPS, grad_clip: float | None = None, make=make_model):
    """One process, whole batch: losses, grad norms and final parameters of ``make()``."""
    model = make()
    opt = adamw(reference_param_groups(model))
    losses, norms = [], []
    for x, y in batches(steps):
        out = model(x)  # (batch,) or (batch, k): every column regresses y
        loss = nn.functional.mse_loss(out, y if out.dim() == 1 else y[:, None].expand_as(out))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}
