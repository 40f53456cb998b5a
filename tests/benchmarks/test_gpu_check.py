"""benchmarks/gpu_check.sh is runnable as is: its CPU dry run passes every step."""

import os
import subprocess
from pathlib import Path

from benchmarks import gpu_check

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_the_gpu_check_dry_run_passes_every_step():
    env = {**os.environ, "GPU_CHECK_DRY": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for marker in (
        "1/8 CUDA-capable tests",
        "2 passed",  # the fused-AdamW test and ring attention's blocks on the device
        "ring attention blocks:",
        "2/8 Quickstart",
        "3/8 mode=calibrate",
        "calibrated in",
        "4/8 MFU",
        "tokens/s",
        "vs planner",
        "predicted/measured",
        "5/8 ours vs plain PyTorch",
        "ours/theirs",
        "5/8 (torch.compile)",
        "compiled (eager)",
        "6/8 background",
        "stall per save",
        "7/8 checkpoint",
        "match the uninterrupted run",
        "8/8 fp8: skipped in the dry run",
        "GPU check passed",
    ):
        assert marker in out.stdout, marker


def test_without_a_gpu_and_without_dry_run_it_refuses_with_status_2():
    env = {**os.environ, "GPU_CHECK_DRY": "0", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "GPU_CHECK_DRY=1" in out.stderr


def test_the_resume_comparison_fails_on_any_difference_beyond_the_tolerance():
    want = {1: 5.0, 2: 4.9, 3: 4.8, 4: 4.7}
    assert gpu_check.loss_problems(want, {3: 4.8, 4: 4.7}, 0.0) == ([], 0.0)
    problems, diff = gpu_check.loss_problems(want, {3: 4.8, 4: 4.7 + 1e-6}, 0.0)
    assert diff > 0 and "max difference" in problems[0]
    assert gpu_check.loss_problems(want, {3: 4.8, 4: 4.7 + 1e-6}, 1e-5)[0] == []
    problems, _ = gpu_check.loss_problems(want, {4: 4.7}, 1e-5)
    assert "logged steps [4]" in problems[0]
