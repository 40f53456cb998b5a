"""Tokens/s, TFLOP/s and MFU of a ~1B-parameter GPT trained in bf16 through our trainer.

    python -m benchmarks.gpu_mfu                               # one GPU (or a CPU dry run)
    torchrun --nproc-per-node 8 -m benchmarks.gpu_mfu          # (8,1,1) (1,1,8) (2,2,2)
    torchrun --nproc-per-node 4 -m benchmarks.gpu_mfu --layout 2,1,2 --layout 1,2,2

Each layout (dp, pp, tp) is a :class:`recipes.training.trainer.Trainer` (ZeRO-1, bf16
compute with fp32 master weights, fused AdamW on CUDA, SDPA restricted to the
flash / memory-efficient / cuDNN kernels so a silent fall-back to the math kernel
fails loudly) running ``--warmup`` then ``--steps`` timed steps of the same
global batch (default: 4 micro-batches of 4 × 2048 tokens per GPU). Per layout it
prints tokens/s, achieved TFLOP/s per GPU (``parallel.plan.shape.model_flops_per_token``:
6·N + attention), MFU against the GPU's dense bf16 peak (its profile in
:mod:`parallel.plan.hardware`, found by device name, or ``--peak-tflops``) and
``torch.cuda.max_memory_allocated`` (max over ranks) beside the planner's
prediction for the same layout (:func:`recipes.tools.plan.plan_from_config`: model
states + activations of the fullest rank) and the planner's step time on each
``--hardware`` profile (default: the GPU's own). The default model (20 layers, d_model
2048, seq 2048, vocab 50304 tied: 1.1 B parameters) at micro-batch 4: the planner
predicts 35.8 GB on one GPU (20.1 GB model states, 15.8 GB activations; an H200
measured 35.9 GB, docs/gpu.md). ``--micro-batches 1,4,8`` and ``--checkpointing
none,full`` measure each combination in turn at one global batch (default: 4 of the
largest micro-batch per rank).

Without CUDA it says so, runs the same code path on a tiny model for two steps
on the CPU (bf16 as well) and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/gpu_mfu.py`: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (its hardware profile; ``None`` if it has none)."""
    from parallel.plan.hardware import profile_for_device

    hw = profile_for_device(device_name)
    return hw.peak_tflops_16 if hw else None


def recipe(
    dp: int, pp: int, tp: int, *, dry_run: bool, micro_batch: int, global_batch: int, checkpointing: str = "none"
):
    from recipes.config import RecipeConfig

    rc = RecipeConfig()
    rc.model.preset = "gpt_tiny"
    if dry_run:
        rc.model.n_layers, rc.model.d_model, rc.model.n_heads, rc.model.seq_len = 2, 64, 4, 32
        rc.train.threads = 1
        rc.data.embedded_mb = 0.25
    else:
        rc.model.n_layers, rc.model.d_model, rc.model.n_heads = 20, 2048, 16
        rc.model.n_kv_heads, rc.model.d_ff = 16, 4 * 2048  # the preset's derived 4 and 512 would stick
        rc.model.seq_len, rc.model.vocab_size = 2048, 50304
    rc.parallel.dp, rc.parallel.pp, rc.parallel.tp, rc.parallel.zero = dp, pp, tp, 1
    rc.model.activation_checkpointing = checkpointing
    rc.train.precision = "bf16"
    rc.train.global_batch, rc.train.micro_batch = global_batch, micro_batch
    rc.train.eval_every, rc.train.grad_clip, rc.train.max_steps = 0, 1.0, 1000
    rc.optim.warmup_steps = 0
    rc.logger.progress = False
    return rc


def default_layouts(world: int) -> list[tuple[int, int, int]]:
    """Pure DP, pure TP, pure PP of the world (what divides the default model), and (2,2,2) on 8."""
    layouts = [(world, 1, 1)]
    if world > 1:
        if 16 % world == 0:  # heads
            layouts.append((1, 1, world))
        if 20 % world == 0:  # layers
            layouts.append((1, world, 1))
        if world == 8:
            layouts.append((2, 2, 2))
    return layouts


