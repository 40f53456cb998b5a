"""The fault drills as real jobs (the self-spawning launcher, gloo): does each end, and is the culprit named?

    python -m benchmarks.drills                          # dp2·pp2·tp2, 8 ranks, the five drills
    python -m benchmarks.drills --dp 1 --pp 2 --tp 1 --rank 0 --hang-s 10
    python -m benchmarks.drills --doc docs/debugging.md  # also write the outputs into the page

Each drill (``train.fault``, :mod:`recipes.training.drills`) runs a 2-layer d_model 32 GPT with
``parallel.hang_s`` set, in its own session; per drill the table says how long the job took, and how
long after the fault's step began it ended (the goal: within ``hang_s`` + 30 s; the straggler's job
just finishes), the launcher's last line, whether ``python -m recipes.diagnose``
(or, for the straggler, ``metrics.jsonl``; for ``oom``, the rank's memory table) names the guilty
rank and the call, and whether any
process of the session is left behind. ``--doc`` replaces each ``<!-- drill:<kind> -->`` …
``<!-- /drill -->`` block of the page with the drill's real output (the launcher's line, diagnose's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recipes.tools import docblocks
from recipes.tools.docblocks import Marks

ROOT = Path(__file__).resolve().parents[1]
#: the drills a run makes unless ``--only`` names others (``oom`` runs alone: ``--only oom``)
KINDS = ("skip_allreduce", "allreduce_size", "straggle", "hang_send", "die_in_comm")


def _overrides(run_dir: str, layout: dict, fault: str, hang_s: float, steps: int) -> list[str]:
    keys = {
        "parallel.dp": layout["dp"],
        "parallel.pp": layout["pp"],
        "parallel.tp": layout["tp"],
        "parallel.hang_s": hang_s,
        "model.n_layers": 2 * layout["pp"],
        "model.d_model": 32,
        "model.n_heads": 2,
        "model.n_kv_heads": 2,
        "model.seq_len": 16,
        "train.global_batch": 4 * layout["dp"],
        "train.micro_batch": 2,
        "train.max_steps": steps,
        "train.eval_every": 0,
        "train.threads": 1,
        "train.log_every": 1,
        "train.sigterm_grace_s": 10,
        "train.fault": fault,
        "logger.progress": "false",
        "logger.peak_tflops": 1.0,
        "data.embedded_mb": 0.25,
        "parallel.oversubscribe": "true",
        "hydra.run.dir": run_dir,
    }
    return [f"{k}={v}" for k, v in keys.items()]


def _left_behind(sid: int) -> list[int]:
    """Processes of session ``sid`` still alive (not zombies)."""
    from parallel.testing import procs_with

    return procs_with(3, sid, zombies=False)


def expected(kind: str, rank: int) -> str:
    """A regular expression for the line that names the culprit and its call."""
    return {
        "skip_allreduce": rf"^group world: ranks \[{rank}\] never issued collective #\d+ \(all_reduce",
        "allreduce_size": rf"^group world: ranks \[{rank}\] differ at collective #\d+: all_reduce\(0 ",
        "hang_send": rf"^p2p {rank} → \d+: rank {rank} is inside send #\d+ ",
        # killed: no dump of its own (peers that lose it may abort in gloo's C++ too); the launcher names it
        "die_in_comm": rf"^no dump from ranks \[(\d+, )*{rank}(, \d+)*\]",
        "straggle": rf"^metrics.jsonl: slowest_rank {rank} ",
        "oom": rf"^rank {rank} ran out of memory in step 2; its memory by kind",
    }[kind]


def run_drill(kind: str, rank: int, layout: dict, hang_s: float, folder: Path) -> dict:
    run_dir = folder / kind
    step = 3 if kind == "straggle" else 2
    args = [
        sys.executable,
        "-m",
        "recipes.gpt_tiny",
        *_overrides(str(run_dir), layout, f"{kind}@{rank}:{step}", hang_s, 4),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    out, err = proc.communicate(timeout=hang_s + 600)
    took, ended = time.perf_counter() - t0, time.time()
    # the fault's step began when the step before it was logged: from there to the job's end
    metrics = run_dir / "metrics.jsonl"
    after = ended - metrics.stat().st_mtime if metrics.exists() else took
    time.sleep(1.0)
    left = _left_behind(proc.pid)
    last = (err.strip().splitlines() or [""])[-1]
    if kind == "straggle":
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        row = next((r for r in rows if r["step"] == step), {})
        lines = [
            f"metrics.jsonl: slowest_rank {row.get('slowest_rank')} at step {step}, lag {row.get('slowest_lag', 0):+.0%}"
        ]
        shown = [line for line in out.splitlines() if line.startswith(f"step {step}:")]
    elif kind == "oom":  # the rank's table on stderr, then the usual end
        err_lines = err.splitlines()
        first = next((i for i, line in enumerate(err_lines) if "ran out of memory in step" in line), len(err_lines))
        lines = err_lines[first : first + 9]
        lines = lines[: next((i + 1 for i, line in enumerate(lines) if "memory snapshot" in line), len(lines))]
        shown = []
    else:
        done = subprocess.run(
            [sys.executable, "-m", "recipes.diagnose", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        lines, shown = done.stdout.strip().splitlines(), []
    named = any(re.search(expected(kind, rank), line) for line in lines)
    if kind == "die_in_comm":
        named = named and bool(re.search(rf"^error: rank {rank} \(pid \d+\) was killed by SIGKILL", last))
    watchdog = [line for line in err.splitlines() if line.startswith("watchdog: ")]
    return {
        "kind": kind,
        "rank": rank,
        "exit": proc.returncode,
        "seconds": took,
        "after_fault_s": after,
        "within": proc.returncode == (0 if kind == "straggle" else 1)
        if kind in ("straggle", "oom")
        else after <= hang_s + 30,
        "named": named,
        "left_behind": left,
        "launcher": last,
        "watchdog": watchdog[:2],
        "diagnose": lines,
        "progress": shown,
    }


def marks(kind: str) -> Marks:
    """The marker lines of drill ``kind``'s block on a page."""
    return Marks(f"<!-- drill:{kind} -->", "<!-- /drill -->")


