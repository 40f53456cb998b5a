"""Advice in plain words from a plan, following the layout rules of docs/architecture.md."""

from __future__ import annotations

from ..pipeline.schedules import zero_bubble_problem
from ..zero.theory import accumulation_grad_bytes, grad_reductions_per_step
from . import memory as M

GB = 1e9


def dp_sent_bytes(plan) -> float:
    """Bytes one rank sends per step on its data-parallel groups (dense and, with ep, expert DP), the most over the stages."""
    return max(r.traffic["dp"]["bytes"] + r.traffic.get("edp", {}).get("bytes", 0.0) for r in plan.ranks)


def _bytes(b: float) -> str:
    return f"{b / GB:.2f} GB" if b >= 0.1 * GB else f"{b / 1e6:.2f} MB"


def _accumulation_terms(plan, hw) -> str:
    L, m = plan.layout, plan.grad_accum
    n = grad_reductions_per_step(L["zero"], m, L["accumulate"])
    held = max(accumulation_grad_bytes(r.params.numel, L["zero"], L["accumulate"]) for r in plan.ranks)
    fit = "" if plan.fits else f", does not fit {hw.memory_bytes / GB:.1f} GB"
    return (
        f"({n} reduce-scatter{'s' * (n > 1)} per step"
        + (f", the full fp32 gradient held: {_bytes(held)}" if held else "")
        + f"): {_bytes(dp_sent_bytes(plan))} sent per rank per step, peak {_bytes(plan.peak_memory)}{fit}, "
        f"step {plan.step['step_time_s']:.3f} s"
    )


def accumulation_choice(plan, other, hw) -> str:
    """ZeRO-2/3's gradient accumulation in ``plan`` against ``other`` (the same layout and training with the
    other ``parallel.zero_accumulate``): each one's reduce-scatters per step, DP bytes sent per rank per step,
    full gradient held, peak memory and step time, as the planner prices them."""
    return (
        f"ZeRO-{plan.layout['zero']} accumulating {plan.layout['accumulate']} {_accumulation_terms(plan, hw)}; "
        f"with parallel.zero_accumulate={other.layout['accumulate']} {_accumulation_terms(other, hw)}."
    )


def compile_choice(plan, compiled, hw, *, least: float = 0.05) -> str | None:
    """What ``train.compile`` would hold less than ``plan`` (``compiled``: the same layout and training,
    compiled), where its peak is at least ``least`` lower; None otherwise."""
    saved = plan.peak_memory - compiled.peak_memory
    if saved < least * plan.peak_memory:
        return None
    acts = [max(r.memory["activations"] for r in p.ranks) for p in (plan, compiled)]
    fit = (
        ""
        if compiled.fits == plan.fits
        else (", fits" if compiled.fits else f", does not fit {hw.memory_bytes / GB:.1f} GB")
    )
    return (
        f"train.compile=true holds {_bytes(saved)} less per rank (activations {_bytes(acts[0])} → {_bytes(acts[1])}, "
        f"peak {_bytes(compiled.peak_memory)}{fit}), as inductor's graphs measured on a CPU save; compile is off "
        f"by default until proven on a GPU (docs/compile.md)."
    )


def _smallest_zero_that_fits(plan, rank, hw) -> int | None:
    L, T = plan.layout, plan.training
    rest = rank.memory["activations"] + rank.memory["temporaries"] + rank.memory["buffers"]
    for z in range(L["zero"] + 1, 4):
        states = M.model_state_bytes(rank.params.numel, z, L["dp"], T["precision"], T["optimizer"])["total"]
        if states + rest <= hw.memory_bytes:
            return z
    return None


def _bubble_fixes(plan, shape, moe: bool) -> list[str]:
    """What shrinks the bubble at this global batch and dp that the recipe can run (what ``mode=recommend``
    searches): more micro-batches per step, ZB-H1, interleaving (its micro-batches a multiple of pp), more chunks."""
    L, T, pp = plan.layout, plan.training, plan.layout["pp"]
    fixes = []
    if plan.grad_accum < 4 * pp and T["micro_batch"] > 1:
        fixes.append(f"lower the micro-batch below {T['micro_batch']} for more micro-batches per step (≥ 4·pp)")
    if L["schedule"] == "1f1b" and not moe and not zero_bubble_problem("zb-h1", T["checkpointing"], L["zero"]):
        fixes.append("use the zero-bubble schedule (zb-h1)")
    if L["schedule"] != "interleaved" and 2 * pp <= shape.n_layers and plan.grad_accum % pp == 0:
        fixes.append("use the interleaved schedule")
    elif L["schedule"] == "interleaved" and pp * (L["vpp"] + 1) <= shape.n_layers:
        fixes.append(f"raise vpp above {L['vpp']}")
    return fixes


