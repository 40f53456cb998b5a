"""Your own model in the recipe trainer: ``model.target=<module>:<function>`` (Hydra's ``_target_`` idea).

The function is called with a :class:`BuildRequest` and returns a :class:`parallel.pieces.ModelPieces`
(``first``, ``blocks``, ``last``, ``loss_fn``; what :meth:`parallel.engine.StepEngine.from_pieces`
takes). The trainer then splits the blocks over the pipeline, wraps them in ZeRO and runs its loop
unchanged: metrics, background checkpoints, resume, SIGTERM, evaluation. The batch is the recipe's:
token ids ``[micro_batch, model.seq_len]`` in, next-token targets out. ``mode=plan`` counts the pieces
built on ``meta`` (``recipes/tools/plan_target.py``).

Refused up front, on every rank before any collective (:func:`check_target`): an import path that does
not import, a function that is not one, a result that is not ``ModelPieces``, a block count other than
``model.n_layers``, and the features a target model does not get (:data:`NOT_FOR_TARGETS`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel.engine import StepEngine
from parallel.groups import ParallelGroups
from parallel.pieces import ModelPieces
from parallel.pipeline.partition import partition_layers

from ..config import ConfigError, Layout, RecipeConfig
from .gpt_engine import optimizer_factory, zero_config


@dataclass(frozen=True)
class BuildRequest:
    """What a ``model.target`` builder is given.

    ``model``: the config's model section resolved (:class:`models.config.ModelConfig`: the preset with
    the overrides; ``n_layers`` is the number of blocks to return, ``d_model``, ``vocab_size``,
    ``seq_len`` and the rest are yours to read). ``tp_group``: the tensor-parallel group to hand to
    :mod:`parallel.layers` (None: one rank). ``device``: where to build (``meta`` for the planner and the
    up-front check: build, draw nothing). ``seed``: ``train.seed``, for
    ``init_parameters_(piece, seed=, prefix=)``. ``micro_batch``: samples per micro-batch."""

    model: Any
    tp_group: Any = None
    device: torch.device = torch.device("cpu")
    seed: int = 0
    micro_batch: int = 1

    @property
    def meta(self) -> bool:
        return self.device.type == "meta"


#: (key, test, value shown): what a model.target model does not get, refused by :func:`check_target`
NOT_FOR_TARGETS: tuple[tuple[str, Callable[[RecipeConfig], bool]], ...] = (
    ("train.precision=fp8", lambda rc: rc.train.precision == "fp8"),
    ("train.compile=true", lambda rc: bool(rc.train.compile)),
    ("data.packing=documents", lambda rc: rc.data.packing == "documents"),
    ("parallel.cp>1", lambda rc: rc.parallel.cp > 1),
    ("parallel.ep>1", lambda rc: rc.parallel.ep > 1),
    ("parallel.sequence_parallel=true", lambda rc: bool(rc.parallel.sequence_parallel)),
    ("mode=recommend", lambda rc: rc.mode == "recommend"),
    ("mode=dryrun", lambda rc: rc.mode == "dryrun"),
)


def load_target(path: str) -> Callable[[BuildRequest], ModelPieces]:
    """The function ``path`` names (``pkg.module:function`` or ``pkg.module.function``), imported;
    refused with a :class:`ConfigError` naming the path and what was expected."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    expected = "model.target must name a function as <module>:<function>, importable from the working directory"
    if not module_name or not attr:
        raise ConfigError(f"model.target={path}: {expected}, e.g. model.target=examples.mixer_lm:build")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.target={path}: cannot import {module_name!r} ({e}); {expected}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = "nothing" if fn is None else type(fn).__name__
        raise ConfigError(f"model.target={path}: {module_name}.{attr} is {found}, not a function; {expected}")
    return fn


