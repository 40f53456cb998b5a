"""How long a checkpoint stops training: a background save against a synchronous one.

    python -m benchmarks.checkpoint                  # 25.6 M GPT (d 512, 8 layers), dp=2, ZeRO-1
    python -m benchmarks.checkpoint --d 128 --layers 4 --rounds 2
    python -m benchmarks.checkpoint --world 1 --d 2048 --layers 16   # one GPU (NCCL), or one CPU process

Each rank trains the suite's GPT (:func:`benchmarks.pipeline.zb_recipe`'s shape, dp ranks,
ZeRO-1: each rank saves its half of the fp32 master weights and Adam moments) and, round
by round, saves once synchronously and once in the background (alternating which goes
first), each after a few steps. Per save and rank it records

* the **stall**: the training thread's time inside the save call (synchronous: the whole
  save — DCP write, fsync, CRC32s, barriers, publication; background: waiting for the previous
  save, none here, and copying the pieces to host buffers; on a GPU the device is synchronised
  before and after, so the queued device-to-host copies count);
* for the background save, the writer's own time, and the time of the training steps that ran
  while it wrote against the steps before the save (on shared CPU cores the writer competes
  with training: that slowdown is reported beside the stall, not hidden in it).

The stall ratio is the median over rounds of (slowest rank's background stall) / (slowest
rank's synchronous stall); the issue's goal is < 10 %.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _rank(kwargs: dict, rounds: int, steps_between: int, run_dir: str):
    import torch.distributed as dist

    from recipes.training import checkpointing
    from recipes.training.trainer import Trainer

    from .pipeline import zb_recipe

    rc = zb_recipe(1, 2, **kwargs)  # one stage; two micro-batches per DP rank
    rc.parallel.dp, rc.parallel.zero = "auto", 1
    rc.train.global_batch = rc.train.micro_batch * 2 * int(os.environ["WORLD_SIZE"])
    rc.train.max_steps, rc.train.ckpt_keep = 10_000, 2
    trainer = Trainer(rc, run_dir)
    rc.train.ckpt_async = False
    sync = checkpointing.Saver(trainer)
    rc.train.ckpt_async = True
    background = checkpointing.Saver(trainer)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            trainer.train_step(trainer.step)
            trainer.step += 1
            out.append(time.perf_counter() - t0)
        return out

    steps(2)  # warm-up: the optimizer state exists from the first step on
    rows = []
    for r in range(rounds):
        row = {}
        for name in ("sync", "background") if r % 2 == 0 else ("background", "sync"):
            before = statistics.median(steps(steps_between))
            dist.barrier()
            _device_sync(trainer.device)
            t0 = time.perf_counter()
            (sync if name == "sync" else background).save()
            _device_sync(trainer.device)  # a GPU's queued device-to-host staging copies are part of the stall
            row[f"{name}_stall_s"] = time.perf_counter() - t0
            if name == "background":
                during = []
                while _any_busy(background, trainer.device):  # every rank steps the same number of times
                    during += steps(1)
                background.close()
                row["write_s"] = background.background.write_s
                row["steps_during"] = len(during)
                row["step_before_s"] = before
                row["step_during_s"] = statistics.median(during) if during else None
        rows.append(row)
    return rows


def _any_busy(saver, device) -> bool:
    """Whether any rank's writer is still busy: a MAX all-reduce, so that all ranks agree.

    Each rank's own ``busy`` flips at its own time; stepping while only the local writer is
    busy would leave ranks in different steps' collectives (a hang)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(saver.background.busy)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _device_sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_process(kwargs: dict, rounds: int, steps_between: int, run_dir: str):
    """A one-rank world in this process on the default backend (NCCL on a GPU: the device path)."""
    import torch.distributed as dist

    from parallel.groups import init_distributed

    from .gpu_mfu import _single_process_env

    _single_process_env()
    init_distributed()
    try:
        return [_rank(kwargs, rounds, steps_between, run_dir)]
    finally:
        dist.destroy_process_group()


def main(rounds: int = 3, steps_between: int = 3, world: int = 2, timeout_s: float = 1800, **kwargs) -> dict:
    """``world`` ranks (forked, gloo on the CPU); ``world=1``: this process, on the GPU if there is one.

    ``timeout_s`` bounds the forked ranks (a hang fails with every rank's stack)."""
    from parallel.testing import run_ranks

    from .common import quantile

    with tempfile.TemporaryDirectory() as run_dir:
        if world == 1:
            per_rank = _one_process(kwargs, rounds, steps_between, run_dir)
        else:
            per_rank = run_ranks(_rank, world, kwargs, rounds, steps_between, run_dir, timeout=timeout_s)
    slowest = [
        {k: max(r[i][k] for r in per_rank if r[i][k] is not None) for k in per_rank[0][i] if k != "steps_during"}
        for i in range(rounds)
    ]
    ratios = [row["background_stall_s"] / row["sync_stall_s"] for row in slowest]
    out = dict(
        world=world,
        **kwargs,
        sync_stall_s=statistics.median(r["sync_stall_s"] for r in slowest),
        background_stall_s=statistics.median(r["background_stall_s"] for r in slowest),
        stall_ratio=statistics.median(ratios),
        stall_ratio_iqr=(quantile(ratios, 0.25), quantile(ratios, 0.75)),
        write_s=statistics.median(r["write_s"] for r in slowest),
        step_before_s=statistics.median(r["step_before_s"] for r in slowest),
        step_during_s=statistics.median(r["step_during_s"] for r in slowest if "step_during_s" in r),
        rounds=slowest,
    )
    print(
        f"stall per save: synchronous {out['sync_stall_s'] * 1e3:.0f} ms, background "
        f"{out['background_stall_s'] * 1e3:.0f} ms (ratio {out['stall_ratio']:.1%}, IQR "
        f"{out['stall_ratio_iqr'][0]:.1%}–{out['stall_ratio_iqr'][1]:.1%}); the writer took "
        f"{out['write_s'] * 1e3:.0f} ms, steps meanwhile {out['step_during_s'] * 1e3:.0f} ms vs "
        f"{out['step_before_s'] * 1e3:.0f} ms before (shared cores)"
    )
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-between", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    main(a.rounds, a.steps_between, a.world, d=a.d, n_layers=a.layers, seq=a.seq)
