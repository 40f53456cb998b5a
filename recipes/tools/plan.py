"""``mode=plan`` / ``mode=recommend``: the planner behind a recipe's config.

Glue between ``models`` and the pure :mod:`parallel.plan`: parameter counts come
from the real model built on the ``meta`` device (no memory, no process group)
with the real partitioner; the plan is printed as a table (``rich`` when
installed) and written to ``<run dir>/plan.json``. The returned dict is flat, so
a Hydra multirun of ``mode=plan`` ends with one comparison table of its jobs.
"""

from __future__ import annotations

import contextlib
import io
import json
from functools import cache
from pathlib import Path
from typing import Any

from models.config import ModelConfig, ModelConfigError
from parallel.plan import (
    Layout,
    Plan,
    PlanError,
    StageParams,
    Training,
    count_module,
    hardware_profile,
    plan_layout,
    recommend,
    resolve,
)
from parallel.plan.advice import accumulation_choice, compile_choice, dp_sent_bytes
from parallel.plan.search import other_accumulation
from parallel.precision import FP8, base_precision
from parallel.zero.theory import accumulate_applies

from ..config import ConfigError, RecipeConfig, model_config

GB = 1e9


def meta_param_counter(cfg: ModelConfig, sequence_parallel: bool = False):
    """``count(layers, has_embedding, has_head, tp)`` → :class:`StageParams` of that chunk.

    Counts the modules of :func:`models.transformer.build_model` on ``meta``: one
    block of each kind (dense, MoE) times the blocks of that kind in ``layers``, plus the embedding / head
    part built alone (ZeRO's units: each block, and the rest). The model is built at tp=1 with the vocabulary padded as
    for ``tp`` (``vocab_multiple · tp``); a parameter marked ``tp_shard_dim``
    holds ``1/tp`` of its elements per rank, others are replicated, exactly as
    the tensor-parallel layers split them. ``sequence_parallel``: at tp > 1 the replicated ones are
    sequence-parallel, a ZeRO bucket class of their own (:func:`parallel.zero.packing.extra_reduce`).
    """
    from models.transformer import build_model

    @cache
    def part(layers: range, has_embedding: bool, has_head: bool, tp: int) -> StageParams:
        try:
            cfg.validate(tp=tp)
        except ModelConfigError as e:
            raise PlanError(str(e)) from None
        padded = cfg.replace(vocab_multiple=cfg.vocab_multiple * tp)
        stage = build_model(padded, layers=layers, has_embedding=has_embedding, has_head=has_head, device="meta")
        return count_module(stage, tp, is_block=len(layers) == 1, sequence_parallel=sequence_parallel)

    def count(layers: range, has_embedding: bool, has_head: bool, tp: int) -> StageParams:
        moe = [i for i in layers if cfg.is_moe_layer(i)]  # MoE blocks (experts) differ from dense ones
        total = part(range(0, 0), has_embedding, has_head, tp)
        for kind in ([i for i in layers if not cfg.is_moe_layer(i)], moe):
            if kind:
                total = part(range(kind[0], kind[0] + 1), False, False, tp).scaled(len(kind)) + total
        return total

    return count


def _training(rc: RecipeConfig, mc: ModelConfig) -> Training:
    t, c = rc.train, rc.comm
    return Training(
        global_batch=t.global_batch,
        micro_batch=t.micro_batch,
        precision=base_precision(t.precision),
        fp8=t.fp8_recipe if t.precision == FP8 else None,
        checkpointing=mc.activation_checkpointing,
        optimizer=rc.optim.name,
        comm_dtype=c.dtype,
        overlap=c.overlap,
        topk_ratio=c.topk_ratio,
        bucket_mb=c.bucket_mb,
        grad_clip=t.grad_clip,
        compiled=compile_priced(rc),
    )


def compile_priced(rc: RecipeConfig) -> bool:
    """Whether the plan prices ``train.compile``: through AOT autograd (``inductor``, ``aot_eager``), whose
    partitioner picks what a block saves; the ``eager`` backend only traces, and saves what eager saves."""
    return bool(rc.train.compile) and rc.train.compile_backend != "eager"