def advise(plan, shape, hw, *, moe: bool = False) -> list[str]:
    """The plan's problems and their fixes in plain words; a fix is only named where the recipe can run it
    (``moe``: an MoE model, which zb-h1 does not run)."""
    L, T, step = plan.layout, plan.training, plan.step
    out: list[str] = []
    worst = max(plan.ranks, key=lambda r: r.memory["total"])
    mem = worst.memory
    if not worst.fits:
        act_share = mem["activations"] / mem["total"]
        out.append(
            f"does not fit: stage {worst.stage} needs {mem['total'] / GB:.1f} GB of "
            f"{hw.memory_bytes / GB:.1f} GB ({hw.name})."
        )
        if act_share > 0.3 and T["checkpointing"] != "full":
            nxt = "selective" if T["checkpointing"] == "none" else "full"
            out.append(
                f"activations are {act_share:.0%} of memory: turn on activation checkpointing "
                f"({nxt}) before lowering the micro-batch."
            )
        if mem["model_states"] > 0.5 * hw.memory_bytes:
            z = _smallest_zero_that_fits(plan, worst, hw)
            if z is not None:
                out.append(
                    f"model states take {mem['model_states'] / GB:.1f} GB: ZeRO-{z} over dp={L['dp']} "
                    f"shards them enough to fit (ZeRO before plain data parallelism)."
                )
            elif L["dp"] == 1:
                out.append(
                    "model states alone do not fit one device: add data parallelism with ZeRO, tensor "
                    "parallelism inside a node or pipeline stages across nodes."
                )
            else:
                out.append(
                    "even ZeRO-3 does not make it fit: add tensor parallelism (inside a node) when one "
                    "layer is too big, pipeline stages (across nodes) for deep models."
                )
    elif mem["total"] < 0.6 * hw.memory_bytes and T["checkpointing"] == "full":
        out.append(
            f"fits with {(hw.memory_bytes - mem['total']) / GB:.0f} GB to spare: full recomputation costs "
            f"≈ a third more compute; try selective or none, or a larger micro-batch."
        )
    tp_axis = worst.traffic["tp"]
    if tp_axis["crosses_node"]:
        out.append(
            f"tp={L['tp']} spans nodes ({hw.gpus_per_node} devices per node): its per-layer collectives run "
            f"at {hw.inter_node_gbps:g} GB/s instead of {hw.intra_node_gbps:g}; keep tp ≤ "
            f"{hw.gpus_per_node} and use pipeline stages across nodes."
        )
    if L["pp"] > 1 and step["bubble_fraction"] > 0.2:
        fixes = _bubble_fixes(plan, shape, moe)
        if fixes:
            out.append(
                f"the pipeline bubble is {step['bubble_fraction']:.0%}: with {plan.grad_accum} micro-batches "
                f"per step over pp={L['pp']}, {' or '.join(fixes)}."
            )
    if L["pp"] > 1 and shape.n_layers < 50 and worst.fits and L["tp"] == 1 and L["zero"] == 0:
        out.append(
            f"pipeline parallelism pays off for deep models (≳50 layers); with {shape.n_layers} layers "
            f"ZeRO data parallelism may do the same with no bubble."
        )
    ratio = step["compute_comm_ratio"]
    overlap = "" if T["overlap"] else ", overlap gradients with backward (comm.overlap)"
    if ratio < 1:
        out.append(
            f"communication-bound: compute/communication = {ratio:.2f} < 1, scaling collapses; "
            f"accumulate more micro-batches per step{overlap}, keep heavy collectives inside a node."
        )
    if step["dp_exposed_s"] > 0.2 * step["step_time_s"]:
        fixes = ["raise gradient accumulation"] + (["turn on comm.overlap"] if not T["overlap"] else [])
        fixes += ["lower dp"] if L["dp"] > 1 else []
        out.append(
            f"{step['dp_exposed_s']:.2f} s of the {step['step_time_s']:.2f} s step waits for data-parallel "
            f"gradients: {', '.join(fixes[:-1]) + ' or ' + fixes[-1] if len(fixes) > 1 else fixes[0]}."
        )
    if L["compression"] == "topk":
        c = M.comm_bytes(T["precision"], T["comm_dtype"])
        if L["dp"] * T["topk_ratio"] * (c + 4) / c >= 2:
            out.append(
                f"Top-K at ratio {T['topk_ratio']:g} sends more than the dense all-reduce over dp={L['dp']} "
                f"(it all-gathers k values + indices from every rank: pays off only while "
                f"dp·ratio·(b+4)/b < 2)."
            )
    return out
