"""The entry points a user types: self-spawn, torchrun, two torchrun "nodes", multirun.

Each launches real processes (spawned workers import torch: seconds each), so the
configs are tiny and the checks compare the runs' metrics with each other.
"""

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

TINY = [
    "model.d_model=64",
    "model.seq_len=32",
    "train.max_steps=3",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.eval_every=0",
    "train.log_every=1",
    "train.threads=1",
    "logger.progress=false",
    "data.embedded_mb=0.25",
]
TIMEOUT = 240


def run(cmd, cwd, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, **kw)
    return proc


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def self_spawned(tmp_path_factory):
    d = tmp_path_factory.mktemp("spawn")
    p = run(
        [sys.executable, "-m", "recipes.gpt_tiny", "parallel.tp=2", "parallel.pp=2", f"hydra.run.dir={d}", *TINY],
        cwd=os.getcwd(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return d, p


def test_self_spawn_trains_and_writes_one_run_dir(self_spawned):
    d, p = self_spawned
    assert len(losses(d)) == 3
    assert (d / "config.yaml").exists() and (d / ".hydra").is_dir()
    assert "done: 3 steps" in p.stdout
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(rows[0])


def test_torchrun_and_two_nodes_give_the_same_losses(self_spawned, tmp_path):
    """One torchrun node of 4 workers and two torchrun "nodes" of 2 (c10d rendezvous on a free port),
    the three launchers in flight together: both runs log the self-spawned run's losses."""
    ref = losses(self_spawned[0])
    layout = ["-m", "recipes.gpt_tiny", "parallel.tp=2", "parallel.pp=2"]
    one = tmp_path / "torchrun"
    single = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    two = tmp_path / "two-nodes"
    port = free_port()
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "twonode"]
    multi = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", *rdzv]
    cmds = [
        [*single, *layout, f"hydra.run.dir={one}", *TINY],
        *[[*multi, *layout, f"hydra.run.dir={two}", *TINY]] * 2,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(cmd, cwd=os.getcwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in cmds
    ]
    outs = []
    try:
        for n in procs:
            outs.append(n.communicate(timeout=TIMEOUT))
    finally:
        for n in procs:
            n.kill()
    assert procs[0].returncode == 0, outs[0][1][-3000:]
    assert losses(one) == pytest.approx(ref, abs=1e-5)
    assert all(n.returncode == 0 for n in procs[1:]), outs[1][1][-2000:] + outs[2][1][-2000:]
    assert losses(two) == pytest.approx(ref, abs=1e-5)
    # only rank 0 wrote: one metrics file, no per-rank directories
    assert sorted(os.listdir(tmp_path)) == ["torchrun", "two-nodes"]


def test_multirun_runs_each_layout_as_its_own_job_and_summarises(tmp_path):
    p = run(
        [sys.executable, "-m", "recipes.gpt_tiny", "-m", "parallel.tp=1,2", f"hydra.sweep.dir={tmp_path}", *TINY],
        cwd=os.getcwd(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for job in ("0", "1"):
        assert len(losses(tmp_path / job)) == 3
    assert "sweep summary:" in p.stdout
    assert "parallel.tp=1" in p.stdout and "parallel.tp=2" in p.stdout
    # tp=1 and tp=2 train the same model
    assert losses(tmp_path / "0") == pytest.approx(losses(tmp_path / "1"), abs=1e-4)


def test_bad_layout_is_refused_before_spawning(tmp_path):
    """Three refusals, each its own one-process command and run directory (they run together: nothing is spawned)."""
    cmds = [
        [sys.executable, "-m", "recipes.gpt_tiny", "parallel.tp=3", f"hydra.run.dir={tmp_path / 'tp3'}", *TINY],
        [
            sys.executable,
            "-m",
            "recipes.gpt_tiny",
            "train.global_batch=7",
            f"hydra.run.dir={tmp_path / 'batch7'}",
            *[a for a in TINY if not a.startswith("train.global_batch")],
        ],
        [sys.executable, "-m", "recipes.gpt_tiny", "model.n_layerz=3", f"hydra.run.dir={tmp_path / 'typo'}"],
    ]
    with ThreadPoolExecutor(3) as pool:  # each thread waits on its command's process
        tp3, batch7, typo = pool.map(lambda cmd: run(cmd, cwd=os.getcwd()), cmds)
    assert tp3.returncode != 0
    assert "n_heads 4 is not divisible by tp 3" in tp3.stderr
    assert batch7.returncode != 0 and "train.global_batch 7 is not a multiple of micro_batch 2" in batch7.stderr
    assert typo.returncode != 0 and "n_layerz" in typo.stderr


def test_torchrun_world_that_does_not_fit_fails_on_every_rank_quickly(tmp_path):
    p = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "recipes.gpt_tiny",
            "parallel.tp=4",
            "parallel.pp=1",
            f"hydra.run.dir={tmp_path}",
            *TINY,
        ],
        cwd=os.getcwd(),
    )
    assert p.returncode != 0
    # each rank refuses before any collective (torchrun may stop the second before it prints)
    assert p.stderr.count("error: world size 2 is not divisible by pp 1 × tp 4 = 4") >= 1, p.stderr[-2000:]
    assert "mode=plan" in p.stderr


def test_slurm_sweeps_compose_through_the_submitit_launcher(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    p = run(
        [
            sys.executable,
            "-m",
            "recipes.gpt_tiny",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.gpus_per_node=8",
            "hydra.launcher.timeout_min=120",
            "--cfg",
            "hydra",
        ],
        cwd=os.getcwd(),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "SlurmLauncher" in p.stdout and "gpus_per_node: 8" in p.stdout
