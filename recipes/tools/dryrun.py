"""``mode=dryrun``: one real training step of chosen ranks of any layout, on no hardware.

``python -m recipes.gpt175b mode=dryrun [dryrun.ranks=[0,8704,17919] | dryrun.ranks=classes] [dryrun.peers=true]``

Each chosen rank runs in a process of its own (a clean default process group), ``dryrun.jobs``
at a time, forked from this one after it has imported torch and the trainer
(:func:`.dryrun_classes.run_forked`; fresh interpreters, :func:`run_ranks`, where it cannot
fork). The process joins torch's ``fake`` process group as that rank of the real
world size and runs the **real** :class:`~recipes.training.trainer.Trainer`: config validation,
creation of its process groups, its model chunks, ZeRO buckets, the pipeline executor,
a warm-up training step (it allocates the optimizer state), one measured training step
(every micro-batch's forward and backward, the DP reduction, the optimizer step, and the
loss reduction of a logged step: its collectives, without the host read), the
validation forward of one batch (each of ``train.eval_batches`` issues the same calls), and
the assembly of its checkpoint pieces (``Trainer.state_dict()``).
Tensors live on the ``meta`` device: shapes, dtypes and every collective's size are
real, no byte is allocated and no value exists (so the step must read none: issue 12 §2).

The data are synthetic token batches of the configured shape (the real data path reads
files the dry-run machine need not have). Per rank it prints, beside the planner's
prediction for that rank's stage: the peak of the measured step split into parameters,
gradients, optimizer state, other buffers, activations and temporaries
(:class:`parallel.dryrun.LiveMemory`); every collective and p2p per group (calls and
bytes sent, :class:`parallel.comm.CommCounter`); the check that every tensor handed to
a collective lives on the rank's device (:class:`parallel.comm.CallRecorder`); and the
``new_group`` calls it made. ``dryrun.peers=true`` adds each rank's TP, DP and PP
neighbours and checks that the members of each group issue the same collectives and
that sends and receives pair up (:func:`parallel.comm.compare_sequences`). Everything
is written to ``<run dir>/dryrun.json``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from parallel.dims import local_seq_len

from ..config import RecipeConfig, bad
from ..training.trainer import Trainer
from ..validation import validate
from . import dryrun_classes as classes

ROOT = Path(__file__).resolve().parents[2]  # the repository
MEMORY_KEYS = ("params", "grads", "optimizer", "buffers", "activations", "temporaries")


class SyntheticTokens:
    """Token batches of the right shape and no content (all zeros): the dry run's data."""

    def __init__(self, vocab_size: int, seq_len: int):
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def rank_microbatches(
        self,
        step: int,
        *,
        global_batch: int,
        dp: int,
        dp_rank: int,
        micro_batch: int,
        seed: int,
        cp: int = 1,
        cp_rank=0,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = global_batch // dp // micro_batch
        return [(torch.zeros(micro_batch, local_seq_len(self.seq_len, cp), dtype=torch.long),) * 2 for _ in range(n)]


class DryRunTrainer(Trainer):
    """The trainer with synthetic data; everything else is the real one."""

    def open_data(self, split: str) -> SyntheticTokens:
        return SyntheticTokens(self.model_cfg.vocab_size, self.model_cfg.seq_len)


def default_ranks(world: int, pp: int, dp: int, tp: int) -> list[int]:
    """The first rank, the first rank of the middle pipeline stage, the last rank."""
    middle = (pp // 2) * dp * tp
    return sorted({0, middle, world - 1})


def peer_ranks(topology, rank: int) -> list[int]:
    """``rank``'s neighbours along TP, DP and PP (the next one on each axis, and the previous stage)."""
    c = topology.coords(rank)
    out = []
    for axis in ("tp", "dp", "pp"):
        size = topology.size(axis)
        if size > 1:
            at = {"dp": c.dp, "pp": c.pp, "tp": c.tp}
            out.append(topology.rank(**{**at, axis: (at[axis] + 1) % size}))
            if axis == "pp":
                out.append(topology.rank(**{**at, axis: (at[axis] - 1) % size}))
    return out


# --------------------------------------------------------------------- one rank (its own process)
def run_rank(rc: RecipeConfig, rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Dry-run ``rank`` of ``world`` in this process; return what it measured (JSON-able)."""
    import torch.distributed as dist

    from parallel import comm
    from parallel.dryrun import FlashAttentionOnMeta, LiveMemory, init_fake_world
    from parallel.engine import reduce_stats

    t0 = time.perf_counter()
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    rc.train.threads = rc.train.threads or 1  # meta tensors compute nothing: one thread per rank
    rc.train.eval_batches = 1  # the validation forward's calls and devices, once (the rest repeat them)
    init_fake_world(rank, world)
    device = torch.device("meta")
    real_new_group, new_groups = dist.new_group, []

    def counted_new_group(*args, **kwargs):
        new_groups.append(kwargs.get("group_desc"))
        return real_new_group(*args, **kwargs)

    dist.new_group = counted_new_group
    with LiveMemory(device) as mem, FlashAttentionOnMeta():  # the GPU's attention kernel (parallel/dryrun.py)
        try:
            trainer = DryRunTrainer(rc, run_dir)
        finally:
            dist.new_group = real_new_group
        t_build = time.perf_counter()
        trainer.train_step(0, read=False)  # warm-up: the optimizer state appears at its end
        t_warm = time.perf_counter()
        mem.new_window()
        counter, recorder = comm.CommCounter(), comm.CallRecorder()
        with counter, recorder:  # the step the planner prices: with its loss reduction (a read's collectives,
            # without the host read: meta tensors hold no values); an unread step sends 4 bytes less over
            # DP (all-reduce) and over PP (broadcast): parallel.engine.PendingLoss
            reduce_stats(trainer.train_step(1, read=False, norm=True))  # a logged step's norm, clipping or not
        t_step = time.perf_counter()
        held = trainer.engine.zero.held_bytes()
        peak, at_peak = mem.peak, dict(mem.at_peak)
        val_counter, val_recorder = comm.CommCounter(), comm.CallRecorder()
        with val_counter, val_recorder:
            trainer.evaluate(read=False)
        pieces = trainer.state_dict()
    model_states = held["params"] + held["grads"] + held["optimizer"]
    # ZeRO-Offload's host tensors are meta tensors too here. The optimizer state (and the host step's
    # temporaries) appear outside LiveMemory's view (parallel/zero/offload.py); the master and gradient
    # copy target it saw exist through the whole measured step: they come off the baseline and the peak
    host = held.get("host", 0)
    zero = trainer.engine.zero
    unseen = sum(
        v.nbytes for st in zero.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0
    )
    seen_host = host - unseen if host else 0
    memory = {
        "params": held["params"],
        "grads": held["grads"],
        "optimizer": held["optimizer"],
        "buffers": at_peak["baseline"] - seen_host - model_states,
        "activations": at_peak["activations"],
        "temporaries": at_peak["temporaries"],
        "total": peak - seen_host,
        "host": host,
    }
    ckpt_bytes = sum(_piece_bytes(v) for v in pieces.values())
    done = time.perf_counter()
    return {
        "rank": rank,
        "coords": {"dp": trainer.groups.coords.dp, "pp": trainer.groups.coords.pp, "tp": trainer.groups.coords.tp},
        "new_group_calls": new_groups,
        "memory": memory,
        "comm": counter.summary(),
        "calls": recorder.to_list(),
        "misplaced": recorder.misplaced() + val_recorder.misplaced(),
        "validation_comm": val_counter.summary(),
        "checkpoint": {"pieces": len(pieces), "bytes": ckpt_bytes},
        "seconds": {
            "build": t_build - t0,
            "warmup_step": t_warm - t_build,
            "step": t_step - t_warm,
            "total": done - t0,
        },
        "cpu_seconds": _cpu_seconds(),  # the process's CPU time, imports included (wall time depends on load)
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _piece_bytes(v) -> int:
    """Bytes of one checkpoint entry: a tensor, or a ``Chunked`` of this rank's pieces."""
    if torch.is_tensor(v):
        return v.numel() * v.element_size()
    return sum(t.numel() * t.element_size() for t in getattr(v, "pieces", {}).values())


def _worker_main(argv: list[str]) -> None:
    cfg_path, rank, world, run_dir, out = argv
    rc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.load(cfg_path)))
    result = run_rank(rc, int(rank), int(world), run_dir)
    Path(out).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the launcher
def run_ranks(
    rc: RecipeConfig, ranks: list[int], world: int, run_dir: str, jobs: int = 2, timeout_s: float = 600
) -> dict[int, dict]:
    """Dry-run each of ``ranks`` in its own fresh process, ``jobs`` at a time; return their results."""
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dryrun-") as tmp:
        cfg_path = Path(tmp) / "config.yaml"
        OmegaConf.save(OmegaConf.structured(rc), cfg_path)
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
        )
        pending, running = list(ranks), []
        while pending or running:
            while pending and len(running) < max(1, jobs):
                r = pending.pop(0)
                out = Path(tmp) / f"rank{r}.json"
                cmd = [sys.executable, "-m", "recipes.tools.dryrun", str(cfg_path), str(r), str(world), run_dir]
                cmd.append(str(out))
                running.append(
                    (
                        r,
                        out,
                        time.monotonic(),
                        subprocess.Popen(
                            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                        ),
                    )
                )
            for item in list(running):
                r, out, started, proc = item
                if proc.poll() is None:
                    if time.monotonic() - started > timeout_s:
                        proc.kill()
                        raise RuntimeError(f"dry run of rank {r} took over {timeout_s:.0f} s")
                    continue
                running.remove(item)
                log = proc.stdout.read()
                if proc.returncode != 0:
                    raise RuntimeError(f"dry run of rank {r} failed (exit {proc.returncode}):\n{log[-6000:]}")
                results[r] = json.loads(out.read_text())
            time.sleep(0.05)
    return results


