"""The whole suite: each of our layouts next to PyTorch's own equivalent, on one small GPT.

    python -m benchmarks [--quick] [--out DIR] [--steps N] [--only dp,tp] [--sizes small,medium,large]
                         [--rows "dp ZeRO-0,pp=2 1F1B"]

Rows (all ranks are forked gloo CPU processes, one thread each):

* ``single``: our trainer step at dp=pp=tp=1 vs a plain PyTorch GPT step (same weights);
* ``dp ZeRO-k`` (2 ranks), each against the PyTorch configuration that runs its algorithm, or the
  nearest one, named as such: ZeRO-0 vs DDP; ZeRO-1 vs DDP + ZeroRedundancyOptimizer (which broadcasts
  every parameter, 1.5x the bytes) and vs FSDP2 without resharding (equal bytes, but it shards the
  parameters too); ZeRO-2 accumulating unsharded vs FSDP2 without resharding (nearest: it shards the
  parameters at rest); ZeRO-3 accumulating sharded vs FSDP2 reducing every micro-batch, and ZeRO-3
  accumulating unsharded vs FSDP2 with gradient sync off until the last micro-batch;
* ``tp`` (2 ranks): our Megatron TP vs ``torch.distributed.tensor.parallel``;
* ``pp 1f1b`` / ``pp interleaved`` (2 ranks): our executor vs ``torch.distributed.pipelining``
  ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``;
* ``3d`` (8 ranks): ours at (dp, pp, tp) = (2, 2, 2) vs DDP at (8, 1, 1).

Both sides call gloo's own collectives (the algorithms NCCL runs); rows with ZeRO 1-3 also time
ours with the gloo seam's CPU-only rewrites (the "gloo-tuned" column, :func:`gloo_tuned_column`).
In each row both contenders live in the same processes and alternate step by step
(a row's contenders all take one turn per round), so machine drift hits both; the
ratio ours/theirs is taken per round (slowest rank of each) and reported as median
with its interquartile range, and the same for each rank's CPU time (``time.process_time``,
which other processes on shared cores inflate far less than wall time). Each row at each of
``--sizes`` (:data:`benchmarks.gpt.SIZES`: 0.87 M, 3.3 M, 25.6 M parameters; default small).
Also per row: model-state MB per rank (max over ranks),
MB sent per rank per step (mean over ranks, :class:`parallel.comm.CommCounter`) vs
theory (:mod:`benchmarks.theory`), and for our pipelines the bubble measured on the
executor's timeline vs ``(p-1)/(v·m+p-1)``. Writes ``results.md`` and ``ratios.png`` into
``--out`` (default ``benchmarks/results/``) and appends the run (rows, git sha, date) to the
history in its ``results.json``, so a regression shows against earlier runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

from parallel import comm
from parallel.comm.gloo import tune_gloo
from parallel.pipeline.timeline import bubble_fraction
from parallel.testing import run_ranks

from . import theory
from .common import compare, slowest_rank, time_alternating
from .contenders import Ours, Theirs
from .gpt import SIZES, suite_recipe

# section -> (world size, [(row name, our recipe's parallel settings, PyTorch's contender)])
SECTIONS: dict[str, tuple[int, list[tuple[str, dict, str]]]] = {
    "single": (1, [("single process", {}, "plain")]),
    "dp": (
        2,
        [
            ("dp ZeRO-0", dict(zero=0), "ddp"),
            # different algorithms, said so: ZeroRedundancyOptimizer broadcasts every parameter (1.5x our bytes);
            # FSDP2 without resharding sends our bytes but also shards the parameters at rest
            ("dp ZeRO-1", dict(zero=1), "zero_redundancy"),
            ("dp ZeRO-1 vs equal bytes", dict(zero=1), "fsdp2_zero2"),
            # the nearest FSDP2 has: it reduces once per step, so ours accumulates unsharded too (issue 17)
            ("dp ZeRO-2", dict(zero=2, zero_accumulate="unsharded"), "fsdp2_zero2"),
            # same algorithm, same row: sharded accumulation vs FSDP2 reducing every micro-batch ...
            ("dp ZeRO-3", dict(zero=3), "fsdp2_zero3_each"),
            # ... unsharded accumulation vs FSDP2 with gradient sync off until the last micro-batch
            ("dp ZeRO-3 unsharded acc.", dict(zero=3, zero_accumulate="unsharded"), "fsdp2_zero3"),
        ],
    ),
    "tp": (2, [("tp=2", dict(tp=2), "dtensor_tp")]),
    "pp": (
        2,
        [
            ("pp=2 1F1B", dict(pp=2), "torch_1f1b"),
            ("pp=2 interleaved v=2", dict(pp=2, pp_schedule="interleaved", vpp=2), "torch_interleaved"),
        ],
    ),
    "3d": (8, [("3d (2,2,2) ZeRO-1", dict(dp=2, pp=2, tp=2, zero=1), "ddp")]),
}
LABELS = {
    "plain": "plain PyTorch",
    "ddp": "DDP",
    "zero_redundancy": "DDP + ZeroRedundancyOptimizer (broadcasts: 1.5x bytes)",
    "fsdp2_zero2": "FSDP2 no reshard (nearest: also shards parameters)",
    "fsdp2_zero3": "FSDP2 reshard, sync on the last micro-batch",
    "fsdp2_zero3_each": "FSDP2 reshard, sync every micro-batch",
    "dtensor_tp": "DTensor TP",
    "torch_1f1b": "pipelining Schedule1F1B",
    "torch_interleaved": "pipelining ScheduleInterleaved1F1B",
}


def expected_bytes(ours: Ours) -> float:
    """What our step should send from this rank (DP + TP + PP, :mod:`benchmarks.theory`)."""
    tr = ours.trainer
    lay, p, mc = tr.layout, tr.rc.parallel, tr.model_cfg
    m, mb = lay.grad_accum, lay.micro_batch
    sent = 0.0
    if lay.dp > 1:
        psi = sum(q.numel() for q in tr.engine.model.parameters())
        in_units = sum(q.numel() for ch in tr.engine.model.chunks for q in ch.blocks.parameters())
        sent += theory.dp_bytes(psi, p.zero, lay.dp, m, regathered_psi=in_units, accumulate=p.zero_accumulate)
    if lay.tp > 1:
        for chunk in tr.engine.model.chunks:
            sent += theory.tp_bytes(
                lay.tp, m, mb, mc.seq_len, mc.d_model, len(chunk.layers), chunk.has_embedding, chunk.has_head
            )
    if lay.pp > 1:
        sent += theory.pp_bytes(lay.pp, m, mb, mc.seq_len, mc.d_model, p.vpp)
    return sent


def gloo_tuned_column(parallel: dict) -> bool:
    """Whether a row gets the second column: ours with the gloo seam's CPU-only rewrites of
    reduce-scatter and all-gather (:mod:`parallel.comm.gloo`), which ZeRO stages 1-3 call; the
    headline runs gloo's own collectives on both sides, the algorithms NCCL runs."""
    return parallel.get("zero", 0) >= 1


