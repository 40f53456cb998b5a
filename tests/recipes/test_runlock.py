"""One live run per run directory, and run ids unique per launch (recipes/training/runlock.py, recipes/main.py)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from recipes import main
from recipes.training import runlock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = ["mode=plan", "hydra/job_logging=none"]  # the cheapest real run: the CLI, Hydra, the lock, no workers


def _cli(*args, cwd=ROOT, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "recipes.gpt_tiny", *args],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_run_into_a_held_directory_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                f"import sys, time; sys.path.insert(0, {ROOT!r}); from recipes.training.runlock import acquire; "
                f"acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(120)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        p = _cli(f"hydra.run.dir={tmp_path}", *PLAN)
        assert p.returncode == 2, p.stderr[-2000:]
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("error: run directory") and f"pid {holder.pid} on host {socket.gethostname()}" in last
        assert "Traceback" not in p.stderr
        assert sorted(os.listdir(tmp_path)) == [".lock"], "the refused run wrote into the directory"
    finally:
        holder.kill()
        holder.wait()
    # its holder gone (the kernel dropped the lock, the record stays): the next run takes over and cleans up
    p = _cli(f"hydra.run.dir={tmp_path}", *PLAN)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"took over {tmp_path / '.lock'} from pid {holder.pid}" in p.stderr
    assert (tmp_path / ".lock").read_text() == "" and (tmp_path / "plan.json").exists()


def test_stale_lock_of_a_dead_holder_is_taken_over_and_released(tmp_path):
    record = {"pid": _dead_pid(), "host": socket.gethostname(), "started": time.time() - 60}
    (tmp_path / ".lock").write_text(json.dumps(record))
    lock = runlock.acquire(tmp_path)
    try:
        assert lock.took_over == record
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        assert runlock.acquire(tmp_path) is lock  # idempotent in one process
    finally:
        lock.release()
    assert (tmp_path / ".lock").read_text() == ""
    runlock.acquire(tmp_path).release()  # a free (empty) lock file is simply taken


@pytest.mark.parametrize("host, alive", [("another-host.example", False), (None, True)])
def test_unverifiable_records_are_refused_not_guessed(tmp_path, host, alive):
    pid = os.getppid() if alive else _dead_pid()
    (tmp_path / ".lock").write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": 0}))
    with pytest.raises(runlock.RunDirLocked, match=f"pid {pid} on host .*delete {tmp_path / '.lock'}"):
        runlock.acquire(tmp_path)


def test_run_ids_differ_within_one_second_and_torchrun_ranks_share_theirs(monkeypatch):
    monkeypatch.setattr(main.time, "strftime", lambda fmt: "2026-01-01_00-00-00")
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    ids = {main.shared_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("2026-01-01_00-00-00-") for i in ids)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert main.shared_run_id() == main.shared_run_id() == "torchrun-abc"


def test_two_plain_launches_at_once_get_two_directories(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "recipes.gpt_tiny", *PLAN]
    procs = [
        subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    runs = os.listdir(tmp_path / "outputs")
    assert len(runs) == 2, runs


def test_static_rendezvous_ranks_agree_on_a_fresh_id(tmp_path):
    script = tmp_path / "rid.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {ROOT!r})\nfrom recipes.main import shared_run_id\n"
        "print('ID', shared_run_id(), flush=True)\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "static",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(script),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    ids = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("ID ")]
    assert p.returncode == 0 and len(ids) == 2 and ids[0] == ids[1], p.stdout + p.stderr[-2000:]
    assert not ids[0].startswith("torchrun-none") and not ids[0].startswith("job-")  # fresh: timestamp + suffix