def _sdpa_without_math_kernel():
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def predicted_step_s(rc, hardware: str) -> float:
    """The planner's step time for ``rc``'s layout on the profile ``hardware`` (a name or a ``.json`` file)."""
    from recipes.tools.plan import plan_from_config

    rc.plan.hardware = hardware
    return plan_from_config(rc).step["step_time_s"]


def measure(
    layout: tuple[int, int, int], a, dry_run: bool, micro_batch: int | None = None, checkpointing: str = "none"
) -> dict:
    """Train ``layout`` for ``a.warmup + a.steps`` steps; rank 0's view of the timed ones, beside the
    planner's memory and step time (on every profile in ``a.hardware``)."""
    from parallel import comm
    from parallel.plan.shape import model_tflops_per_device
    from recipes.tools.plan import plan_from_config
    from recipes.training.trainer import Trainer

    dp, pp, tp = layout
    micro_batch = micro_batch or a.micro_batch
    rc = recipe(
        dp, pp, tp, dry_run=dry_run, micro_batch=micro_batch, global_batch=a.global_batch, checkpointing=checkpointing
    )
    trainer = Trainer(rc, run_dir=".")
    cuda = trainer.device.type == "cuda"
    with _sdpa_without_math_kernel():
        for step in range(a.warmup):
            trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for step in range(a.warmup, a.warmup + a.steps):
            loss = trainer.train_step(step)["loss"]  # waits for the device
        elapsed = (time.perf_counter() - t0) / a.steps
    world = trainer.topology.world_size
    peak_mem = torch.tensor(
        [torch.cuda.max_memory_allocated() if cuda else 0], dtype=torch.float64, device=trainer.device
    )
    comm.all_reduce(peak_mem, op=torch.distributed.ReduceOp.MAX)  # world group
    cfg = trainer.model_cfg
    tokens_per_s = rc.train.global_batch * cfg.seq_len / elapsed
    tflops = model_tflops_per_device(tokens_per_s, cfg, world)
    n_params = sum(p.numel() for p in trainer.engine.model.parameters())
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    try:
        fullest = max(plan_from_config(rc).ranks, key=lambda r: r.memory["total"]).memory
        predicted = {hw: predicted_step_s(rc, hw) for hw in a.hardware}
    except ValueError:  # ConfigError: a layout the planner cannot describe
        fullest = {"total": float("nan"), "model_states": float("nan"), "activations": float("nan")}
        predicted = {}
    return {
        "layout": layout,
        "micro_batch": micro_batch,
        "checkpointing": checkpointing,
        "predicted_step_s": predicted,
        "step_s": elapsed,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": tflops,
        "peak_mem_GB": peak_mem.item() / 1e9,
        "loss": loss,
        "rank0_params": n_params,
        "predicted_mem_GB": fullest["total"] / 1e9,
        "predicted_states_GB": fullest["model_states"] / 1e9,
        "predicted_activations_GB": fullest["activations"] / 1e9,
    }


