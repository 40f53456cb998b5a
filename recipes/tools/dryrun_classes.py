"""``dryrun.ranks=classes``: one rank of every distinct class of a layout, dry-run and cross-checked.

A rank's work depends on its pipeline stage, tp, cp and expert (``dp % ep``) index; the data-parallel
replicas are otherwise alike. :func:`class_ranks` takes every (stage, tp, cp) of the first and of the
last expert group of DP replicas (with ep = 1: the first and last replica), so that every group holds two or more recorded
members — TP, CP, PP (and each send/receive pair), the embedding group, EP, expert DP and DP (the first
and the last replica) — and :func:`parallel.comm.compare_sequences` checks each of them.

The ranks run in processes forked from this one (:func:`run_forked`) after it has imported the
trainer, torch and the engine, and validated the config: a forked rank starts at building its model,
not at ``import torch`` (each fork is fresh, so every rank still has a clean default process group).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

#: a rank's coordinates that decide its work, the columns of the per-class table
CLASS_AXES = ("pp", "tp", "cp", "ep")


def class_ranks(topo) -> list[int]:
    """One rank per class (stage × tp × cp × expert index) of ``topo``, at each of the DP indices
    ``0 … ep − 1`` and ``dp − ep … dp − 1`` (the first and the last EP group; ep = 1: the first and the
    last replica), sorted."""
    dps = sorted(set(range(topo.ep)) | set(range(topo.dp - topo.ep, topo.dp)))
    return sorted(
        topo.rank(dp=d, pp=p, tp=t, cp=c)
        for d in dps
        for p in range(topo.pp)
        for t in range(topo.tp)
        for c in range(topo.cp)
    )


def rank_class(topo, rank: int) -> dict[str, Any]:
    """``rank``'s class (:data:`CLASS_AXES`) and whether it is of the first or the last DP replica."""
    c = topo.coords(rank)
    replica = "first" if c.dp == 0 else "last" if c.dp == topo.dp - 1 else f"dp {c.dp}"
    return {"pp": c.pp, "tp": c.tp, "cp": c.cp, "ep": topo.ep_index(rank), "replica": replica}


def _forked_rank(rc, rank: int, world: int, run_dir: str) -> dict:
    from .dryrun import run_rank

    os.environ["OMP_NUM_THREADS"] = "1"
    return run_rank(rc, rank, world, run_dir)


def run_forked(
    rc, ranks: list[int], world: int, run_dir: str, jobs: int = 2, timeout_s: float = 600
) -> dict[int, dict]:
    """Dry-run each of ``ranks`` in a process forked from this warmed one (a new fork per rank, ``jobs`` at
    a time); return their results. Falls back to fresh interpreters (:func:`.dryrun.run_ranks`) where this
    process cannot fork or already joined a process group (the fork would inherit it)."""
    import torch._dynamo  # noqa: F401 (a dispatch mode's first op imports it: once, here)
    import torch.distributed as dist

    from parallel import comm, dryrun, engine  # noqa: F401 (imported once, here: what every fork reuses)

    from . import dryrun as tool

    if "fork" not in multiprocessing.get_all_start_methods() or (dist.is_available() and dist.is_initialized()):
        return tool.run_ranks(rc, ranks, world, run_dir, jobs=jobs, timeout_s=timeout_s)
    results: dict[int, dict] = {}
    with multiprocessing.get_context("fork").Pool(max(1, jobs), maxtasksperchild=1) as pool:
        pending = {r: pool.apply_async(_forked_rank, (rc, r, world, run_dir)) for r in ranks}
        for r, job in pending.items():
            try:
                results[r] = job.get(timeout_s)
            except multiprocessing.TimeoutError:
                raise RuntimeError(f"dry run of rank {r} took over {timeout_s:.0f} s") from None
            except Exception as e:
                raise RuntimeError(f"dry run of rank {r} failed: {type(e).__name__}: {e}") from None
    return results


def class_table(topo, results: dict[int, dict], comparisons: dict[int, dict | None]) -> list[str]:
    """One line per recorded rank: its class, peak memory beside the plan and bytes per group beside it."""
    gib = 2**30
    lines = [
        f"  {'rank':>6} {'pp':>3} {'tp':>3} {'cp':>3} {'ep':>3} {'replica':>7} {'peak GiB':>9} {'plan':>7} "
        f"{'ratio':>6}  bytes vs plan"
    ]
    for r in sorted(results):
        k, res, cmp = rank_class(topo, r), results[r], comparisons.get(r)
        peak = res["memory"]["total"]
        plan_peak = cmp["memory"]["plan"]["total"] if cmp else float("nan")
        if cmp:
            sent, planned = cmp["bytes"]["dryrun"], cmp["bytes"]["plan"]
            off = [g for g in sent if round(sent[g]) != round(planned.get(g, 0.0))]
            bytes_cell = "every group =" if not off else "≠ on " + ", ".join(sorted(off))
        else:
            bytes_cell = "(no plan)"
        lines.append(
            f"  {r:>6} {k['pp']:>3} {k['tp']:>3} {k['cp']:>3} {k['ep']:>3} {k['replica']:>7} {peak / gib:>9.2f} "
            f"{plan_peak / gib:>7.2f} {peak / plan_peak if plan_peak else float('nan'):>6.3f}  {bytes_cell}"
        )
    return lines
