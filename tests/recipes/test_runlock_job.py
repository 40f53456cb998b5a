"""The run lock covers the whole job: after ``kill -9`` of the launcher its workers still hold the
directory until they end, which they do at their next step without saving (recipes/training/runlock.py,
recipes/training/exits.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from recipes.training import runlock

from .test_dead_worker import lock_workers, published, wait_for
from .test_faults import ROOT, cli_overrides, metrics
from .test_runlock import PLAN, _cli

HOLDER = """
import subprocess, sys, time
sys.path.insert(0, {root!r})
from recipes.training.runlock import acquire
acquire({run_dir!r})
worker = "import sys, time; sys.path.insert(0, {root!r}); from recipes.training.runlock import register_worker; "
workers = [subprocess.Popen([sys.executable, "-c", worker + f"print(register_worker({run_dir!r}, {{r}}), flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True) for r in (0, 1)]
print(" ".join(w.stdout.readline().strip() + ":" + str(w.pid) for w in workers), flush=True)
time.sleep(120)
"""


def _gone(pids, polls=600):
    for _ in range(polls):  # the hang guard: polls × 0.1 s
        if not any(runlock._pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_the_lock_is_held_while_any_worker_of_a_killed_launcher_lives(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(root=str(ROOT), run_dir=str(tmp_path))], stdout=subprocess.PIPE, text=True
    )
    workers = []
    try:
        registered = holder.stdout.readline().split()
        assert [r.split(":")[0] for r in registered] == ["True", "True"], registered
        workers = [int(r.split(":")[1]) for r in registered]
        record = [json.loads(line) for line in (tmp_path / ".lock").read_text().splitlines()]
        assert record[0]["pid"] == holder.pid and {w["rank"]: w["pid"] for w in record[1:]} == dict(enumerate(workers))
        with pytest.raises(runlock.RunDirLocked, match=f"in use by pid {holder.pid}"):
            runlock.acquire(tmp_path)  # the launcher lives
        holder.kill()
        holder.wait()
        with pytest.raises(
            runlock.RunDirLocked,
            match=rf"launcher .*pid {holder.pid}.* is gone but worker\(s\) "
            rf"{workers[0]} \(rank 0\), {workers[1]} \(rank 1\) still run after 0.5 s",
        ):
            runlock.acquire(tmp_path, wait_s=0.5)
        os.kill(workers[0], signal.SIGKILL)
        killer = subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {workers[1]}"])  # the last ends during the wait
        lock = runlock.acquire(tmp_path, wait_s=60)
        killer.wait()
        try:
            assert lock.took_over["pid"] == holder.pid
            assert sorted(w["pid"] for w in lock.took_over["workers"]) == sorted(workers)
            assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        finally:
            lock.release()
    finally:
        holder.kill()
        for w in workers:
            if runlock._pid_alive(w):
                os.kill(w, signal.SIGKILL)


def test_workers_of_a_killed_launcher_stop_at_their_next_step_without_saving(tmp_path):
    """The self-spawned job as a user runs it; its workers frozen (SIGSTOP) while the launcher gets
    ``kill -9``, so that a second run finds them alive; thawed, they stop by themselves."""
    args = [sys.executable, "-m", "recipes.gpt_tiny", *cli_overrides(tmp_path, max_steps=10_000, ckpt_every=1)]
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    workers = []
    try:
        wait_for(lambda: published(tmp_path) and len(metrics(tmp_path)) >= 3, proc, "a published checkpoint")
        workers = list(lock_workers(tmp_path).values())
        for w in workers:
            os.kill(w, signal.SIGSTOP)
        steps = metrics(tmp_path)[-1]["step"]
        proc.kill()  # kill -9 of the launcher
        proc.wait()
        refused = _cli(f"hydra.run.dir={tmp_path}", "train.lock_wait_s=0.5", *PLAN)
        assert refused.returncode == 2, refused.stderr[-2000:]
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: run directory {tmp_path}: its launcher") and f"pid {proc.pid}" in last
        assert all(str(w) in last for w in workers) and "train.lock_wait_s" in last
        for w in workers:
            os.kill(w, signal.SIGCONT)
        assert _gone(workers), "the workers of a dead launcher went on"
        # no save of a step after the kill (one written before it may still have been published)
        assert int((tmp_path / "checkpoints" / "latest").read_text().strip().removeprefix("step_")) <= steps
        assert metrics(tmp_path)[-1]["step"] <= steps + 1  # at most the step they were in
        taken = _cli(f"hydra.run.dir={tmp_path}", *PLAN)
        assert taken.returncode == 0 and f"took over {tmp_path / '.lock'} from pid {proc.pid}" in taken.stderr
        _, err = proc.communicate(timeout=60)
        assert f"error: the launcher (pid {proc.pid}) is gone: every rank stops after step" in err
    finally:
        proc.kill()
        for w in workers:
            if runlock._pid_alive(w):
                os.kill(w, signal.SIGKILL)