def _hardware(rc: RecipeConfig):
    s = rc.plan
    overrides = {
        "intra_node_gbps": s.intra_node_gbps,
        "inter_node_gbps": s.inter_node_gbps,
        "efficiency": s.efficiency,
        "gpus_per_node": s.gpus_per_node,
        "memory_bytes": None if s.memory_gb is None else s.memory_gb * GB,
    }
    return hardware_profile(s.hardware, dict(s.profiles or {}), **overrides)


def _world(rc: RecipeConfig) -> int | None:
    """``plan.world_size``, refused unless None or a positive integer (0 must not mean "unset")."""
    world = rc.plan.world_size
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise PlanError(
            f"plan.world_size={world!r} must be a positive integer (the devices to plan for), or unset "
            f"to plan parallel.dp as given"
        )
    return world


def _layout(rc: RecipeConfig, mc: ModelConfig) -> Layout:
    """The resolved layout of ``rc`` for the model ``mc`` (:func:`parallel.plan.resolve`: the library's rules)."""
    p = rc.parallel
    if p.dp in (None, "auto"):
        world = _world(rc)
        per_replica = p.pp * p.tp * p.cp
        dp = world // per_replica if world else 1
        if world and world % per_replica:
            raise PlanError(
                f"plan.world_size {world} is not a multiple of pp {p.pp} × tp {p.tp}"
                + (f" × cp {p.cp}" if p.cp > 1 else "")
                + f" = {per_replica}"
            )
    else:
        dp = p.dp
    return resolve(
        mc,
        dp=dp,
        pp=p.pp,
        tp=p.tp,
        vpp=p.vpp,
        sequence_parallel=p.sequence_parallel,
        zero=p.zero,
        accumulate=p.zero_accumulate,
        schedule=p.pp_schedule,
        cp=p.cp,
        cp_impl=p.cp_impl,
        offload=p.offload,
        ep=p.ep,
        compression=rc.comm.compression,
    )


def summary(plan: Plan) -> dict[str, Any]:
    """The flat numbers a sweep compares."""
    L, s = plan.layout, plan.step
    return {
        "layout": f"dp{L['dp']}·pp{L['pp']}·tp{L['tp']}"
        + (f"·cp{L['cp']}" if L.get("cp", 1) > 1 else "")
        + (f"·ep{L['ep']}" if L.get("ep", 1) > 1 else "")
        + f" zero{L['zero']}",
        "fits": plan.fits,
        "peak_gb": round(plan.peak_memory / GB, 2),
        "step_s": round(s["step_time_s"], 4),
        "tokens_per_s": round(s["tokens_per_s"], 1),
        "mfu": round(s["mfu"], 4),
        "bubble": round(s["bubble_fraction"], 4),
        "compute_comm": round(s["compute_comm_ratio"], 3),
    }


def plan_from_config(rc: RecipeConfig) -> Plan:
    """The plan of ``rc``'s layout (raises :class:`ConfigError` for input it cannot plan); at ZeRO-2/3 its
    advice ends with what the other ``parallel.zero_accumulate`` sends, holds and takes; without
    ``train.compile``, with what compiling would hold less (:func:`compile_choice`), where it is ≥ 5 %."""
    if rc.model.target:  # the trainer's reports and forensics: no prediction for a model given as pieces
        raise ConfigError("plan: a model.target model has no predicted step (mode=plan counts its parameters only)")
    try:
        mc = model_config(rc.model)
        world, hw, count = _world(rc), _hardware(rc), meta_param_counter(mc, rc.parallel.sequence_parallel)
        plan = plan_layout(
            mc,
            _layout(rc, mc),
            _training(rc, mc),
            hw,
            count,
            world_size=world if rc.parallel.dp not in (None, "auto") else None,
            pp_layers=tuple(rc.parallel.pp_layers) if rc.parallel.pp_layers else None,
        )
        other = other_accumulation(mc, plan, hw, count)
        if other is not None:
            plan.advice.append(accumulation_choice(plan, other, hw))
        if not plan.training["compiled"] and not rc.train.compile:
            compiled = Training(**{**plan.training, "compiled": True})
            layout = resolve(mc, **{k: v for k, v in plan.layout.items() if k != "pp_layers"})
            again = plan_layout(mc, layout, compiled, hw, count, pp_layers=plan.layout.get("pp_layers"))
            plan.advice += [a for a in [compile_choice(plan, again, hw)] if a]
        return plan
    except PlanError as e:
        raise ConfigError(f"plan: {e}") from None


