"""Your own model in the recipe trainer: a causal token-mixing MLP language model (not a GPT: no attention).

``build`` is a ``model.target`` builder (``recipes/training/target_model.py``): given the request (the
config's model section, the tensor-parallel group, the device, the seed) it returns the model as pieces.
The recipe trainer does the rest, unchanged: pipeline split, ZeRO, metrics, background checkpoints,
resume, SIGTERM. Run it (from the repository root) on 4 CPU processes at pp=2 × tp=2::

    python -m recipes.gpt_tiny model.target=examples.mixer_lm:build parallel.pp=2 parallel.tp=2 \\
        model.seq_len=32 model.d_model=64 train.max_steps=20

and plan it without a process: ``... mode=plan parallel.pp=2 parallel.tp=2`` (parameters, model states and
FLOPs per token counted on ``meta``). Built from :mod:`parallel.layers`, the same code is tensor parallel:
the embedding's rows, the MLP's hidden width and the head's vocabulary are split over ``tp_group``.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.layers import ColumnParallelLinear, LayerNorm, ParallelMLP, VocabParallelEmbedding, init_parameters_
from parallel.layers.cross_entropy import vocab_parallel_cross_entropy
from parallel.pieces import ModelPieces, piece_prefix


class CausalMix(nn.Module):
    """Token mixing: position ``t`` becomes a learned mix of positions ``0..t`` (a lower-triangular
    ``[seq, seq]`` matrix, replicated over TP like a norm's weight)."""

    def __init__(self, seq_len: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq_len, seq_len, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        return self.weight[:s, :s].tril() @ x


class MixerBlock(nn.Module):
    """Pre-norm residual token mixing, then a pre-norm residual MLP (column → row parallel)."""

    def __init__(self, cfg, tp_group=None, device=None):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm(cfg.d_model, device=device), LayerNorm(cfg.d_model, device=device)
        self.mix = CausalMix(cfg.seq_len, device=device)
        self.mlp = ParallelMLP(cfg.d_model, cfg.d_ff, tp_group=tp_group, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm and the vocabulary projection (each TP rank: its slice of the vocabulary)."""

    def __init__(self, cfg, tp_group=None, device=None):
        super().__init__()
        self.norm = LayerNorm(cfg.d_model, device=device)
        self.proj = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp_group=tp_group, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def build(request) -> ModelPieces:
    """The ``model.target`` builder: ``model.n_layers`` mixer blocks between an embedding and a head, each
    piece initialised by its full name (the same weights at every tp and pipeline split)."""
    cfg, tp, dev = request.model, request.tp_group, request.device
    first = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group=tp, device=dev)
    blocks = [MixerBlock(cfg, tp, dev) for _ in range(cfg.n_layers)]
    last = Head(cfg, tp, dev)
    init_parameters_(first, seed=request.seed, tp_group=tp, prefix=piece_prefix("first"))
    for i, block in enumerate(blocks):
        init_parameters_(block, seed=request.seed, tp_group=tp, prefix=piece_prefix("blocks", i))
    init_parameters_(last, seed=request.seed, tp_group=tp, prefix=piece_prefix("last"))
    return ModelPieces(
        first, blocks, last, loss_fn=lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp).mean()
    )
