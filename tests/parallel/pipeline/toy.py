"""A toy GPT-shaped model for pipeline tests, and its single-process reference.

Embedding (stage 0) → blocks of Linear + tanh → head (last stage; optionally
tied to the embedding) → cross-entropy. A stage holds a slice of the blocks
and keeps the full model's parameter names, so gradients compare by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.params import mark_shared_embedding
from parallel.topology import Topology

VOCAB, D_MODEL, SEQ, MICRO_BATCH = 13, 16, 4, 2
ACTIVATION_SHAPE = (MICRO_BATCH, SEQ, D_MODEL)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.linear(x)) + x


class Stage(nn.Module):
    """Blocks ``layers`` of the model, with the embedding and/or head if asked."""

    def __init__(self, n_layers: int, layers: range, *, first: bool, last: bool, tied: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)  # every stage draws the full model's weights, then keeps its part
        embed = nn.Embedding(VOCAB, D_MODEL)
        blocks = [Block(D_MODEL) for _ in range(n_layers)]
        head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.first, self.last, self.tied = first, last, tied
        if first or (last and tied):
            self.embed = embed
            if tied:
                mark_shared_embedding(self.embed.weight)
        self.blocks = nn.ModuleDict({str(i): blocks[i] for i in layers})
        if last and not tied:
            self.head = head

    def forward(self, x):
        if self.first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = x @ self.embed.weight.t() if self.tied else self.head(x)
        return x


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def data(m: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (m, MICRO_BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (m, MICRO_BATCH, SEQ), generator=g)
    return list(x), list(y)


def reference(n_layers: int, m: int, tied: bool):
    """Loss (mean over micro-batches) and gradients of the whole model in one process."""
    model = Stage(n_layers, range(n_layers), first=True, last=True, tied=tied)
    xs, ys = data(m)
    loss = sum(loss_fn(model(x), y) for x, y in zip(xs, ys)) / m
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def make_groups(pp: int, tp: int = 1):
    """This rank's (pp, tp, embedding) groups for a dp=1 grid; every rank creates every group."""
    topo = Topology(dp=1, pp=pp, tp=tp)
    rank = dist.get_rank()
    mine = {}
    for axis, lists in (("pp", topo.groups("pp")), ("tp", topo.groups("tp")), ("embedding", topo.embedding_groups)):
        for ranks in lists:
            g = dist.new_group(ranks, group_desc=axis)
            if rank in ranks:
                mine[axis] = g
    return topo, mine
