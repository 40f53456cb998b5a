"""Your own model from ``parallel.layers``: a small Vision Transformer trained at dp × tp = 2 × 2.

Not a GPT: patches instead of tokens, bidirectional attention (every patch sees
every patch), a class token and a classification head. The attention is built
from the tensor-parallel linears themselves (query, key and value are
:class:`~parallel.layers.ColumnParallelLinear`, each TP rank computing its own
heads; the output projection is a :class:`~parallel.layers.RowParallelLinear`
that sums the heads' contributions over TP), the MLP is
:class:`~parallel.layers.ParallelMLP`. The patch embedding, class token,
positions, norms and head are ordinary replicated parameters.
:class:`~parallel.zero.ZeroDataParallel` shards the optimizer over DP and gets
the TP group too, so the replicated parameters enter the clipping norm once.

:func:`~parallel.layers.init_parameters_` initialises every parameter by its
name, so the model at any tp holds the same full weights:
``tests/examples/test_vit_tp.py`` checks that the 2 × 2 losses equal the same
model's in one process (tp=1, dp=1) over a few AdamW steps.

Run on four CPU processes (gloo), under torchrun or spawning them itself::

    torchrun --nproc-per-node=4 -m examples.vit_tp --steps 5 --zero 1
    python -m examples.vit_tp --steps 5 --zero 3
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.groups import ParallelGroups, build_groups
from parallel.layers import ColumnParallelLinear, LayerNorm, ParallelMLP, RowParallelLinear, divide, init_parameters_
from parallel.topology import Topology
from parallel.zero import ZeroConfig, ZeroDataParallel

IMAGE, PATCH, CHANNELS, CLASSES = 8, 4, 3, 10
LR, WEIGHT_DECAY, GRAD_CLIP, GLOBAL_BATCH = 3e-3, 0.1, 1.0, 8


class Attention(nn.Module):
    """Bidirectional multi-head self-attention; rank r of ``tp_group`` computes heads [r·h/N, (r+1)·h/N)."""

    def __init__(self, d: int, heads: int, tp_group=None):
        super().__init__()
        self.local_heads = divide(heads, 1 if tp_group is None else dist.get_world_size(tp_group), "heads")
        self.q, self.k, self.v = (ColumnParallelLinear(d, d, tp_group=tp_group) for _ in range(3))
        self.out = RowParallelLinear(d, d, tp_group=tp_group)  # all-reduces the heads' partial outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = ColumnParallelLinear.shared_forward(x, self.q, self.k, self.v)  # this rank's heads
        q, k, v = (t.view(b, s, self.local_heads, -1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)  # no causal mask
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, tp_group=None):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm(d), LayerNorm(d)
        self.attn = Attention(d, heads, tp_group)
        self.mlp = ParallelMLP(d, 4 * d, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Images ``[b, CHANNELS, IMAGE, IMAGE]`` → class logits ``[b, CLASSES]`` (full on every TP rank)."""

    def __init__(self, d: int = 32, heads: int = 4, depth: int = 2, tp_group=None):
        super().__init__()
        n_patches = (IMAGE // PATCH) ** 2
        self.embed = nn.Linear(CHANNELS * PATCH * PATCH, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, n_patches + 1, d))
        self.blocks = nn.ModuleList(Block(d, heads, tp_group) for _ in range(depth))
        self.norm, self.head = LayerNorm(d), nn.Linear(d, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(images, PATCH, stride=PATCH).transpose(1, 2)  # [b, n_patches, C·P·P]
        x = self.embed(patches)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))  # classify from the class token


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: random images labelled by a fixed linear teacher."""
    teacher = torch.randn(CHANNELS * IMAGE * IMAGE, CLASSES, generator=torch.Generator().manual_seed(99))
    x = torch.randn(size, CHANNELS, IMAGE, IMAGE, generator=torch.Generator().manual_seed(step))
    return x, (x.flatten(1) @ teacher).argmax(dim=1)


def train(groups: ParallelGroups | None, *, stage: int, steps: int, global_batch: int = GLOBAL_BATCH) -> list[float]:
    """Train ``steps`` AdamW steps; return each step's loss (mean over the global batch).

    ``groups``: this rank's dp × tp groups, or None for one process (tp=1, dp=1 on the world).
    """
    tp, dp = (groups.tp, groups.dp) if groups else (None, dist.group.WORLD)
    dp_size, dp_rank = dist.get_world_size(dp), dist.get_rank(dp)
    model = init_parameters_(ViT(tp_group=tp), seed=0, tp_group=tp)  # the same full weights at any tp
    zdp = ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, grad_clip=GRAD_CLIP),
        dp_group=dp,
        tp_group=tp,
        units=list(model.blocks),  # stage 3 gathers one block at a time
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY),
    )
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch)
        mine = slice(dp_rank * global_batch // dp_size, (dp_rank + 1) * global_batch // dp_size)
        loss = F.cross_entropy(zdp(x[mine]), y[mine])
        zdp.backward(loss)
        zdp.step()
        zdp.zero_grad()
        losses.append(loss.detach())
    out = torch.stack(losses)
    dist.all_reduce(out, group=dp)  # one read at the end
    return (out / dp_size).tolist()


def main(rank: int, args: argparse.Namespace) -> None:
    """One of the four ranks (torchrun's, or spawned here with ``rank``)."""
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    dist.init_process_group("gloo")
    groups = build_groups(Topology(dp=2, pp=1, tp=2))
    losses = train(groups, stage=args.zero, steps=args.steps)
    if dist.get_rank() == 0:
        print(" ".join(f"{v:.6f}" for v in losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        main(-1, args)
    else:
        torch.multiprocessing.spawn(main, args=(args,), nprocs=4)
