"""Predicted against measured step time on this machine: ``python -m benchmarks --only plan``.

Calibrates this machine once (``mode=calibrate``, written to ``<out>/calibrated/hardware.json``),
then trains a small GPT in each of :data:`LAYOUTS` (dp, tp, pp, ZeRO stages, accumulation) with the
recipe's own launcher and ``plan.hardware=<that file>``; the trainer's first-step report prints the
planner's step time beside the measured one (:func:`recipes.reports.time_report`), which this collects.

The measured time in ``plan.md`` / ``plan.json`` is the median over steps 3–8 of rank 0's wall time per
step *less the time its main thread waited, runnable, for a CPU* (``runqueue_s`` in ``metrics.jsonl``,
:func:`recipes.reports.runqueue_seconds`): all ranks are one-thread CPU processes, and on a machine
shared with other work (2 ranks on 2 cores beside other jobs) the wall time measures the load, not the
layout; the calibration's single-process timings are medians of short repeats, which the load barely
touches. Waits for the other ranks (the pipeline bubble, collectives) stay in. The wall time and the
load average during each layout are reported beside it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = ["model.d_model=128", "model.seq_len=64", "train.precision=fp32", "train.threads=1"]
TRAIN = [
    "train.max_steps=8",
    "train.eval_every=0",
    "train.log_every=1",
    "logger.progress=false",
    "data.embedded_mb=0.25",
]
#: (name, overrides): ≥ 6 layouts of the same model and global batch
LAYOUTS = [
    ("single, accumulation 4", ["train.global_batch=8", "train.micro_batch=2"]),
    ("dp=2 ZeRO-0", ["parallel.dp=2", "train.global_batch=8", "train.micro_batch=4"]),
    (
        "dp=2 ZeRO-1, accumulation 2",
        ["parallel.dp=2", "parallel.zero=1", "train.global_batch=8", "train.micro_batch=2"],
    ),
    ("dp=2 ZeRO-3", ["parallel.dp=2", "parallel.zero=3", "train.global_batch=8", "train.micro_batch=4"]),
    ("tp=2", ["parallel.tp=2", "train.global_batch=8", "train.micro_batch=4"]),
    ("pp=2 1F1B, 4 micro-batches", ["parallel.pp=2", "train.global_batch=8", "train.micro_batch=2"]),
]
LINE = re.compile(r"step time: predicted ([0-9.]+) s, measured ([0-9.]+) s")
TOKENS = 8 * 64  # global batch × sequence of every layout


def _recipe(args: list[str], out: Path, timeout: int = 600) -> str:
    cmd = [sys.executable, "-m", "recipes.gpt_tiny", *MODEL, *args, f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (out / "output.txt").write_text(done.stdout + done.stderr)  # the reports, beside metrics.jsonl
    return done.stdout + done.stderr


def run(out: Path) -> list[dict]:
    """Calibrate, train every layout, return predicted/measured per layout."""
    cal = out / "calibrated"
    _recipe(["mode=calibrate", "plan.world_size=2", "train.micro_batch=2"], cal)
    hw = cal / "hardware.json"
    rows = []
    for name, args in LAYOUTS:
        text = _recipe([*TRAIN, *args, f"plan.hardware={hw}"], out / re.sub(r"\W+", "_", name))
        m = LINE.search(text)
        if m is None:
            raise RuntimeError(f"{name}: no step-time report in the output:\n{text[-2000:]}")
        predicted, first = float(m.group(1)), float(m.group(2))
        steps = [json.loads(line) for line in (out / re.sub(r"\W+", "_", name) / "metrics.jsonl").open()]
        steady = [r for r in steps if r.get("step", 0) > 2 and "tokens_per_s" in r]  # past warm-up
        wall = statistics.median(TOKENS / r["tokens_per_s"] for r in steady) if steady else first
        cpu_wait = [TOKENS / r["tokens_per_s"] - r.get("runqueue_s", 0.0) for r in steady]
        measured = statistics.median(cpu_wait) if cpu_wait else wall
        rows.append(
            dict(
                layout=name,
                predicted_s=predicted,
                measured_s=measured,
                wall_s=wall,
                report_step_s=first,
                ratio=predicted / measured,
                load=round(os.getloadavg()[0], 2),
            )
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| layout | predicted s | measured s (wall − CPU wait) | wall s | predicted / measured | load (1 min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['layout']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['wall_s']:.3f} | {r['ratio']:.2f} "
        f"| {r['load']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(out: str | Path = "benchmarks/results") -> list[dict]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(out / "plan_runs")
    (out / "plan.json").write_text(json.dumps(rows, indent=1))
    (out / "plan.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main(*sys.argv[1:])
