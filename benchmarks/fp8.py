"""FP8 (``train.precision=fp8``): its GEMMs on the device and its convergence against bf16.

    python -m benchmarks.fp8 gemm [--size 4096] [--json f]   # kernel vs emulation, fp8 vs bf16 linear time
    python -m benchmarks.fp8 converge [--steps 300] [--json f] # gpt_tiny: fp8 vs bf16 final loss (goal: ≤ 2 %)
    python -m benchmarks.fp8 parity [--steps 20] [--json f]   # fp8 at (2,2,2) SP ZeRO-1 and dp=2 ZeRO-3 vs (1,1,1)
    python -m benchmarks.fp8 compare RUN_BF16 RUN_FP8 [--tol 0.02]  # two runs' final losses

``gemm``: on a device with fp8 kernels, a ``[s, s]`` column layer's forward and backward through
``torch._scaled_mm`` against the emulation (the same fp8 values multiplied in fp32: they differ in the
summation order only, so ≤ 1e-3 relative), for both recipes, and the fp8 layer's forward + backward
time beside ``F.linear``'s in bf16 (CUDA events). Without fp8 kernels only the emulation runs (the CPU
dry run of benchmarks/gpu_check.sh). ``converge`` trains the recipe twice in one process each (bf16,
then fp8 tensorwise and rowwise, emulated where the device has no fp8 kernels) and prints the final
losses. ``parity`` trains fp8 (tensorwise) at three layouts and prints each step's largest relative
difference from one process (goal ≤ 1e-3: the same math, the accumulation order differs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from parallel.layers import ColumnParallelLinear, Fp8Recipe, enable_fp8
from parallel.layers.fp8 import fp8_kernels
from parallel.timing import StepClock

PARITY = 1e-3  # kernel vs emulation, relative


def _layer_grads(layer, x, dy):
    x = x.detach().requires_grad_()
    layer.weight.grad = None
    y = layer(x)
    y.backward(dy)
    return [y.detach().float(), x.grad.float(), layer.weight.grad.float()]


def _time(fn, reps: int, device) -> float:
    """Seconds per call on the device's timeline (:class:`parallel.timing.StepClock`: CUDA events on a GPU)."""
    fn()
    clock = StepClock(device)
    start = clock.mark()
    for _ in range(reps):
        fn()
    return clock.seconds(start, clock.mark()) / reps


def gemm(size: int, reps: int = 20) -> dict:
    """Kernel vs emulation per recipe, and fp8 vs bf16 layer time (module docstring)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    real = fp8_kernels(device)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(size, size, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    dy = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "fp8_kernels": real}
    for scaling in ("tensorwise", "rowwise"):
        enable_fp8([layer], Fp8Recipe(scaling, emulate=True))
        emulated = _layer_grads(layer, x, dy)
        row = {}
        if real:
            enable_fp8([layer], Fp8Recipe(scaling, emulate=False))
            kernel = _layer_grads(layer, x, dy)
            rel = [((a - b).norm() / b.norm()).item() for a, b in zip(kernel, emulated)]
            row["kernel_vs_emulated"] = dict(zip(("y", "dx", "dw"), rel))
            row["ok"] = max(rel) <= PARITY
        t8 = _time(lambda: _layer_grads(layer, x, dy), reps, device)
        row["fp8_s"] = t8
        out[scaling] = row
    enable_fp8([layer], None)
    out["bf16_s"] = _time(lambda: _layer_grads(layer, x, dy), reps, device)
    for scaling in ("tensorwise", "rowwise"):
        out[scaling]["bf16_over_fp8"] = out["bf16_s"] / out[scaling]["fp8_s"]
    return out


#: parity's layouts, and the small GPT they train
LAYOUTS = {
    "dp2-pp2-tp2-sp-zero1": ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
}
SMALL = ["model.n_layers=4", "model.d_model=64", "model.seq_len=32", "train.global_batch=8", "train.micro_batch=2"]
SMALL += ["train.log_every=1", "train.eval_every=0", "train.threads=1", "data.embedded_mb=0.25", "parallel.zero=1"]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]


def final_loss(run_dir: Path) -> float:
    return losses(run_dir)[-1]


def _train(run_dir: Path, steps: int, precision: str, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "recipes.gpt_tiny", f"train.max_steps={steps}", f"train.precision={precision}"]
    cmd += ["logger.progress=false", f"hydra.run.dir={run_dir}", *extra]
    if precision == "fp8" and not fp8_kernels("cuda" if torch.cuda.is_available() else "cpu"):
        cmd.append("train.fp8_emulate=true")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return final_loss(run_dir)


def converge(steps: int, extra: list[str]) -> dict:
    """Final losses of bf16 and fp8 (tensorwise, then rowwise) runs of gpt_tiny, and their ratios."""
    with tempfile.TemporaryDirectory() as d:
        bf16 = _train(Path(d) / "bf16", steps, "bf16", extra)
        out = {"steps": steps, "bf16": bf16}
        for scaling in ("tensorwise", "rowwise"):
            fp8 = _train(Path(d) / scaling, steps, "fp8", [*extra, f"train.fp8_recipe={scaling}"])
            out[scaling] = {"loss": fp8, "relative": abs(fp8 - bf16) / bf16}
    return out


def parity(steps: int) -> dict:
    """Per layout, the largest relative per-step loss difference from (1,1,1), all at fp8 tensorwise."""
    with tempfile.TemporaryDirectory() as d:
        _train(Path(d) / "one", steps, "fp8", SMALL)
        ref = losses(Path(d) / "one")
        out = {"steps": steps, "(1,1,1)": ref}
        for name, layout in LAYOUTS.items():
            _train(Path(d) / name, steps, "fp8", [*SMALL, *layout, "parallel.oversubscribe=true"])
            got = losses(Path(d) / name)
            out[name] = {"losses": got, "max_relative": max(abs(a - b) / b for a, b in zip(got, ref))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fp8", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gemm")
    g.add_argument("--size", type=int, default=4096)
    g.add_argument("--reps", type=int, default=20)
    g.add_argument("--json")
    c = sub.add_parser("converge")
    c.add_argument("--steps", type=int, default=300)
    c.add_argument("--json")
    c.add_argument("overrides", nargs="*", help="more recipe overrides, e.g. train.threads=2")
    p = sub.add_parser("parity")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json")
    k = sub.add_parser("compare")
    k.add_argument("bf16_run")
    k.add_argument("fp8_run")
    k.add_argument("--tol", type=float, default=0.02)
    a = ap.parse_args(argv)
    if a.what == "compare":
        bf16, fp8 = final_loss(Path(a.bf16_run)), final_loss(Path(a.fp8_run))
        rel = abs(fp8 - bf16) / bf16
        print(f"fp8 final loss {fp8:.4f} vs bf16 {bf16:.4f}: {rel:.2%} apart (goal ≤ {a.tol:.0%})")
        return 0 if rel <= a.tol else 1
    if a.what == "gemm":
        out = gemm(a.size, a.reps)
    else:
        out = converge(a.steps, a.overrides) if a.what == "converge" else parity(a.steps)
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    bad = [s for s in ("tensorwise", "rowwise") if a.what == "gemm" and out[s].get("ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