def recommend_from_config(rc: RecipeConfig) -> list[Plan]:
    try:
        mc = model_config(rc.model)
        hw = _hardware(rc)
        world = _world(rc) or rc.parallel.gpus_per_node
        return recommend(
            mc,
            world,
            _training(rc, mc),
            hw,
            meta_param_counter(mc, rc.parallel.sequence_parallel),
            top=rc.plan.top,
            compression=rc.comm.compression,
        )
    except PlanError as e:
        raise ConfigError(f"recommend: {e}") from None


# ---------------------------------------------------------------- printing
def plan_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
    header = [
        "stage",
        "layers",
        "params/rank",
        "weights GB",
        "grads GB",
        "optim GB",
        "activ. GB (×mb)",
        "temp. GB",
        "buffers GB",
        "total GB",
        "DP GB/s-step",
        "TP GB/s-step",
        "PP GB",
    ]
    rows = []
    for r in plan.ranks:
        m, t = r.memory, r.traffic
        layers = ",".join(f"{a}-{b - 1}" for a, b in r.layers)
        tp = f"{t['tp']['bytes'] / GB:.2f}/{t['tp']['time_s']:.3f}" + (" ⚠node" if t["tp"]["crosses_node"] else "")
        rows.append(
            [
                str(r.stage),
                layers,
                f"{r.params.numel:,}",
                f"{m['params'] / GB:.2f}",
                f"{m['grads'] / GB:.2f}",
                f"{m['optimizer'] / GB:.2f}",
                f"{m['activations'] / GB:.2f} (×{r.in_flight})",
                f"{m.get('temporaries', 0.0) / GB:.2f}",
                f"{m['buffers'] / GB:.2f}",
                f"{m['total'] / GB:.2f}" + ("" if r.fits else " ✗"),
                f"{t['dp']['bytes'] / GB:.2f}/{t['dp']['time_s']:.3f}",
                tp,
                f"{t['pp']['bytes'] / GB:.2f}",
            ]
            + ([f"{t['cp']['bytes'] / GB:.2f}/{t['cp']['time_s']:.3f}"] if plan.layout.get("cp", 1) > 1 else [])
        )
    if plan.layout.get("cp", 1) > 1:  # context parallel: the ring's (or Ulysses') traffic (docs/cp.md)
        header.append("CP GB/s-step")
    if "ep" in plan.ranks[0].traffic:  # MoE: all-to-all on ep (exposed), expert gradients on edp (docs/moe.md)
        header.append("EP GB/s-step")
        for r, row in zip(plan.ranks, rows):
            t = r.traffic
            row.append(
                f"{t['ep']['bytes'] / GB:.2f}/{t['ep']['time_s']:.3f}"
                + (f" edp {t['edp']['bytes'] / GB:.2f}" if "edp" in t else "")
            )
    return header, rows


