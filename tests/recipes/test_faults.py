"""Faults end the job promptly, name the rank, and a restarted job resumes by itself.

The launcher tests run real jobs (``python -m recipes.gpt_tiny``, which spawns its
workers through the elastic agent, and ``torchrun``): they are about processes.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallel import comm
from parallel.checkpoint import latest_checkpoint
from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology

from .test_train_e2e import _train, tiny_recipe

ROOT = Path(__file__).resolve().parents[2]


def small_recipe(**kw):
    """Two DP ranks of a 2-layer, d_model 32 GPT: the cheapest job that still communicates."""
    rc = tiny_recipe(dp=2, zero=1, **kw)
    rc.model.n_layers, rc.model.d_model, rc.model.n_heads, rc.model.n_kv_heads, rc.model.seq_len = 2, 32, 2, 2, 16
    rc.train.global_batch = 4
    rc.logger.peak_tflops = 1.0  # skip measuring the CPU
    rc.train.sigterm_grace_s = 5.0
    return rc


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _stalled_peer(timeout_s):
    groups = build_groups(Topology(2, 1, 1), timeout_s=timeout_s)
    if groups.rank == 1:
        time.sleep(4 * timeout_s)  # never joins
        return None
    t0 = time.perf_counter()
    try:
        comm.all_reduce(torch.ones(4), group=groups.dp)
    except Exception as e:  # noqa: BLE001 - the point is that it raises
        return time.perf_counter() - t0, str(e)
    return None


def test_collective_times_out_after_the_configured_seconds():
    # the harness's 30 s is the hang guard: torch's default timeout (minutes) would overrun it
    waited, message = run_ranks(_stalled_peer, 2, 1.0, timeout=30)[0]
    assert waited is not None and "1000ms" in message, message  # the configured 1 s, not a default


def cli_overrides(run_dir, **train) -> list[str]:
    """``small_recipe`` as command-line overrides, for the launcher tests (real processes)."""
    keys = dict(
        parallel__dp=2,
        parallel__zero=1,
        model__n_layers=2,
        model__d_model=32,
        model__n_heads=2,
        model__n_kv_heads=2,
        model__seq_len=16,
        train__global_batch=4,
        train__micro_batch=2,
        train__eval_every=0,
        train__threads=1,
        train__log_every=1,
        train__sigterm_grace_s=5,
        optim__warmup_steps=2,
        logger__progress="false",
        logger__peak_tflops=1.0,
        data__embedded_mb=0.25,
    )
    keys.update({f"train__{k}": v for k, v in train.items()})
    return [f"{k.replace('__', '.')}={v}" for k, v in keys.items()] + [f"hydra.run.dir={run_dir}"]


def launch(args, timeout):
    """Run a launcher in its own process (the test process never hosts an elastic agent:
    its threads would make later forked test ranks deadlock)."""
    t0 = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return done, time.perf_counter() - t0


def test_failing_rank_ends_the_self_spawned_job_naming_it(tmp_path):
    """A rank that raises: its traceback once (not the survivors'), then one line naming it and how to go
    on (a rank killed by a signal: tests/recipes/test_dead_worker.py, with a real kill -9)."""
    args = [sys.executable, "-m", "recipes.gpt_tiny", *cli_overrides(tmp_path, max_steps=50, fault="raise@1:2")]
    done, _ = launch(args, timeout=120)  # the timeout is the hang guard
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert done.stderr.count("Traceback") == 1 and lines[0] == "Traceback (most recent call last):", done.stderr
    assert lines[-2] == "RuntimeError: fault drill: rank 1 raises at step 2 (train.fault=raise@1:2)"
    assert lines[-1].startswith("error: rank 1 (pid ") and "raised RuntimeError: fault drill" in lines[-1]
    assert "after step 1 (the last logged)" in lines[-1] and "no checkpoint was published" in lines[-1]
    assert "train.fault" not in lines[-1].split("rerun from step 1: ", 1)[1]  # the drill is not repeated
    assert "terminate called" not in done.stderr  # the raising rank left with status 1, not SIGABRT
    assert len(metrics(tmp_path)) == 1  # step 1 ran, then the job ended: no survivor went on


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(tmp_path):
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "recipes.gpt_tiny",
        # a synchronous save: step 2's checkpoint is published before step 3 starts (a background
        # save may still be writing when the rank dies; the restart then resumes from the one before)
        *cli_overrides(tmp_path, max_steps=4, ckpt_every=2, resume="auto", fault="kill@1:3", ckpt_async="false"),
    ]
    done, _ = launch(args, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4]  # died starting 3; attempt 1 resumed at 2
    assert "resuming from" in done.stdout + done.stderr
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000004"


@pytest.mark.parametrize("log_every", [1, 5])
def test_sigterm_on_one_rank_checkpoints_and_stops_every_rank(tmp_path, log_every):
    rc = small_recipe(train__max_steps=6, train__fault="term@1:3", train__log_every=log_every)
    summaries = run_ranks(_train, 2, rc, str(tmp_path), timeout=120)
    # signalled as step 3 starts; the flag agreed at step 3's end is read (without a host wait) at step 4's
    assert [s["steps"] for s in summaries] == [4, 4] and all(s["preempted"] for s in summaries)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000004"
    # log_every=5: step 4 was not read; the pre-emption logs it, every rank reducing its loss (collective)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == ([1, 2, 3, 4] if log_every == 1 else [1, 4])
    assert [s["final_loss"] for s in summaries] == [rows[-1]["loss"]] * 2


def test_kill_while_saving_keeps_the_previous_checkpoint_for_resume(tmp_path):
    from parallel.testing import RankFailure

    rc = small_recipe(train__max_steps=4, train__ckpt_every=2, train__fault="kill_in_save@1:4")
    with pytest.raises(RankFailure):
        run_ranks(_train, 2, rc, str(tmp_path), timeout=120)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    rc = small_recipe(train__max_steps=4, train__ckpt_every=2, train__resume="auto")
    assert run_ranks(_train, 2, rc, str(tmp_path), timeout=120)[0]["steps"] == 4
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4]  # the rows after step 2 were logged again
