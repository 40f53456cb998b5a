"""The suite's small GPT, twice: as our recipe (trainer path) and as plain PyTorch
with the same weights, for PyTorch's own parallel wrappers to wrap.

:class:`PlainGPT` is a GPT-2 stage in plain PyTorch (learned positions,
pre-norm blocks of :class:`benchmarks.tp.PlainBlock`, final LayerNorm, untied
head): with :func:`copy_from_ours` it computes what ``models.build_model``
computes, so a ratio ours/theirs compares the parallel machinery, not two models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.transformer import build_model
from recipes.config import RecipeConfig, model_config

from .tp import NAMES, PlainBlock

#: the suite's model sizes: name -> (layers, d_model, heads, seq_len, global batch); vocab 256, untied head
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "small": (4, 128, 4, 64, 16),  # 0.87 M parameters
    "medium": (4, 256, 4, 64, 16),  # 3.3 M
    "large": (8, 512, 8, 256, 8),  # 25.6 M (a smaller global batch keeps a CPU step near a second)
}


def suite_recipe(
    dp: int | str = "auto",
    pp: int = 1,
    tp: int = 1,
    zero: int = 0,
    *,
    quick: bool = False,
    size: str = "small",
    **parallel,
) -> RecipeConfig:
    """The recipe every row trains: a GPT of :data:`SIZES` ``size`` (small: 4 layers, d_model 128,
    seq 64; vocab 256, untied head: torch.distributed.pipelining cannot tie across stages),
    micro-batches of 2, AdamW without clipping (PyTorch's wrappers get none either), fp32, one
    thread per rank. ``quick`` halves the sequence."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {list(SIZES)}")
    layers, d, heads, seq, batch = SIZES[size]
    rc = RecipeConfig()
    rc.model.preset = "gpt_tiny"
    rc.model.n_layers, rc.model.d_model, rc.model.n_heads = layers, d, heads
    rc.model.seq_len, rc.model.tie_embeddings = (seq // 2 if quick else seq), False
    rc.parallel.dp, rc.parallel.pp, rc.parallel.tp, rc.parallel.zero = dp, pp, tp, zero
    for key, value in parallel.items():
        setattr(rc.parallel, key, value)
    rc.train.global_batch, rc.train.micro_batch, rc.train.max_steps = batch, 2, 1000
    rc.train.grad_clip, rc.train.eval_every, rc.train.threads = 0.0, 0, 1
    rc.optim.weight_decay = 0.0  # one AdamW param group on both sides
    rc.logger.progress = False
    rc.data.embedded_mb = 0.25
    return rc


def suite_model(rc: RecipeConfig) -> ModelConfig:
    return model_config(rc.model)


class PlainGPT(nn.Module):
    """Blocks ``layers`` of a GPT, with the embedding and/or head if asked (a
    pipeline stage when not the whole model); parameter names as ours."""

    def __init__(
        self, cfg: ModelConfig, layers: range | None = None, has_embedding: bool = True, has_head: bool = True
    ):
        super().__init__()
        if cfg.arch != "gpt" or cfg.tie_embeddings:
            raise ValueError(f"PlainGPT is an untied GPT; got arch={cfg.arch!r} tie_embeddings={cfg.tie_embeddings}")
        layers = range(cfg.n_layers) if layers is None else layers
        self.has_embedding, self.has_head = has_embedding, has_head
        vocab = cfg.padded_vocab(1)
        if has_embedding:
            self.tok_embed = nn.Embedding(vocab, cfg.d_model)
            self.pos_embed = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): PlainBlock(cfg.d_model, cfg.n_heads, cfg.d_ff) for i in layers})
        if has_head:
            self.norm_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embedding:
            x = self.tok_embed(x) + self.pos_embed(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.norm_f(x)) if self.has_head else x


def plain_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (what ``TransformerStage.loss`` computes at tp=1)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def copy_from_ours(plain: PlainGPT, ours: nn.Module) -> PlainGPT:
    """Give ``plain`` the weights of ``ours`` (an unsharded ``TransformerStage``
    holding at least ``plain``'s blocks); returns ``plain``."""
    theirs = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.startswith("blocks."):
                _, i, local = name.split(".", 2)
                inner = next(k for k, v in NAMES.items() if local.startswith(v + "."))
                name = f"blocks.{i}.{inner}.{local.split('.')[-1]}"
            p.copy_(theirs[name])
    return plain


def plain_like_ours(
    cfg: ModelConfig, seed: int, layers: range | None = None, has_embedding: bool = True, has_head: bool = True
) -> PlainGPT:
    """A :class:`PlainGPT` (stage) with the weights our trainer starts from at ``seed``
    (our initialisation is layout-independent, so the unsharded model gives them)."""
    full = build_model(cfg, seed=seed)
    return copy_from_ours(PlainGPT(cfg, layers, has_embedding, has_head), full)