def _ours(rc, tuned: bool) -> Ours:
    previous = tune_gloo(tuned)  # decided when the trainer's groups are made
    try:
        return Ours(rc)
    finally:
        tune_gloo(previous)


def _section_rank(
    pairs: list[tuple[str, dict, str]], quick: bool, steps: int, warmup: int, size: str = "small"
) -> list[dict]:
    """This rank's measurements of every pair of a section at model ``size`` (run under run_ranks)."""
    contenders = {}
    for name, parallel, kind in pairs:
        ours = _ours(suite_recipe(quick=quick, size=size, **parallel), tuned=False)
        contenders[f"{name}|ours"], contenders[f"{name}|theirs"] = ours, Theirs(kind, ours)
        if gloo_tuned_column(parallel):
            contenders[f"{name}|tuned"] = _ours(suite_recipe(quick=quick, size=size, **parallel), tuned=True)
    cpu: dict[str, list[float]] = {}
    times = time_alternating({k: c.step for k, c in contenders.items()}, steps, warmup, cpu=cpu)
    for name, parallel, _ in pairs:  # the bubble: one more step, recorded (the timed ones record nothing,
        if parallel.get("pp", 1) > 1:  # as PyTorch's side); its stages start together, as in the rounds
            comm.barrier()
            with contenders[f"{name}|ours"].trainer.engine.recording_timeline():
                contenders[f"{name}|ours"].step()
    out = []
    for name, parallel, kind in pairs:
        ours, theirs = contenders[f"{name}|ours"], contenders[f"{name}|theirs"]
        g, tuned = ours.trainer.groups, contenders.get(f"{name}|tuned")
        out.append(
            {
                "tuned_s": times.get(f"{name}|tuned"),
                "tuned_cpu_s": cpu.get(f"{name}|tuned"),
                "tuned_sent": None if tuned is None else tuned.sent_bytes,
                "ours_s": times[f"{name}|ours"],
                "theirs_s": times[f"{name}|theirs"],
                "ours_cpu_s": cpu[f"{name}|ours"],
                "theirs_cpu_s": cpu[f"{name}|theirs"],
                "ours_state": ours.state_bytes(),
                "theirs_state": theirs.state_bytes(),
                "ours_sent": ours.sent_bytes,
                "theirs_sent": theirs.sent_bytes,
                "theory_sent": expected_bytes(ours),
                "m": ours.trainer.layout.grad_accum,
                "timeline": ours.timeline() if g.pp_size > 1 and g.dp_rank == 0 and g.tp_rank == 0 else None,
            }
        )
    return out


