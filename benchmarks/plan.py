"""Predicted against measured step time on this machine: ``python -m benchmarks --only plan``.

Calibrates this machine once (``mode=calibrate``, written to ``<out>/calibrated/hardware.json``),
then trains a small GPT in each of :data:`LAYOUTS` (dp, tp, pp, ZeRO stages, accumulation) with the
recipe's own launcher and ``plan.hardware=<that file>``; the trainer's first-step report prints the
planner's step time beside the measured one (:func:`recipes.training.reports.time_report`), which this collects.

Each layout is measured in :data:`ROUNDS` rounds (the order reversed in every other round,
:func:`round_orders`), right after a speed probe (:func:`recipes.tools.calibrate_timing.speed_probe`);
it is predicted with the calibrated profile rescaled by the median of the last :data:`PROBE_WINDOW`
probes' factors (:meth:`parallel.plan.Hardware.time_scaled`), never from its own step. The measured
time is the median over steps 3–16 of rank 0's wall time per step less the part of its wait for a
CPU that other jobs can account for (:func:`step_seconds`). Why, and what was measured:
``docs/performance.md`` ("The plan benchmark's method").

Other jobs on the machine: before calibrating and before each layout the benchmark waits (up to
:data:`QUIET_WAIT_S`) until the machine's other processes use under :data:`QUIET_CORES` of a core
(``/proc/stat`` over half a second while this process sleeps), measures the cores other jobs used
*during* the run (the machine's busy time less this job's, ``/proc/stat`` and ``getrusage``), and runs
a layout again (up to :data:`ATTEMPTS` times) when that exceeded :data:`QUIET_CORES`, keeping the
least disturbed attempt; ``other_cores`` in the table says how disturbed it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = ["model.d_model=128", "model.seq_len=64", "train.precision=fp32", "train.threads=1"]
TRAIN = [
    "train.max_steps=16",
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
#: waiting for a quiet machine: at most this long, for other processes under this many cores
QUIET_WAIT_S, QUIET_CORES, ATTEMPTS = 90.0, 0.3, 3
LINE = re.compile(r"step time(?: \([a-z ]+\))?: predicted ([0-9.]+) s, measured ([0-9.]+) s")
TOKENS = 8 * 64  # global batch × sequence of every layout


def _busy_s() -> float | None:
    """CPU seconds every core of the machine has been busy since boot (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _our_cpu_s() -> float:
    """CPU seconds this process and its finished children used (``getrusage``): this job's own."""
    return sum(
        r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def wait_for_quiet(max_s: float = QUIET_WAIT_S, cores: float = QUIET_CORES) -> float:
    """Sleep until other processes use under ``cores`` cores over half a second (this one sleeps
    meanwhile) or ``max_s`` passed; returns the last sample's cores (0 where ``/proc/stat`` is absent)."""
    deadline = time.monotonic() + max_s
    while True:
        b0, t0 = _busy_s(), time.monotonic()
        time.sleep(0.5)
        b1 = _busy_s()
        used = 0.0 if b0 is None or b1 is None else (b1 - b0) / (time.monotonic() - t0)
        if used < cores or time.monotonic() > deadline:
            return used


def _disturbance(fn):
    """``(fn(), cores other processes used meanwhile)``, after waiting for a quiet machine: the
    machine's busy CPU time (``/proc/stat``) less this job's own and its children's (``getrusage``: an
    in-process speed probe, a recipe's ranks) over the wall time."""
    wait_for_quiet()
    busy0, ours0, t0 = _busy_s(), _our_cpu_s(), time.monotonic()
    result = fn()
    elapsed, busy1 = time.monotonic() - t0, _busy_s()
    other = 0.0 if busy0 is None or busy1 is None else (busy1 - busy0 - (_our_cpu_s() - ours0)) / elapsed
    return result, round(max(0.0, other), 2)


def least_disturbed(fn, attempts: int = ATTEMPTS, disturbance=None) -> tuple[object, float]:
    """``(fn(), other jobs' cores meanwhile)`` (:func:`_disturbance`), taken again while other jobs used
    more than :data:`QUIET_CORES`, at most ``attempts`` times: the first quiet one, else the least
    disturbed."""
    measure = disturbance or _disturbance
    taken = []
    for _ in range(max(1, attempts)):
        taken.append(measure(fn))
        if taken[-1][1] <= QUIET_CORES:
            break
    return min(taken, key=lambda t: t[1])


def _recipe(args: list[str], out: Path, timeout: int = 600) -> str:
    cmd = [sys.executable, "-m", "recipes.gpt_tiny", *MODEL, *args, f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (out / "output.txt").write_text(done.stdout + done.stderr)  # the reports, beside metrics.jsonl
    return done.stdout + done.stderr


#: the calibration's own arguments (its model, two ranks, its micro-batch; the speed probe uses the same)
CALIBRATE = ["mode=calibrate", "plan.world_size=2", "train.micro_batch=2"]
#: every layout is measured in this many rounds, the layout order reversed in every other round
ROUNDS = 2
#: a layout is predicted at the median of the last this many speed probes (its own included), taken
#: before it: the probe moves ±5 % within seconds on a quiet machine (three 1 s probes in a row:
#: 2.91–3.20 ms), faster than a layout's run, and one probe once read 1.6× during a transient
PROBE_WINDOW = 5


def _config(overrides: list[str]):
    """The recipe's config (``gpt_tiny`` with the benchmark's model and ``overrides``), as it composes it."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from recipes.main import register

    register()
    with initialize_config_module("recipes.conf", version_base="1.3"):
        return OmegaConf.to_object(compose("gpt_tiny", overrides=[*MODEL, *overrides]))


def _calibrate(out: Path) -> tuple[Path, float, dict]:
    """Calibrate (again when other jobs disturbed it, up to :data:`ATTEMPTS` times, keeping the least
    disturbed); (its ``hardware.json``, the other jobs' cores meanwhile, its speed probe)."""
    calibrations = []
    for attempt in range(ATTEMPTS):
        cal = out / ("calibrated" + (f"_{attempt}" if attempt else ""))
        other = _disturbance(lambda c=cal: _recipe(CALIBRATE, c))[1]
        calibrations.append((other, str(cal)))
        if other <= QUIET_CORES:
            break
    other, cal = min(calibrations)
    probe = json.loads((Path(cal) / "calibration.json").read_text())["probe"]
    return Path(cal) / "hardware.json", other, probe


def round_orders(n: int, rounds: int = ROUNDS) -> list[list[int]]:
    """The layouts' order in each round: as listed, then reversed, alternating (a drift of the
    machine's speed during a run then weighs on every layout alike over two rounds)."""
    return [list(range(n)) if r % 2 == 0 else list(range(n))[::-1] for r in range(rounds)]


def combine(name: str, measurements: list[dict]) -> dict:
    """One layout's row from its rounds: the rounds' mean predicted (rescaled by each round's probe)
    over their mean measured (``ratio``), and the same with the calibration's profile as written
    (``raw_ratio``); each round's figures under ``rounds``."""
    mean = lambda key: statistics.mean(r[key] for r in measurements)  # noqa: E731
    predicted, raw, measured = mean("predicted_s"), mean("raw_predicted_s"), mean("measured_s")
    return dict(
        layout=name,
        predicted_s=predicted,
        raw_predicted_s=raw,
        measured_s=measured,
        wall_s=mean("wall_s"),
        less_all_cpu_wait_s=mean("less_all_cpu_wait_s"),
        ratio=predicted / measured,
        raw_ratio=raw / measured,
        speed_factor=mean("speed_factor"),
        load=max(r["load"] for r in measurements),
        other_cores=max(r["other_cores"] for r in measurements),
        rounds=measurements,
    )


def run(out: Path, rounds: int = ROUNDS) -> list[dict]:
    """Calibrate, then train every layout in ``rounds`` rounds (:func:`round_orders`), each right after
    a speed probe (:func:`recipes.tools.calibrate_timing.speed_probe`); the calibrated profile is rescaled
    (:meth:`parallel.plan.Hardware.time_scaled`) by the median factor of the last
    :data:`PROBE_WINDOW` probes, all taken before the layout; return one row per layout (:func:`combine`)."""
    import torch

    from parallel.plan import hardware_profile
    from recipes.tools.calibrate_timing import probe_factor, speed_probe

    hw, cal_other, cal_probe = _calibrate(out)
    profile = hardware_profile(str(hw))
    probe_rc = _config([a for a in CALIBRATE if not a.startswith(("mode=", "plan."))])
    torch.set_num_threads(probe_rc.train.threads or 1)  # as the calibration's probe ran
    measured: dict[int, list[dict]] = {i: [] for i in range(len(LAYOUTS))}
    probes: list[float] = []
    for r, order in enumerate(round_orders(len(LAYOUTS), rounds)):
        for i in order:
            name, args = LAYOUTS[i]
            attempts = []
            for attempt in range(ATTEMPTS):  # again when other jobs disturbed it
                probe, probe_other = least_disturbed(lambda: probe_factor(cal_probe, speed_probe(probe_rc)))
                probes.append(probe)
                factor = statistics.median(probes[-PROBE_WINDOW:])
                scaled = out / f"hardware_round{r}_{i}_{attempt}.json"
                fields = {k: v for k, v in dataclasses.asdict(profile.time_scaled(factor)).items() if k != "name"}
                scaled.write_text(json.dumps(fields, indent=1))
                row = _layout(name, args, scaled, out, f"_r{r}" + (f"_{attempt}" if attempt else ""))
                attempts.append(
                    {
                        **row,
                        "speed_factor": factor,
                        "probe": probes[-1],
                        "probe_other_cores": probe_other,
                        "raw_predicted_s": row["predicted_s"] / factor,
                    }
                )
                if attempts[-1]["other_cores"] <= QUIET_CORES:
                    break
            measured[i].append({**min(attempts, key=lambda a: a["other_cores"]), "round": r})
    return [
        {**combine(name, measured[i]), "calibration_other_cores": cal_other, "hardware": str(hw)}
        for i, (name, _) in enumerate(LAYOUTS)
    ]


def step_seconds(wall_s: float, runqueue_s: float, other_cores: float) -> float:
    """A step's time: its wall time less the part of rank 0's wait for a CPU (``runqueue_s``) that
    other jobs can account for. They used ``other_cores`` cores on average during the run, so at most
    ``other_cores × wall_s`` of the step's wait was for them; the rest was for this layout's own
    threads on the same cores (the other rank, gloo's transport threads running the collectives
    launched ahead), which is part of the step (ZeRO-3 on 2 cores: ≈ 11 ms of a 55 ms step while
    other jobs used 0.02 cores, ≤ 1.1 ms)."""
    return wall_s - min(runqueue_s, max(0.0, other_cores) * wall_s)


def _layout(name: str, args: list[str], hw: Path, out: Path, suffix: str = "") -> dict:
    """Train one layout with the profile ``hw`` (the caller waited for a quiet machine); its predicted
    and measured step time."""
    run_dir = out / (re.sub(r"\W+", "_", name) + suffix)
    text, other = _disturbance(lambda: _recipe([*TRAIN, *args, f"plan.hardware={hw}"], run_dir))
    m = LINE.search(text)
    if m is None:
        raise RuntimeError(f"{name}: no step-time report in the output:\n{text[-2000:]}")
    predicted, first = float(m.group(1)), float(m.group(2))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steady = [r for r in steps if r.get("step", 0) > 2 and "tokens_per_s" in r]  # past warm-up
    wall = statistics.median(TOKENS / r["tokens_per_s"] for r in steady) if steady else first
    less_all_wait = [TOKENS / r["tokens_per_s"] - r.get("runqueue_s", 0.0) for r in steady]
    less_others = [step_seconds(TOKENS / r["tokens_per_s"], r.get("runqueue_s", 0.0), other) for r in steady]
    return dict(
        layout=name,
        predicted_s=predicted,
        measured_s=statistics.median(less_others) if less_others else wall,
        less_all_cpu_wait_s=statistics.median(less_all_wait) if less_all_wait else wall,
        wall_s=wall,
        report_step_s=first,
        load=round(os.getloadavg()[0], 2),
        other_cores=other,
    )


def markdown(rows: list[dict]) -> str:
    """The table: per layout the rounds' mean predicted (rescaled to the probe) and measured step, their
    ratio, each round's ratio, the ratio with the calibration's profile as written, the probe's factor."""
    lines = [
        "| layout | predicted s | measured s | wall s | wall − all CPU wait s | predicted / measured | per round "
        "| raw (unrescaled) | speed probe (× calibration) | load (1 min) | other jobs (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_round = " / ".join(f"{m['predicted_s'] / m['measured_s']:.2f}" for m in r.get("rounds", []))
        lines.append(
            f"| {r['layout']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['wall_s']:.3f} "
            f"| {r.get('less_all_cpu_wait_s', r['measured_s']):.3f} | {r['ratio']:.2f} "
            f"| {per_round} | {r.get('raw_ratio', r['ratio']):.2f} | {r.get('speed_factor', 1.0):.2f} "
            f"| {r['load']:.2f} | {r.get('other_cores', float('nan')):.2f} |"
        )
    return "\n".join(lines)


def main(out: str | Path = "benchmarks/results", with_breakdown: bool = False) -> list[dict]:
    """Calibrate, train every layout, write ``plan.md`` / ``plan.json``; ``with_breakdown``: also each
    layout's measured parts beside the planner's (:func:`benchmarks.plan_breakdown.breakdown`), in both files."""
    from .plan_breakdown import breakdown, format_layout_breakdown

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(out / "plan_runs")
    text = markdown(rows)
    if with_breakdown:
        hw = Path(rows[0]["hardware"])
        parts = [breakdown(name, args, hw, out / "plan_runs") for name, args in LAYOUTS]
        for row, part in zip(rows, parts):
            row["breakdown"] = part
        text += "\n\n```\n" + "\n\n".join(format_layout_breakdown(p) for p in parts)
        text += "\n```"
    (out / "plan.json").write_text(json.dumps(rows, indent=1))
    (out / "plan.md").write_text(text + "\n")
    print(text)
    print(f"calibration: {rows[0]['calibration_other_cores']:.2f} cores used by other jobs meanwhile")
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="benchmarks/results")
    ap.add_argument("--breakdown", action="store_true", help="also each layout's measured parts beside the plan's")
    ap.add_argument("--hardware", help="a calibrated hardware.json: skip calibrating and training, only break down")
    ap.add_argument("--only", help="comma-separated substrings of layout names (with --hardware)")
    a = ap.parse_args()
    if a.hardware:
        from benchmarks.plan_breakdown import breakdown, format_layout_breakdown

        for name, args in LAYOUTS:
            if a.only and not any(o in name for o in a.only.split(",")):
                continue
            p = breakdown(name, args, Path(a.hardware), Path(a.out) / "plan_runs")
            print(format_layout_breakdown(p), flush=True)
    else:
        main(a.out, a.breakdown)