def compare_with_plan(result: dict, plan) -> dict[str, Any]:
    """The planner's prediction for ``result``'s stage beside the dry run's figures."""
    stage = plan.ranks[result["coords"]["pp"]]
    pm = stage.memory
    planned_mem = {
        "params": pm["params"],
        "grads": pm["grads"],
        "optimizer": pm["optimizer"],
        "buffers": pm["buffers"],
        "activations": pm["activations"],
        "temporaries": pm["temporaries"],
        "total": pm["total"],
    }
    sent = {g: sum(s["sent_bytes"] for s in ops.values()) for g, ops in result["comm"].items()}
    planned_sent = {axis: t["bytes"] for axis, t in stage.traffic.items()}
    if "dpcp" in sent and "dp" not in sent:  # context parallel: the planner's DP traffic is on dp × cp
        planned_sent["dpcp"] = planned_sent.pop("dp")
    return {
        "memory": {"dryrun": result["memory"], "plan": planned_mem},
        "bytes": {"dryrun": sent, "plan": planned_sent},
    }


def format_rank(result: dict, comparison: dict | None, *, timings: bool = True) -> str:
    """The printed report of one rank (``timings=False``: without its seconds and RSS, which vary
    from run to run: what ``python -m benchmarks.docs`` writes)."""
    mib = 2**20
    c = result["coords"]
    sec = result["seconds"]
    measured = (
        f"{sec['total']:.1f} s (build {sec['build']:.1f}, steps {sec['warmup_step']:.1f} + {sec['step']:.1f}; "
        f"CPU {result['cpu_seconds']:.1f} s with imports), max RSS {result['max_rss_bytes'] / 2**30:.2f} GiB, "
    )
    lines = [
        (
            f"rank {result['rank']} (dp {c['dp']}, pp {c['pp']}, tp {c['tp']}): {measured if timings else ''}"
            f"{len(result['new_group_calls'])} new_group calls ({', '.join(result['new_group_calls'])})"
        )
    ]
    plan_mem = comparison["memory"]["plan"] if comparison else {}
    lines.append(f"  {'memory (MiB)':<14}" + "".join(f"{k:>13}" for k in (*MEMORY_KEYS, "peak")))
    lines.append(f"  {'dry run':<14}" + "".join(f"{result['memory'][k] / mib:>13.1f}" for k in (*MEMORY_KEYS, "total")))
    if plan_mem:
        lines.append(f"  {'planner':<14}" + "".join(f"{plan_mem[k] / mib:>13.1f}" for k in (*MEMORY_KEYS, "total")))
        ratio = result["memory"]["total"] / plan_mem["total"] if plan_mem["total"] else float("nan")
        lines.append(f"  peak dry run / planner: {ratio:.3f}")
    lines.append(f"  {'group':<10}{'sent bytes':>16}{'planner':>16}  calls")
    planned = comparison["bytes"]["plan"] if comparison else {}
    for group, ops in sorted(result["comm"].items()):
        sent = sum(s["sent_bytes"] for s in ops.values())
        plan = planned.get(group)
        mark = "" if plan is None else ("  =" if round(sent) == round(plan) else "  ≠")
        calls = ", ".join(f"{s['calls']} {op}" for op, s in sorted(ops.items()) if s["calls"])
        plan_cell = f"{plan:>16,.0f}" if plan is not None else f"{'-':>16}"
        lines.append(f"  {group:<10}{sent:>16,.0f}{plan_cell}{mark}  {calls}")
    bad = result["misplaced"]
    lines.append(
        f"  device check: {'every collective tensor on ' + 'meta' if not bad else str(len(bad)) + ' misplaced'}"
    )
    lines.extend(f"    {m}" for m in bad[:10])
    ck = result["checkpoint"]
    lines.append(f"  checkpoint pieces: {ck['pieces']} ({ck['bytes'] / mib:.1f} MiB)")
    return "\n".join(lines)