def _mean(xs):
    return None if any(x is None for x in xs) else sum(xs) / len(xs)


def summarize(name: str, parallel: dict, kind: str, world: int, ranks: list[dict], size: str = "small") -> dict:
    """One table row from every rank's measurements of one pair."""
    row = {
        "row": name,
        "size": size,
        "world": world,
        "ours": "gridtrain " + ",".join(f"{k}={v}" for k, v in parallel.items()),
        "theirs": LABELS[kind],
    }
    row.update(compare(slowest_rank([r["ours_s"] for r in ranks]), slowest_rank([r["theirs_s"] for r in ranks])))
    cpu = compare(slowest_rank([r["ours_cpu_s"] for r in ranks]), slowest_rank([r["theirs_cpu_s"] for r in ranks]))
    row.update({f"cpu_{k}": v for k, v in cpu.items() if k != "rounds"})
    if ranks[0]["tuned_s"] is not None:  # the second column: ours gloo-tuned vs the same PyTorch side
        theirs_s, theirs_cpu = (
            slowest_rank([r["theirs_s"] for r in ranks]),
            slowest_rank([r["theirs_cpu_s"] for r in ranks]),
        )
        row["tuned_ratio"] = compare(slowest_rank([r["tuned_s"] for r in ranks]), theirs_s)["ratio"]
        row["tuned_cpu_ratio"] = compare(slowest_rank([r["tuned_cpu_s"] for r in ranks]), theirs_cpu)["ratio"]
        row["tuned_sent_MB"] = _mean([r["tuned_sent"] for r in ranks]) / 2**20
    else:
        row["tuned_ratio"] = row["tuned_cpu_ratio"] = row["tuned_sent_MB"] = None
    mb = 2**20
    row["ours_state_MB"] = max(r["ours_state"] for r in ranks) / mb
    row["theirs_state_MB"] = max(r["theirs_state"] for r in ranks) / mb
    for key in ("ours_sent", "theirs_sent", "theory_sent"):
        value = _mean([r[key] for r in ranks])
        row[key + "_MB"] = None if value is None else value / mb
    theory_mb = row["theory_sent_MB"]
    row["sent_vs_theory"] = row["ours_sent_MB"] / theory_mb - 1 if theory_mb else None
    timelines = [r["timeline"] for r in ranks if r["timeline"] is not None]
    pp, vpp = parallel.get("pp", 1), parallel.get("vpp", 1)
    row["bubble"] = bubble_fraction(timelines) if timelines else None
    row["bubble_theory"] = theory.bubble_fraction(pp, ranks[0]["m"], vpp) if pp > 1 else None
    return row


