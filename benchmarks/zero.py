"""Our ZeRO stages 0-3 against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2, side by side.

    python -m benchmarks.zero [--ranks 2] [--d 256] [--blocks 4] [--steps 20] [--batch 32]

Same model (an MLP of pre-norm residual blocks), same data, same AdamW, the
same CPU ranks (gloo, one thread each), and gloo's own collectives on both sides
(:func:`parallel.comm.gloo.tune_gloo` off). Per configuration:

* ``step_ms``: median wall time of forward + backward + optimizer step, and its
  ratio to DDP's;
* ``state_MB``: model-state bytes per rank (parameters + gradients + optimizer
  state) counted from the tensors held right after backward, when gradients
  and optimizer state are both alive (stage 3 / FSDP2 also hold one gathered
  block transiently during forward and backward; not counted);
* ``sent_MB``: bytes sent per rank per step on the data-parallel group, from
  :class:`parallel.comm.CommCounter`. Ours go through ``parallel.comm``;
  PyTorch's are counted the same way: DDP through a comm hook that all-reduces
  with ``parallel.comm``, ZeroRedundancyOptimizer and FSDP2 by wrapping the
  ``torch.distributed`` collectives they call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.comm.gloo import tune_gloo
from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel

from .common import COUNT_TORCH, count_torch_collectives, ddp_comm_hook, torch_state_bytes


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make_model(d: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(blocks)], nn.Linear(d, 1))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _build(kind: str, d: int, blocks: int):
    model = make_model(d, blocks)
    if kind.startswith("ours"):
        stage = int(kind[-1])
        zdp = ZeroDataParallel(
            model, ZeroConfig(stage=stage), dp_group=dist.group.WORLD, optimizer_factory=adamw, units=list(model)[:-1]
        )
        return zdp, zdp.backward, zdp.step, lambda: zdp.held_bytes()["total"]
    if kind in ("ddp", "zero_redundancy"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, ddp_comm_hook)
        opt = (
            adamw(ddp.parameters())
            if kind == "ddp"
            else ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        )
        state = lambda: torch_state_bytes(model, opt.optim if kind != "ddp" else opt)  # noqa: E731
        return ddp, lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()), state
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in list(model)[:-1]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = adamw(model.parameters())
        return (
            model,
            lambda loss: loss.backward(),
            lambda: (opt.step(), opt.zero_grad()),
            lambda: torch_state_bytes(model, opt),
        )
    raise ValueError(f"unknown configuration {kind!r}")


def _run(kinds, d, blocks, steps, batch):
    tune_gloo(False)  # gloo's own collectives on both sides (the algorithms NCCL runs), before any is chosen
    count_torch_collectives()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, d, generator=g), torch.randn(batch, generator=g)) for _ in range(steps + 3)]
    rows = {}
    for kind in kinds:
        model, backward, step, state_bytes = _build(kind, d, blocks)
        COUNT_TORCH["on"] = not kind.startswith("ours")
        times, counter, held = [], comm.CommCounter(), 0
        for i, (x, y) in enumerate(data):
            x, y = x.chunk(dist.get_world_size())[rank], y.chunk(dist.get_world_size())[rank]
            comm.barrier()
            t0 = time.perf_counter()
            with counter if i == len(data) - 1 else _nothing():
                backward(nn.functional.mse_loss(model(x).squeeze(-1), y))
                held = max(held, state_bytes())
                step()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        rows[kind] = {
            "step_ms": 1e3 * statistics.median(times),
            "state_MB": held / 2**20,
            "sent_MB": counter.sent_bytes() / 2**20,
        }
    return rows


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


KINDS = ["ddp", "ours0", "zero_redundancy", "ours1", "ours2", "fsdp2", "ours3"]
LABELS = {
    "ddp": "torch DDP",
    "zero_redundancy": "torch ZeroRedundancyOptimizer",
    "fsdp2": "torch FSDP2 fully_shard",
    "ours0": "ours stage 0",
    "ours1": "ours stage 1",
    "ours2": "ours stage 2",
    "ours3": "ours stage 3",
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args(argv)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # pay torch.optim's first-use import once
    rows = run_ranks(_run, a.ranks, KINDS, a.d, a.blocks, a.steps, a.batch, timeout=600)[0]
    psi = sum(p.numel() for p in make_model(a.d, a.blocks).parameters())
    print(
        f"{a.ranks} CPU ranks (gloo), model {psi / 1e6:.2f} M params ({4 * psi / 2**20:.1f} MB fp32), "
        f"AdamW, global batch {a.batch}, median of {a.steps} steps"
    )
    print(f"| {'configuration':30} | step ms | vs DDP | state MB/rank | sent MB/step/rank |")
    print(f"| {'-' * 30} | ------: | -----: | ------------: | ----------------: |")
    for kind in KINDS:
        r = rows[kind]
        print(
            f"| {LABELS[kind]:30} | {r['step_ms']:7.1f} | {r['step_ms'] / rows['ddp']['step_ms']:6.2f} | "
            f"{r['state_MB']:13.2f} | {r['sent_MB']:17.2f} |"
        )
    return rows


if __name__ == "__main__":
    main()