def _chosen_ranks(rc: RecipeConfig, world: int, topo) -> list[int]:
    """``dryrun.ranks`` as given (checked against the world), or :func:`default_ranks`."""
    given = rc.dryrun.ranks
    if given is None:
        return default_ranks(world, topo.pp, topo.dp, topo.tp)
    if isinstance(given, str) or not all(isinstance(r, int) and not isinstance(r, bool) for r in given):
        raise bad("dryrun.ranks", given, "is neither a list of ranks nor 'classes'", "name ranks, or classes")
    for r in given:
        if not 0 <= r < world:
            raise bad(
                "dryrun.ranks", list(given), f"rank {r} is outside the world [0, {world})", f"name ranks 0..{world - 1}"
            )
    return list(given)


def run_dryrun(rc: RecipeConfig, run_dir: str) -> dict[str, Any]:
    """``mode=dryrun``: dry-run the configured ranks (and peers); print and write ``dryrun.json``."""
    from parallel.comm import Call, compare_sequences
    from parallel.topology import Topology

    from .plan import plan_from_config

    if rc.train.compile:  # refused before any rank starts: torch.compile's own error names no key
        why = "the ranks run on meta tensors under the dispatch mode measuring their memory, which torch.compile cannot trace"
        raise bad(
            "train.compile", "true", why, "drop it for the dry run (eager figures); mode=plan prices train.compile"
        )
    rc.data.source, rc.data.path = "embedded", None  # the ranks read synthetic batches (SyntheticTokens)
    if rc.data.packing == "documents":  # synthetic windows have no documents; the collectives are the same
        print(
            "(data.packing=documents: the dry run reads synthetic windows without document masks; its figures "
            "leave out the mask: b·s² bytes per micro-batch with SDPA, about 16 KB per sample at s = 4,096 with flex on CUDA)"
        )
        rc.data.packing = "concat"
    layout = validate(rc, world_size=None)
    world = layout.world_size
    topo = Topology(
        layout.dp, rc.parallel.pp, rc.parallel.tp, rc.parallel.cp, ep=rc.parallel.ep, order=rc.parallel.order
    )
    by_class = rc.dryrun.ranks == "classes"
    ranks = classes.class_ranks(topo) if by_class else _chosen_ranks(rc, world, topo)
    if rc.dryrun.peers and not by_class:
        ranks = sorted(set(ranks) | {p for r in ranks for p in peer_ranks(topo, r)})
    t0 = time.perf_counter()
    results = classes.run_forked(rc, ranks, world, run_dir, jobs=rc.dryrun.jobs)
    try:
        plan = plan_from_config(rc)
    except (ValueError, KeyError) as e:  # the planner refuses some layouts the trainer runs: say so
        print(f"(no planner figures: {e})")
        plan = None
    report: dict[str, Any] = {"world_size": world, "ranks": {}, "seconds": time.perf_counter() - t0}
    comparisons = {r: compare_with_plan(results[r], plan) if plan else None for r in ranks}
    for r in ranks:
        if not by_class:
            print(format_rank(results[r], comparisons[r]))
        report["ranks"][r] = {**results[r], "plan": comparisons[r]}
    if by_class:
        print(f"{len(ranks)} ranks, one per class and DP replica, in {report['seconds']:.1f} s:")
        print("\n".join(classes.class_table(topo, results, comparisons)))
    if rc.dryrun.peers or by_class:
        calls = {r: [Call(**{**c, "ranks": tuple(c["ranks"])}) for c in results[r]["calls"]] for r in ranks}
        problems = compare_sequences(calls)
        report["sequence_problems"] = problems
        print(
            f"call sequences of {len(ranks)} ranks: "
            + ("every group agrees, every send meets its receive" if not problems else f"{len(problems)} mismatches")
        )
        for p in problems[:20]:
            print(f"  {p}")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "dryrun.json").write_text(json.dumps(report, indent=1, default=str))
    misplaced = sum(len(results[r]["misplaced"]) for r in ranks)
    return {"ranks": ranks, "misplaced": misplaced, "sequence_problems": len(report.get("sequence_problems", []))}


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