def build_pieces(rc: RecipeConfig, mc: Any, request: BuildRequest) -> ModelPieces:
    """Call ``model.target``'s builder; its result checked (a :class:`ModelPieces` of ``model.n_layers``
    blocks), else a :class:`ConfigError` naming the path and what was expected."""
    path = rc.model.target
    got = load_target(path)(request)
    if not isinstance(got, ModelPieces):
        raise ConfigError(
            f"model.target={path} returned {type(got).__name__}; expected parallel.pieces.ModelPieces("
            f"first, blocks, last, loss_fn) (see recipes/training/target_model.py)"
        )
    if len(got.blocks) != mc.n_layers:
        raise ConfigError(
            f"model.target={path} returned {len(got.blocks)} blocks but model.n_layers={mc.n_layers}: the "
            f"pipeline splits model.n_layers blocks; set model.n_layers={len(got.blocks)} or build n_layers blocks"
        )
    return got


def check_target(rc: RecipeConfig, mc: Any) -> None:
    """The up-front checks of a ``model.target`` run (module docstring): features it does not get, then
    the builder run on ``meta`` (nothing drawn, nothing allocated)."""
    refused = [key for key, on in NOT_FOR_TARGETS if on(rc)]
    if refused:
        raise ConfigError(
            f"model.target={rc.model.target} with {', '.join(refused)}: not available to a model given as "
            "pieces (these act inside gridtrain's own GPT/Llama blocks); turn it off, or use model.arch=gpt|llama"
        )
    build_pieces(rc, mc, BuildRequest(mc, device=torch.device("meta"), micro_batch=rc.train.micro_batch))


def flops_per_token(pieces: ModelPieces, mc: Any) -> float:
    """Training FLOPs per token of the whole model: the builder's figure, else counted by torch's
    ``FlopCounterMode`` (matmuls, convolutions, attention) over a forward and backward of one sequence on
    ``meta`` (the pieces must be built at tp=1 on ``meta``)."""
    if pieces.flops_per_token is not None:
        return float(pieces.flops_per_token)
    tokens = torch.zeros(1, mc.seq_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        x = pieces.first(tokens)
        for block in pieces.blocks:
            x = block(x)
        pieces.loss_fn(pieces.last(x), tokens).backward()
    return counter.get_total_flops() / mc.seq_len


def build_target_engine(
    rc: RecipeConfig, layout: Layout, g: ParallelGroups, device: torch.device, dtype: torch.dtype
) -> tuple[list[range], StepEngine, float]:
    """The blocks' split, this rank's chunks of the ``model.target`` model in a step engine, and its
    training FLOPs per token (for MFU: the builder's, or counted on ``meta``)."""
    p, mc = rc.parallel, layout.model
    request = BuildRequest(mc, tp_group=g.tp, device=device, seed=rc.train.seed, micro_batch=layout.micro_batch)
    pieces = build_pieces(rc, mc, request)
    split = dict(embedding_cost=pieces.embedding_cost, head_cost=pieces.head_cost, pp_layers=p.pp_layers)
    ranges = partition_layers(mc.n_layers, p.pp, vpp=p.vpp, **split)
    engine = StepEngine.from_pieces(
        pieces.first,
        pieces.blocks,
        pieces.last,
        loss_fn=pieces.loss_fn,
        pp_group=g.pp,
        microbatches=layout.grad_accum,
        schedule=p.pp_schedule,
        vpp=p.vpp,
        **split,
        zero=zero_config(rc),
        optimizer_factory=optimizer_factory(rc, device),
        dp_group=g.dp,
        tp_group=g.tp,
        clip_groups=[g.pp],
        activation_shape=pieces.activation_shape or layout.dims.activation_shape(layout.micro_batch, mc.d_model),
        compute_dtype=dtype,
    )
    meta = BuildRequest(mc, device=torch.device("meta"), micro_batch=layout.micro_batch)
    return ranges, engine, flops_per_token(build_pieces(rc, mc, meta) if pieces.flops_per_token is None else pieces, mc)


__all__ = ["BuildRequest", "ModelPieces", "build_target_engine", "check_target", "load_target"]
