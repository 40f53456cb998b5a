"""Your own model on a pipeline: give it as pieces, the engine does the rest.

A model is three pieces: a first one (the embedding), a list of identical blocks, a
last one (the head); plus a loss. :meth:`parallel.engine.StepEngine.from_pieces`
splits the blocks over the pipeline stages (the cost-balanced partitioner), builds
the schedule (1F1B) and trains it with ZeRO over data parallelism. The pieces here
are built from :mod:`parallel.layers`, so the same code is tensor parallel: the
embedding's rows, the MLP's hidden width and the head's vocabulary are split over
``tp_group`` (``None``: one process holds everything).

Run ``python -m examples.pipeline_pieces`` (from the repository root): it trains at (dp, pp, tp) = (2, 2, 2) on
8 CPU processes and in one process, and prints both loss curves (equal within 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel.engine import StepEngine
from parallel.layers import ColumnParallelLinear, LayerNorm, ParallelMLP, VocabParallelEmbedding
from parallel.layers.cross_entropy import vocab_parallel_cross_entropy
from parallel.zero import ZeroConfig

VOCAB, D_MODEL, D_FF, N_BLOCKS, SEQ = 64, 32, 64, 4, 8
GLOBAL_BATCH, MICRO_BATCH, STEPS, LR = 8, 2, 4, 1e-2


class Block(nn.Module):
    """A pre-norm residual MLP block (any module works: the engine only calls it)."""

    def __init__(self, tp_group=None):
        super().__init__()
        self.norm = LayerNorm(D_MODEL)
        self.mlp = ParallelMLP(D_MODEL, D_FF, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Head(nn.Module):
    """Final norm and the vocabulary projection (each TP rank: its slice of the vocabulary)."""

    def __init__(self, tp_group=None):
        super().__init__()
        self.norm = LayerNorm(D_MODEL)
        self.proj = ColumnParallelLinear(D_MODEL, VOCAB, tp_group=tp_group, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def build_pieces(tp_group=None) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """The model as (first, blocks, last); the same full weights for every TP size."""
    torch.manual_seed(0)
    first = VocabParallelEmbedding(VOCAB, D_MODEL, tp_group=tp_group)
    blocks = [Block(tp_group) for _ in range(N_BLOCKS)]
    return first, blocks, Head(tp_group)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch of (inputs, targets), the same for every layout."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def optimizer(param_groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups, lr=LR, weight_decay=0.0)


def train_grid(dp: int = 2, pp: int = 2, tp: int = 2, zero: int = 1) -> list[float]:
    """Train ``STEPS`` steps as this rank of a dp × pp × tp grid (the default process group
    is initialised); return the loss of each step (the mean over the global batch)."""
    from parallel.groups import build_groups
    from parallel.topology import Topology

    groups = build_groups(Topology(dp, pp, tp, world_size=dist.get_world_size()))
    first, blocks, last = build_pieces(groups.tp)
    m = GLOBAL_BATCH // dp // MICRO_BATCH  # micro-batches per step on each DP rank
    engine = StepEngine.from_pieces(
        first,
        blocks,
        last,
        loss_fn=lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, groups.tp).mean(),
        pp_group=groups.pp,
        microbatches=m,
        schedule="1f1b",
        dp_group=groups.dp,
        tp_group=groups.tp,
        activation_shape=(MICRO_BATCH, SEQ, D_MODEL),
        optimizer_factory=optimizer,
        zero=ZeroConfig(stage=zero),
    )
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        per_rank = GLOBAL_BATCH // dp
        x, y = (t[groups.dp_rank * per_rank : (groups.dp_rank + 1) * per_rank] for t in (x, y))
        stats = engine.step(list(x.split(MICRO_BATCH)), list(y.split(MICRO_BATCH)))
        losses.append(stats["loss"])
    return losses


def train_one_process() -> list[float]:
    """The same model, data and optimizer in plain PyTorch, in one process."""
    first, blocks, last = build_pieces()
    model = nn.Sequential(first, *blocks, last)
    opt = optimizer([{"params": list(model.parameters())}])
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.split(MICRO_BATCH), y.split(MICRO_BATCH)):
            loss = vocab_parallel_cross_entropy(model(xm), ym).mean() / (GLOBAL_BATCH // MICRO_BATCH)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


if __name__ == "__main__":
    from parallel.testing import run_ranks

    grid = run_ranks(train_grid, 8, timeout=120)[0]
    single = train_one_process()
    for step, (a, b) in enumerate(zip(grid, single)):
        print(f"step {step + 1}: (dp, pp, tp) = (2, 2, 2) {a:.6f}   one process {b:.6f}")
    assert all(abs(a - b) < 1e-5 for a, b in zip(grid, single)), "the layouts disagree"