def plan_footer(plan: Plan) -> list[str]:
    s, L, hw = plan.step, plan.layout, plan.hardware
    lines = [
        f"{L['dp'] * L['pp'] * L['tp'] * L.get('cp', 1)} × {hw['name']} ({hw['memory_bytes'] / GB:.1f} GB): "
        f"dp={L['dp']} pp={L['pp']} tp={L['tp']}"
        + (f" cp={L['cp']} ({L['cp_impl']})" if L.get("cp", 1) > 1 else "")
        + (f" ep={L['ep']}" if "params_total" in s else "")
        + f" zero={L['zero']}"
        + (f" accumulating {L['accumulate']}" if accumulate_applies(L["zero"]) else "")
        + f" sp={L['sequence_parallel']}, micro-batch {plan.training['micro_batch']} × "
        f"{plan.grad_accum} per step, checkpointing {plan.training['checkpointing']}, {plan.training['precision']}"
        + (f" with fp8 {plan.training['fp8']} GEMMs" if plan.training.get("fp8") else "")
        + (", blocks and loss compiled (train.compile priced)" if plan.training.get("compiled") else ""),
        f"fits: {'yes' if plan.fits else 'NO'} (peak {plan.peak_memory / GB:.2f} GB)  step {s['step_time_s']:.3f} s "
        f"(pipeline {s['pipeline_s']:.3f}, bubble {s['bubble_fraction']:.1%}, exposed DP {s['dp_exposed_s']:.3f})  "
        f"{s['tokens_per_s']:,.0f} tokens/s  MFU {s['mfu']:.1%}  compute/comm {s['compute_comm_ratio']:.2f}",
    ]
    if "params_total" in s:  # MoE: FLOPs, MFU and TFLOP/s per GPU count the active parameters only
        lines.append(
            f"MoE: {s['params_total'] / 1e9:.2f}B parameters, {s['params_active'] / 1e9:.2f}B active per token; "
            f"{s['model_flops_per_token'] / 1e9:.1f} GFLOP per token (active), {s['tflops_per_gpu']:.1f} TFLOP/s per GPU"
        )
    return lines + [f"advice: {a}" for a in plan.advice]


def format_plain(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def print_table(title: str, header: list[str], rows: list[list[str]], footer: list[str]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(format_plain(header, rows))
    else:
        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*r)
        Console(width=200).print(table)
    print("\n".join(footer))


def run_plan(rc: RecipeConfig, run_dir: str, *, quiet: bool = False) -> dict[str, Any]:
    """Print the plan (or, ``mode=recommend``, the best layouts) and write ``plan.json``.

    ``quiet`` (a job of a multirun, which ends with one comparison table of its jobs): the
    table goes to ``plan.txt`` beside ``plan.json`` instead of the screen.
    """
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    if rc.model.target and not quiet:  # your own model: what counting its pieces can tell
        from .plan_target import run_target_plan

        return run_target_plan(rc, run_dir)
    if quiet:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            result = run_plan(rc, run_dir)
        (out / "plan.txt").write_text(text.getvalue())
        return result
    if rc.mode == "recommend":
        plans = recommend_from_config(rc)
        header = ["rank", "layout", "ZeRO-2/3 grads", "micro-batch", "checkpointing", "peak GB", "DP GB/step"]
        header += ["step s", "tokens/s", "MFU", "bubble"]
        rows = [
            [
                str(i + 1),
                summary(p)["layout"],
                p.layout["accumulate"] if accumulate_applies(p.layout["zero"]) else "—",
                str(p.training["micro_batch"]),
                p.training["checkpointing"],
                f"{p.peak_memory / GB:.1f}",
                f"{dp_sent_bytes(p) / GB:.2f}",
                f"{p.step['step_time_s']:.3f}",
                f"{p.step['tokens_per_s']:,.0f}",
                f"{p.step['mfu']:.1%}",
                f"{p.step['bubble_fraction']:.1%}",
            ]
            for i, p in enumerate(plans)
        ]
        print_table(f"best layouts for {rc.model.preset}", header, rows, plan_footer(plans[0]))
        (out / "plan.json").write_text(json.dumps([p.to_dict() for p in plans], indent=1, allow_nan=False))
        return {
            **summary(plans[0]),
            "micro_batch": plans[0].training["micro_batch"],
            "checkpointing": plans[0].training["checkpointing"],
            "accumulate": plans[0].layout["accumulate"],
        }
    plan = plan_from_config(rc)
    header, rows = plan_rows(plan)
    print_table(f"plan for {rc.model.preset}", header, rows, plan_footer(plan))
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1, allow_nan=False))
    return summary(plan)
