"""Step 3 of ``benchmarks/gpu_check.sh``: save a checkpoint on this machine's device and resume from it.

    python -m benchmarks.gpu_check            # one process: CUDA if present, else the CPU

Trains a small GPT for 4 steps through :func:`recipes.training.trainer.train`, saving at
step 2 and 4, then trains a second run resumed from step 2's checkpoint
(``train.resume=<its directory>``) to step 4 and compares the losses of steps
3 and 4: bit-exact on the CPU; on a GPU within 1e-4 (atomics in some CUDA
backward kernels, the embedding's among them, sum in a varying order). Also
checks the resumed run started at step 2 and restored the RNG states
(``rng/0/cuda`` on a GPU). Exits 0 on success, 1 with the numbers otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_mfu import _single_process_env  # noqa: E402


def _recipe(cuda: bool, **train):
    from recipes.config import RecipeConfig

    rc = RecipeConfig()
    rc.model.preset = "gpt_tiny"
    rc.model.n_layers, rc.model.d_model, rc.model.n_heads = 4, 256 if cuda else 64, 4
    rc.model.seq_len = 256 if cuda else 32
    rc.train.global_batch, rc.train.micro_batch, rc.train.max_steps = 8, 2, 4
    rc.train.log_every, rc.train.eval_every, rc.train.ckpt_every = 1, 0, 2
    rc.train.threads = 0 if cuda else 1
    rc.optim.warmup_steps = 1
    rc.logger.progress = False
    rc.logger.peak_tflops = None if cuda else 1.0  # MFU is not what this checks: the CPU is not measured
    rc.data.embedded_mb = 0.25
    for k, v in train.items():
        setattr(rc.train, k, v)
    return rc


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def loss_problems(want: dict[int, float], got: dict[int, float], tolerance: float) -> tuple[list[str], float]:
    """Compare the resumed run's losses (``got``, steps 3-4) with the uninterrupted run's; (problems, max diff)."""
    problems = [] if sorted(got) == [3, 4] else [f"the resumed run logged steps {sorted(got)}, want [3, 4]"]
    diff = max((abs(got[s] - want[s]) for s in (3, 4) if s in got), default=float("inf"))
    if not diff <= tolerance:
        problems.append(
            f"losses after resuming {[got.get(s) for s in (3, 4)]} vs uninterrupted "
            f"{[want[s] for s in (3, 4)]}: max difference {diff:.3g} > {tolerance:g}"
        )
    return problems, diff


def main() -> int:
    from parallel.checkpoint import read_manifest, saved_tensors
    from recipes.training.trainer import train

    _single_process_env()
    cuda = torch.cuda.is_available()
    tolerance = 1e-4 if cuda else 0.0
    with tempfile.TemporaryDirectory(prefix="gridtrain-gpu-check-") as tmp:
        full, resumed = Path(tmp) / "full", Path(tmp) / "resumed"
        train(_recipe(cuda), str(full))
        ckpt = full / "checkpoints" / "step_00000002"
        summary = train(_recipe(cuda, resume=str(ckpt)), str(resumed))
        want, got = _losses(full), _losses(resumed)
        keys = saved_tensors(ckpt)
        problems, diff = loss_problems(want, got, tolerance)
        if read_manifest(ckpt)["step"] != 2 or summary["steps"] != 4:
            problems.append(
                f"checkpoint of step {read_manifest(ckpt)['step']} (want 2); run ended at {summary['steps']} (want 4)"
            )
        if cuda and "rng/0/cuda" not in keys:
            problems.append("no CUDA RNG state in the checkpoint")
    device = torch.cuda.get_device_name() if cuda else "CPU"
    if problems:
        print(f"checkpoint resume on {device}: FAILED: " + "; ".join(problems))
        return 1
    print(
        f"checkpoint resume on {device}: steps 3-4 after resuming from step 2 match the uninterrupted run "
        f"(max loss difference {diff:.3g}, tolerance {tolerance:g}); {len(keys)} tensors in the checkpoint"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