def write_doc(page: Path, results: list[dict], command: str) -> None:
    """Replace each ``<!-- drill:<kind> -->`` block of ``page`` with that drill's output (ValueError, the page
    untouched, when one of ``results``' kinds is not marked on it)."""
    text = page.read_text()
    for r in results:
        body = [f"$ {command}  # train.fault={r['kind']}@{r['rank']}:…", *r["watchdog"], *r["progress"]]
        if r["kind"] == "oom":
            body += [*r["diagnose"], "…", r["launcher"]]
        elif r["kind"] != "straggle":
            body += [r["launcher"], "", "$ python -m recipes.diagnose <run dir>", *r["diagnose"]]
        else:
            body += r["diagnose"]
        text = docblocks.replace(text, marks(r["kind"]), "```text\n" + "\n".join(body) + "\n```")
    page.write_text(text)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.drills", description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=None, help="the guilty rank (default: the world's last stage-0 rank)")
    ap.add_argument("--hang-s", type=float, default=20.0)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--doc", type=Path, default=None)
    a = ap.parse_args(argv)
    layout = {"dp": a.dp, "pp": a.pp, "tp": a.tp}
    first_stage_last = a.dp * a.tp - 1  # a stage-0 rank: it sends activations (hang_send)
    rank = a.rank if a.rank is not None else first_stage_last
    kinds = a.only or list(KINDS)
    if a.doc:  # an unmarked block fails now, not after minutes of drills
        page = a.doc.read_text()
        for kind in kinds:
            docblocks.find(page, marks(kind))
    results = []
    with tempfile.TemporaryDirectory() as d:
        for kind in kinds:
            r = run_drill(kind, rank, layout, a.hang_s, Path(d))
            results.append(r)
            print(
                f"{kind:<15} rank {rank}: exit {r['exit']:>3}  {r['seconds']:6.1f} s, {r['after_fault_s']:5.1f} s after the fault "
                f"({'within' if r['within'] else 'OVER'} hang_s + 30)  named: {'yes' if r['named'] else 'NO'}  "
                f"left behind: {len(r['left_behind'])}",
                flush=True,
            )
    ok = sum(r["named"] and r["within"] and not r["left_behind"] for r in results)
    print(
        f"{ok}/{len(results)} drills ended in time, named the culprit and left no process (dp{a.dp}·pp{a.pp}·tp{a.tp})"
    )
    if a.doc:
        cmd = f"python -m recipes.gpt_tiny parallel.dp={a.dp} parallel.pp={a.pp} parallel.tp={a.tp} parallel.hang_s={a.hang_s:g} …"
        write_doc(a.doc, results, cmd)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
