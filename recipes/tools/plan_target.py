"""``mode=plan`` for a ``model.target`` model: what counting its pieces on ``meta`` can tell.

Given: per pipeline rank, the blocks it holds (the trainer's own split), its parameters per TP rank
(a parameter marked ``tp_shard_dim`` holds ``1/tp`` per rank, as the layers split it), the model states
ZeRO keeps per rank (parameters, gradients, optimizer: :func:`parallel.plan.memory.model_state_bytes`),
and the training FLOPs per token (the builder's ``flops_per_token``, else torch's ``FlopCounterMode`` over
one sequence's forward and backward on ``meta``). Not given: activations, communication and step time,
which the planner derives from a GPT's shape and a model given as pieces does not declare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from parallel.pieces import piece_prefix
from parallel.pipeline.partition import partition_layers, stage_chunks
from parallel.plan import PlanError, count_module
from parallel.plan.memory import model_state_bytes
from parallel.precision import base_precision

from ..config import ConfigError, RecipeConfig, model_config
from ..training.target_model import BuildRequest, build_pieces, flops_per_token

MB = 1e6
#: what mode=plan cannot give a model.target model (written into plan.json and printed)
NOT_PLANNED = "activations, communication, step time, MFU (they need a GPT's shape; run the model to measure them)"


def _dp(rc: RecipeConfig) -> int:
    p, world = rc.parallel, rc.plan.world_size
    if p.dp not in (None, "auto"):
        return p.dp
    per_replica = p.pp * p.tp
    if world and world % per_replica:
        raise ConfigError(f"plan: plan.world_size {world} is not a multiple of pp {p.pp} × tp {p.tp} = {per_replica}")
    return world // per_replica if world else 1


def target_plan(rc: RecipeConfig) -> dict[str, Any]:
    """The plan as plain data (module docstring); raises :class:`ConfigError` for a layout it cannot split."""
    p, t, mc = rc.parallel, rc.train, model_config(rc.model)
    dp = _dp(rc)
    pieces = build_pieces(rc, mc, BuildRequest(mc, device=torch.device("meta"), micro_batch=t.micro_batch))
    costs = dict(embedding_cost=pieces.embedding_cost, head_cost=pieces.head_cost, pp_layers=p.pp_layers)
    try:
        ranges = partition_layers(mc.n_layers, p.pp, vpp=p.vpp, **costs)
    except ValueError as e:
        raise ConfigError(f"plan: {e}") from None
    stages = []
    for rank in range(p.pp):
        held, numel = [], 0
        for c, layers in enumerate(stage_chunks(ranges, p.pp, rank)):
            virtual = c * p.pp + rank
            parts = [(piece_prefix("blocks", i), pieces.blocks[i]) for i in layers]
            parts = ([("first.", pieces.first)] if virtual == 0 else []) + parts
            parts += [("last.", pieces.last)] if virtual == len(ranges) - 1 else []
            held += [name.rstrip(".") for name, _ in parts]
            numel += sum(count_module(m, p.tp, is_block=False).numel for _, m in parts)
        try:
            states = model_state_bytes(numel, p.zero, dp, base_precision(t.precision), rc.optim.name, p.offload)
        except PlanError as e:
            raise ConfigError(f"plan: {e}") from None
        stages.append({"stage": rank, "pieces": held, "params_per_rank": numel, "model_states": states})
    return {
        "target": rc.model.target,
        "layout": {"dp": dp, "pp": p.pp, "tp": p.tp, "vpp": p.vpp, "zero": p.zero},
        "params": sum(x.numel() for m in (pieces.first, *pieces.blocks, pieces.last) for x in m.parameters()),
        "flops_per_token": flops_per_token(pieces, mc),
        "flops_source": "builder" if pieces.flops_per_token is not None else "FlopCounterMode on meta",
        "stages": stages,
        "not_planned": NOT_PLANNED,
    }


def _pieces_text(names: list[str]) -> str:
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("blocks.")]
    text = [n for n in names if not n.startswith("blocks.")]
    if blocks:
        text.insert(1 if names[0] == "first" else 0, f"blocks {min(blocks)}-{max(blocks)}")
    return ", ".join(text)


def run_target_plan(rc: RecipeConfig, run_dir: str) -> dict[str, Any]:
    """Print the target model's plan, write ``plan.json``; the flat summary a sweep compares."""
    plan = target_plan(rc)
    L = plan["layout"]
    print(f"plan for model.target={plan['target']}: dp={L['dp']} pp={L['pp']} tp={L['tp']} zero={L['zero']}")
    print(f"{'stage':>5}  {'params/rank':>12}  {'weights MB':>10}  {'grads MB':>9}  {'optim MB':>9}  pieces")
    for s in plan["stages"]:
        m = s["model_states"]
        print(
            f"{s['stage']:>5}  {s['params_per_rank']:>12,}  {m['params'] / MB:>10.3f}  {m['grads'] / MB:>9.3f}  "
            f"{m['optimizer'] / MB:>9.3f}  {_pieces_text(s['pieces'])}"
        )
    print(
        f"{plan['params']:,} parameters; {plan['flops_per_token'] / 1e6:.3f} MFLOP per token trained "
        f"({plan['flops_source']}); not planned: {plan['not_planned']}"
    )
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=1, allow_nan=False))
    peak = max(s["model_states"]["total"] for s in plan["stages"])
    return {
        "layout": f"dp{L['dp']}·pp{L['pp']}·tp{L['tp']} zero{L['zero']}",
        "params": plan["params"],
        "model_states_mb": round(peak / MB, 4),
        "flops_per_token": plan["flops_per_token"],
    }
