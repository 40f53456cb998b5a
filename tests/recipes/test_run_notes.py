"""What a run tells its user before and at its first steps: ``train.resume=auto`` without a run directory
finds the latest run of the recipe or says where it looked; a CPU run is not compared with a GPU's profile;
data smaller than one global batch is said (recipes/training/autoresume.py, reports.py, data.py)."""

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import torch

from recipes.config import RecipeConfig
from recipes.training.data import batch_shortfalls, write_token_dir
from recipes.training.reports import time_report

from .test_faults import ROOT, cli_overrides, metrics


def _run_in(cwd, *args, timeout=180):
    """``python -m recipes.gpt_tiny ...`` from ``cwd`` (its outputs/ folder), as a user starts it."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "recipes.gpt_tiny", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_plain_run_says_there_is_nothing_to_resume_and_its_data_is_small_then_the_next_resumes_it(tmp_path):
    """Two runs from one folder without hydra.run.dir, as a user types them: each gets a new
    outputs/<timestamp-id>; the second's train.resume=auto takes the first's checkpoint. Both read a
    train split of 40 tokens, less than one global batch of 4 × 17: said, and trained. One rank each:
    the notes are the launcher's and rank 0's."""
    write_token_dir(tmp_path / "tiny", {"train": np.arange(40) % 256}, 256)
    small = [k for k in cli_overrides(tmp_path)[:-1] if not k.startswith("parallel.dp=")]
    keys = [*small, "parallel.dp=1", "data.source=memmap", f"data.path={tmp_path / 'tiny'}", "train.resume=auto"]
    first = _run_in(tmp_path, *keys, "train.max_steps=2", "train.ckpt_at_end=true")
    assert first.returncode == 0, first.stderr[-3000:]
    (note,) = [x for x in first.stderr.splitlines() if x.startswith("note: train.resume=auto")]
    assert note.startswith(f"note: train.resume=auto: nothing to resume: this run's directory {tmp_path}/outputs/")
    assert note.endswith(
        f"is new (no hydra.run.dir) and no gpt_tiny run under {tmp_path}/outputs/ has a checkpoint; starting from step 1"
    )
    (warning,) = [x for x in first.stderr.splitlines() if x.startswith("warning: the train split")]
    assert (
        "holds 40 tokens, fewer than one global batch of train.global_batch 4 × (model.seq_len 16 + 1) = 68" in warning
    )
    (done,) = list((tmp_path / "outputs").iterdir())
    assert [r["step"] for r in metrics(done)] == [1, 2]
    second = _run_in(tmp_path, *keys, "train.max_steps=4")
    assert second.returncode == 0, second.stderr[-3000:]
    ckpt = done / "checkpoints" / "step_00000002"
    assert f"note: train.resume=auto: resuming from {ckpt}, the latest gpt_tiny run under" in second.stderr
    assert f"resuming from {ckpt} (step 2)" in second.stdout
    (new,) = set((tmp_path / "outputs").iterdir()) - {done}
    assert [r["step"] for r in metrics(new)] == [3, 4]


def test_resume_auto_in_a_fixed_directory_with_nothing_says_so(tmp_path):
    from recipes.training.autoresume import resolve_auto

    rc = RecipeConfig()
    rc.train.resume = "auto"
    note = resolve_auto(rc, tmp_path, recipe="gpt_tiny", fresh=False)
    assert note == f"train.resume=auto: nothing to resume in {tmp_path / 'checkpoints'}; starting from step 1"
    assert rc.train.resume == "auto"


def _trainer(**plan):
    rc = RecipeConfig()
    rc.train.global_batch, rc.train.micro_batch = 8, 4
    for k, v in plan.items():
        setattr(rc.plan, k, v)
    return SimpleNamespace(rank=0, rc=rc, device=torch.device("cpu"))


def test_a_cpu_run_is_not_compared_with_a_gpu_profile():
    says = time_report(_trainer(), 3.708)
    assert says == (
        "step time: measured 3.708 s (no prediction: plan.hardware=a100_80gb is a GPU's profile and this run is "
        "on the CPU; run mode=calibrate for a prediction, then plan.hardware=<its file>)"
    )
    assert "+" not in says and "predicted" not in says
    chosen = time_report(_trainer(hardware="cpu"), 3.708)  # the user's own choice is taken as meant
    assert chosen.startswith("step time (logged step): predicted ") and "hardware profile cpu" in chosen


def test_data_smaller_than_one_global_batch_is_said(tmp_path):
    write_token_dir(tmp_path / "tiny", {"train": np.arange(490) % 256, "val": np.arange(4000) % 256}, 256)
    rc = RecipeConfig()
    rc.data.source, rc.data.path = "memmap", str(tmp_path / "tiny")
    rc.train.global_batch, rc.train.eval_every = 16, 100
    (warning,) = batch_shortfalls(rc, 128)
    assert warning == (
        f"the train split ({tmp_path / 'tiny' / 'train.bin'}) holds 490 tokens, fewer than one global batch of "
        "train.global_batch 16 × (model.seq_len 128 + 1) = 2,064: every batch repeats tokens (its windows "
        "overlap); use more data, or a smaller train.global_batch or model.seq_len"
    )
    rc.train.global_batch = 2
    assert batch_shortfalls(rc, 128) == []
