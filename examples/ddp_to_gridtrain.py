"""DDP → gridtrain: ``ddp_plain.py`` is a plain PyTorch DDP script, ``ddp_to_gridtrain.py`` the same on gridtrain.

An MLP classifier trained on synthetic data with gradient accumulation (``no_sync``), clipping, AdamW
and warm-up. Moving it to :class:`parallel.zero.ZeroDataParallel` (ZeRO stages 0–3, fp16/bf16, a
DeepSpeed JSON read by :mod:`recipes.tools.deepspeed`) changes only the lines that
``diff -u examples/ddp_plain.py examples/ddp_to_gridtrain.py`` shows: the model code is identical,
``model.backward(loss)`` applies the fp16 loss scale, and ``model.step()`` reduces the gradients,
clips and steps the optimizer on this rank's shard. ``tests/examples/test_ddp_migration.py`` checks
that both give the same losses at every stage and that the diff stays within 20 lines.

Run either on two CPU processes (gloo), under torchrun or spawning them itself::

    torchrun --nproc-per-node=2 -m examples.ddp_plain --steps 10
    python -m examples.ddp_to_gridtrain --steps 10 --deepspeed examples/ds_ddp_migration.json
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.zero import ZeroConfig, ZeroDataParallel
from recipes.tools.deepspeed import load_deepspeed_json

CONFIG = dict(global_batch=16, micro_batch=4, lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIG.update(grad_clip=1.0, warmup_steps=5)
CONFIG.update(zero=0, precision="fp32", overlap=True, dtype=None, bucket_mb=25, name="adamw")  # DeepSpeed's too


class Net(nn.Module):
    """An MLP classifier: the user's model, untouched by the move."""

    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def batch(step: int, micro: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``micro``-th micro-batch of ``step``: inputs and the labels of a fixed linear teacher."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(size, 32, generator=torch.Generator().manual_seed(step * 1_000_003 + micro * 1009 + rank))
    return x, (x @ teacher).argmax(dim=1)


def train(cfg: dict, steps: int) -> list[float]:
    """Train ``steps`` optimizer steps on every rank; return each step's loss (mean over the global batch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = cfg["global_batch"] // (cfg["micro_batch"] * world)
    torch.manual_seed(0)  # the same initial weights on every rank
    make_optimizer = lambda params: torch.optim.AdamW(
        params, lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"], weight_decay=cfg["weight_decay"]
    )
    zero = ZeroConfig(stage=cfg["zero"], precision=cfg["precision"], overlap=cfg["overlap"], comm_dtype=cfg["dtype"],
        bucket_mb=cfg["bucket_mb"], grad_clip=cfg["grad_clip"])  # fmt: skip
    model = ZeroDataParallel(Net(), zero, dp_group=dist.group.WORLD, optimizer_factory=make_optimizer)
    opt = model.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg["warmup_steps"]))
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(accum):
            x, y = batch(step, m, rank, cfg["micro_batch"])
            with model.no_sync() if m < accum - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y) / accum
                model.backward(loss)
            total += loss.detach().float()
        model.step()  # reduces, clips, steps the optimizer on this rank's shard
        model.zero_grad()
        sched.step()
        losses.append(total)
    out = torch.stack(losses)
    dist.all_reduce(out)  # one read at the end, not one per step
    return (out / world).tolist()


def main(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    """One rank: join the gloo group (torchrun's variables, or set here for a spawned rank), train, print the losses."""
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    joined = not dist.is_initialized()  # the tests (parallel.testing.run_ranks) have joined already
    if joined:
        dist.init_process_group("gloo")
    cfg = dict(CONFIG)
    if args.deepspeed:  # recipe keys ("train.micro_batch", "parallel.zero", ...) by their last part
        cfg.update({k.split(".")[1]: v for k, v in load_deepspeed_json(args.deepspeed, dist.get_world_size()).items()})
    if cfg.pop("name") != "adamw" or cfg.pop("log_every", None):
        raise SystemExit("this example trains with AdamW and prints once, at the end")
    losses = train(cfg, args.steps)
    if dist.get_rank() == 0:
        print(" ".join(f"{v:.6f}" for v in losses))
    if joined:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--deepspeed", help="a DeepSpeed JSON config (see recipes/tools/deepspeed.py)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        main(-1, -1, args)
    else:
        torch.multiprocessing.spawn(main, args=(2, args), nprocs=2)
