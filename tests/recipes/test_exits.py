"""Clean exits: a finished job exits 0 on every rank; SIGTERM/SIGINT to a self-spawned launcher
makes the workers checkpoint and stop, status 0, no traceback (recipes/training/exits.py, launch/local.py)."""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from parallel.testing import HostSyncCounter, run_ranks
from recipes.training.checkpointing import Preemption
from recipes.training.exits import finish_distributed

from .test_faults import ROOT, cli_overrides, launch, metrics


def _finish(owned):
    done = finish_distributed(torch.device("cpu"), owned=owned)
    return done, dist.is_initialized()


def test_finish_distributed_destroys_only_groups_it_owns():
    assert run_ranks(_finish, 2, False) == [(False, True)] * 2
    assert run_ranks(_finish, 2, True) == [(True, False)] * 2


def test_preemption_close_joins_its_watchdog_and_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    p = Preemption(grace_s=5.0)
    assert p._thread.is_alive() and signal.getsignal(signal.SIGINT) == p._handle
    p.close()
    assert not p._thread.is_alive()
    assert {s: signal.getsignal(s) for s in before} == before
    assert [t.name for t in threading.enumerate() if t.name == "sigterm-watchdog"] == []


def _poll_rank(signalled_rank, signal_at):
    p = Preemption.__new__(Preemption)  # the agreement alone: no handlers in a forked test rank
    p.flag, p._pending, p._device_flag, p._installed = False, None, None, False
    p._acknowledged = threading.Event()
    seen = []
    with HostSyncCounter() as syncs:
        for step in range(6):
            if dist.get_rank() == signalled_rank and step == signal_at:
                p.flag = True
            seen.append(p.poll())
    return seen, syncs.total


def test_preemption_is_agreed_by_every_rank_on_the_same_step_one_step_late_without_host_reads():
    """Only rank 1 is signalled (during step 2): every rank stops after step 3, and polling every
    step reads no device value (the flag read is the previous step's host copy)."""
    for seen, syncs in run_ranks(_poll_rank, 2, 1, 2, timeout=60):
        assert seen == [False, False, False, True, True, True]
        assert syncs == 0


def test_finished_torchrun_jobs_exit_zero_every_time(tmp_path):
    """Three independent torchrun jobs (each its own free port, ``--standalone``), in flight together:
    every one ends with status 0 and no teardown crash."""

    def job(i):
        args = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "recipes.gpt_tiny",
            *cli_overrides(tmp_path / str(i), max_steps=1),
        ]
        return launch(args, timeout=180)[0]

    with ThreadPoolExecutor(3) as pool:  # each thread waits on its job's process
        jobs = list(pool.map(job, range(3)))
    for done in jobs:
        assert done.returncode == 0, done.stderr[-3000:]
        assert "terminate called" not in done.stderr and "Traceback" not in done.stderr
        if not torch.cuda.is_available():  # only GPU ranks are called GPUs
            assert "1 node(s) × 2 CPU processes" in done.stdout and "GPUs" not in done.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_self_spawned_launcher_checkpoints_and_exits_zero(tmp_path, sig):
    args = [sys.executable, "-m", "recipes.gpt_tiny", *cli_overrides(tmp_path, max_steps=10_000)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(900):  # the hang guard: 180 s of polling for step 2
            if (tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 2:
                break
            assert proc.poll() is None, "the job ended before step 2"
            time.sleep(0.2)
        else:
            pytest.fail("the job did not reach step 2")
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)  # the hang guard
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "forcefully" not in err, err[-3000:]
    assert "stopped by a signal with a checkpoint" in out
    step = metrics(tmp_path)[-1]["step"]
    assert (tmp_path / "checkpoints" / f"step_{step:08d}").is_dir()
