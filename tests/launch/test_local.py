"""The self-spawn refuses a world one machine cannot hold (launch/local.py)."""

import os
import subprocess
import sys

import pytest

from launch.local import LocalWorldError, check_local_world, local_capacity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_capacity_is_one_worker_per_gpu_or_four_per_core_at_least_eight():
    assert local_capacity(gpus=8)[0] == 8
    assert local_capacity(gpus=0, cores=2)[0] == 8  # the README's 8 local ranks run on a 2-core laptop
    assert local_capacity(gpus=0, cores=16)[0] == 64
    check_local_world(8, gpus=0, cores=2)
    check_local_world(64, gpus=0, cores=16)
    with pytest.raises(LocalWorldError, match="world size 9 does not fit .* = 8 workers"):
        check_local_world(9, gpus=0, cores=2)
    with pytest.raises(LocalWorldError, match=r"world size 16 .*8 GPU\(s\), one worker each = 8 workers"):
        check_local_world(16, gpus=8)
    check_local_world(17920, gpus=0, cores=2, oversubscribe=True)


def test_gpt175b_without_torchrun_is_refused_in_one_line(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "recipes.gpt175b", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("error: world size 17920 does not fit"), p.stderr[-2000:]
    for hint in ("torchrun", "launch/slurm.sbatch", "mode=plan", "mode=dryrun", "parallel.oversubscribe=true"):
        assert hint in lines[-1]
    assert "Traceback" not in p.stderr and not (tmp_path / "metrics.jsonl").exists()