def run_suite(
    sections: list[str],
    quick: bool,
    steps: int,
    warmup: int,
    sizes: tuple[str, ...] = ("small",),
    rows_named: tuple[str, ...] = (),
) -> list[dict]:
    """Every row of ``sections`` at every size; ``rows_named``: only the rows whose name is one of these."""
    rows = []
    for size in sizes:
        for section in sections:
            world, pairs = SECTIONS[section]
            pairs = [p for p in pairs if not rows_named or p[0] in rows_named]
            if not pairs:
                continue
            t0 = time.perf_counter()
            per_rank = run_ranks(_section_rank, world, pairs, quick, steps, warmup, size, timeout=1800)
            for i, (name, parallel, kind) in enumerate(pairs):
                rows.append(summarize(name, parallel, kind, world, [r[i] for r in per_rank], size))
            print(f"[{size} {section}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


def _fmt(x, spec, none="—"):
    return none if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    """The suite's table. Both sides call gloo's own collectives in every ratio but the "gloo-tuned"
    column, ours with the seam's CPU-only rewrites (:func:`gloo_tuned_column`), which NCCL never runs."""
    head = (
        "| row | size | ranks | PyTorch | ours ms | PyTorch ms | ours/PyTorch [IQR] | CPU ours/PyTorch [IQR] "
        "| CPU gloo-tuned ours/PyTorch | state MB/rank ours / PyTorch | sent MB/rank ours / PyTorch / theory (Δ) "
        "| bubble ours / theory |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        delta = "" if r["sent_vs_theory"] is None else f" ({r['sent_vs_theory']:+.1%})"
        lines.append(
            f"| {r['row']} | {r['size']} | {r['world']} | {r['theirs']} | {r['ours_ms']:.1f} | {r['theirs_ms']:.1f} "
            f"| {r['ratio']:.2f} [{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}] "
            f"| {r['cpu_ratio']:.2f} [{r['cpu_ratio_lo']:.2f}–{r['cpu_ratio_hi']:.2f}] "
            f"| {_fmt(r['tuned_cpu_ratio'], '.2f')} "
            f"| {r['ours_state_MB']:.2f} / {r['theirs_state_MB']:.2f} "
            f"| {_fmt(r['ours_sent_MB'], '.3f')} / {_fmt(r['theirs_sent_MB'], '.3f')} / "
            f"{_fmt(r['theory_sent_MB'], '.3f')}{delta} "
            f"| {_fmt(r['bubble'], '.1%')} / {_fmt(r['bubble_theory'], '.1%')} |"
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['row']} ({r['size']})" for r in rows][::-1]
    ratios = [r["ratio"] for r in rows][::-1]
    err = [[r["ratio"] - r["ratio_lo"] for r in rows][::-1], [r["ratio_hi"] - r["ratio"] for r in rows][::-1]]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    ax.barh(names, ratios, xerr=err, color=["tab:green" if x <= 1 else "tab:orange" for x in ratios])
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("step time ours / PyTorch (median per round, IQR bars)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def git_sha() -> str | None:
    """The commit the suite ran at (``+dirty`` with uncommitted changes), or None outside git."""
    root = Path(__file__).parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode:
        return None
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def append_history(path: Path, run: dict) -> list[dict]:
    """Append ``run`` to the runs kept in ``path`` (``{"runs": [...]}``, oldest first; a file in the
    old one-run ``{"meta", "rows"}`` form becomes the first run); return all runs."""
    runs: list[dict] = []
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError:
            saved = {}
        runs = saved.get("runs", [saved] if "rows" in saved else [])
    runs.append(run)
    path.write_text(json.dumps({"runs": runs}, indent=1))
    return runs


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, sequence 32 (under 2 minutes)")
    ap.add_argument("--steps", type=int, help="timed rounds (default 20, quick 4)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first (default 2, quick 1)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}, or plan")
    ap.add_argument("--sizes", default="small", help=f"comma-separated model sizes of {list(SIZES)}")
    ap.add_argument("--rows", default="", help="comma-separated row names (e.g. 'dp ZeRO-0'): only these rows")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    sections = [s for s in a.only.split(",") if s]
    if "plan" in sections:  # predicted vs measured step time per layout (benchmarks/plan.py)
        from . import plan

        plan.main(a.out)
        sections.remove("plan")
        if not sections:
            return []
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    sizes = tuple(s for s in a.sizes.split(",") if s)
    if not sizes or any(s not in SIZES for s in sizes):
        ap.error(f"--sizes must name some of {list(SIZES)}, got {a.sizes!r}")
    steps = a.steps or (4 if a.quick else 20)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    if steps < 1 or warmup < 0:
        ap.error(f"--steps must be ≥ 1 and --warmup ≥ 0, got {steps} and {warmup}")
    names = tuple(r.strip() for r in a.rows.split(",") if r.strip())
    known = {name for sec in sections for name, _, _ in SECTIONS[sec][1]}
    if set(names) - known:
        ap.error(f"--rows {sorted(set(names) - known)} are not rows of {sections}; they have {sorted(known)}")
    t0 = time.perf_counter()
    rows = run_suite(sections, a.quick, steps, warmup, sizes, names)
    table = markdown(rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "quick": a.quick,
        "steps": steps,
        "warmup": warmup,
        "sizes": list(sizes),
        "rows": list(names),
        "wall_s": time.perf_counter() - t0,
        "git_sha": git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    append_history(out / "results.json", {"meta": meta, "rows": rows})
    (out / "results.md").write_text(table + "\n")
    chart(rows, out / "ratios.png")
    print(table)
    print(f"wrote {out}/results.md, results.json, ratios.png in {meta['wall_s']:.0f} s")
    return rows