def _single_process_env() -> None:
    """Run without torchrun: a one-rank world on this machine."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def _csv(text: str, cast=str) -> list:
    return [cast(v) for v in text.split(",") if v]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument(
        "--micro-batches",
        default="",
        help="comma-separated micro-batch sizes to measure in turn at the same global batch (default: --micro-batch)",
    )
    ap.add_argument(
        "--checkpointing",
        default="none",
        help="comma-separated activation checkpointing modes to measure in turn (none, selective, full)",
    )
    ap.add_argument(
        "--global-batch",
        type=int,
        default=0,
        help="sequences per step (default: 4 micro-batches per rank, micro-batch × 4 × world)",
    )
    ap.add_argument("--layout", action="append", help="dp,pp,tp (repeatable); default: see the module doc")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, if not in the table")
    ap.add_argument(
        "--hardware",
        action="append",
        default=[],
        help="planner profile (name or mode=calibrate's hardware.json) to predict the step time with, beside the "
        "GPU's own stock profile (repeatable)",
    )
    ap.add_argument("--json", help="write the results to this file")
    a = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro_batches = _csv(a.micro_batches, int) or [a.micro_batch]
    checkpointing = _csv(a.checkpointing)
    a.global_batch = a.global_batch or max(micro_batches) * 4 * world
    from parallel.memory import CHECKPOINTING

    if min(a.steps, *micro_batches, a.global_batch) < 1 or a.warmup < 0:
        ap.error(
            f"--steps/--micro-batch(es)/--global-batch must be ≥ 1 and --warmup ≥ 0, got "
            f"{a.steps}/{micro_batches}/{a.global_batch} and {a.warmup}"
        )
    if not set(checkpointing) <= set(CHECKPOINTING) or not checkpointing:
        ap.error(f"--checkpointing {a.checkpointing!r}: choose among {CHECKPOINTING}")
    dry_run = not torch.cuda.is_available()
    if dry_run:
        print("No CUDA GPU here: a tiny CPU dry run of the same path (2 steps, 1 warm-up); no MFU figures.")
        a.steps, a.warmup, a.global_batch = 2, 1, 4 * world
        micro_batches = list(dict.fromkeys(min(m, 2) for m in micro_batches))  # 1,4,8 -> 1,2: each size once
    layouts = [tuple(int(v) for v in s.split(",")) for s in a.layout] if a.layout else default_layouts(world)
    bad = [lay for lay in layouts if len(lay) != 3 or lay[0] * lay[1] * lay[2] != world]
    if bad:
        ap.error(f"layouts {bad} do not multiply to the world size {world} (give dp,pp,tp with dp·pp·tp = {world})")
    _single_process_env()
    name = torch.cuda.get_device_name() if not dry_run else "CPU"
    own = profile_for_name(name)  # the stock profile always, beside any given (a calibrated file, say)
    a.hardware = list(dict.fromkeys([own or "cpu", *a.hardware]))
    peak = a.peak_tflops or (None if dry_run else peak_tflops(name))
    rank0 = int(os.environ["RANK"]) == 0
    results = []
    for layout in layouts:
        for mb in micro_batches:
            for ckpt in checkpointing:
                r = measure(layout, a, dry_run, micro_batch=mb, checkpointing=ckpt)
                r["mfu"] = r["tflops_per_gpu"] / peak if peak else None
                r["device"] = name
                results.append(r)
                if rank0:
                    print(_row(r, name, world), flush=True)
    if rank0 and a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if dry_run and rank0:
        print("dry run done (exit 0); run on a CUDA machine for the real figures")
    return results


def profile_for_name(device_name: str) -> str | None:
    """The name of the planner profile of a GPU called ``device_name`` (None if it has none)."""
    from parallel.plan.hardware import profile_for_device

    hw = profile_for_device(device_name)
    return hw.name if hw else None


def _row(r: dict, name: str, world: int) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (peak unknown: --peak-tflops)"
    predicted = ", ".join(
        f"{os.path.basename(hw)} {s * 1e3:.0f} ms ({s / r['step_s']:.2f}×)" for hw, s in r["predicted_step_s"].items()
    )
    return (
        f"{name} ×{world} (dp,pp,tp)={r['layout']} micro-batch {r['micro_batch']} checkpointing "
        f"{r['checkpointing']}: {r['step_s'] * 1e3:.0f} ms/step, "
        f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {mfu}; "
        f"planner step time {predicted or 'n/a'} (predicted/measured); "
        f"max_memory_allocated {r['peak_mem_GB']:.2f} GB/GPU (max over ranks) vs planner "
        f"{r['predicted_mem_GB']:.2f} GB (model states {r['predicted_states_GB']:.2f} + activations "
        f"{r['predicted_activations_GB']:.2f}), loss {r['loss']:.3f}"
    )


if __name__ == "__main__":
    main()
