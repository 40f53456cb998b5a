"""A worker killed by SIGKILL mid-step (inside a collective, ``train.fault=die_in_comm``: what a user's
``kill -9`` or the OOM killer does) ends the self-spawned job with one line: the rank, the signal, the
last published checkpoint, the command that resumes; no process stays behind, ``python -m
recipes.diagnose`` names the dead rank, and the command continues the run with metrics.jsonl holding
every step once (launch/failures.py, recipes/main.py)."""

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_errors_catalogue import _session_members
from .test_faults import ROOT, cli_overrides, metrics


def lock_workers(run_dir) -> dict[int, int]:
    """{rank: pid} of the workers the run lock records (recipes/training/runlock.py)."""
    lines = (run_dir / ".lock").read_text().splitlines()[1:]
    return {w["rank"]: w["pid"] for w in map(json.loads, lines)}


def live_members(sid: int, polls: int = 50) -> dict[int, str]:
    """{pid: command line} of the session's processes still running after up to ``polls`` × 0.1 s (a zombie,
    dead and waiting for init to reap it, is not running; multiprocessing's resource tracker leaves once
    it reads the end of its launcher's pipe)."""
    from recipes.training.runlock import _pid_alive

    for _ in range(polls):
        live = {}
        for p in _session_members(sid):
            try:
                live[p] = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            if not _pid_alive(p):
                live.pop(p)
        if not live:
            return {}
        time.sleep(0.1)
    return live


def wait_for(predicate, proc, what, polls=900):
    for _ in range(polls):  # the hang guard: polls × 0.2 s
        if predicate():
            return
        assert proc.poll() is None, f"the job ended before {what}: {proc.communicate()[1][-3000:]}"
        time.sleep(0.2)
    pytest.fail(f"the job did not reach {what}")


def published(run_dir) -> bool:
    return (run_dir / "checkpoints" / "latest").is_file()


def test_kill_9_of_a_worker_mid_step_ends_the_job_with_one_line_saying_how_to_resume(tmp_path):
    from recipes.tools.diagnose import diagnose

    # rank 1 dies inside its third collective of step 7; saves run in the background every 2 steps:
    # step 6's is most likely in flight
    overrides = cli_overrides(tmp_path, max_steps=10_000, ckpt_every=2, fault="die_in_comm@1:7")
    proc = subprocess.Popen(
        [sys.executable, "-m", "recipes.gpt_tiny", *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=180)  # the hang guard
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(r"error: rank 1 \(pid \d+\) was killed by SIGKILL \(signal 9\) after step \d+ ", last), last
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert f"last published checkpoint: {tmp_path / 'checkpoints' / latest}; resume with: " in last
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    assert live_members(proc.pid) == {}, "processes of the job survive it"
    # rank 0 dumps when its collective fails; gloo may instead abort it inside its C++ transport (a peer
    # gone mid-transfer: no Python runs, no dump; NCCL has no such path), and then there is nothing to read
    if list((tmp_path / "flight").glob("rank*.json")):
        assert "no dump from ranks [1] (dead, or never reached a dump)" in diagnose(tmp_path)
    logged = metrics(tmp_path)[-1]["step"]
    command = shlex.split(last.split("resume with: ", 1)[1])
    assert command[:3] == ["python", "-m", "recipes.gpt_tiny"] and f"hydra.run.dir={tmp_path}" in command
    assert "train.resume=auto" in command
    more = logged + 2  # the printed command, asked to stop 2 steps past the last logged one
    done = subprocess.run(
        [sys.executable, *command[1:], f"train.max_steps={more}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    step = int(latest.removeprefix("step_"))
    assert f"resuming from {tmp_path / 'checkpoints' / latest} (step {step})" in done.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, more + 1))  # no step twice
