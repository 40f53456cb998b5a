"""What must hold on a GPU, run on the CUDA device when there is one and on the CPU otherwise.

``benchmarks/gpu_check.sh`` runs these (``pytest -m cuda``) on a real GPU; CI runs them on the CPU, where
they check the same code path against the same references. Each test runs in one forked rank whose default
process group is NCCL on the GPU (gloo on the CPU), so tensors handed to collectives live where NCCL wants.
Nothing here runs autograd in the pytest process itself: on a CUDA build that would make every forked child fail
("Unable to handle autograd's threading in combination with fork-based multiprocessing").
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.testing import run_ranks
from parallel.zero import ZeroConfig, ZeroDataParallel

from .parallel.zero.toy import LR, WD, batches, make_model, reference_run
from .recipes.test_train_e2e import tiny_recipe

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device_world() -> torch.device:
    """In a one-rank run_ranks child: make the default group NCCL on the GPU (stays gloo on the CPU)."""
    if DEVICE.type == "cuda":
        from parallel.groups import init_distributed

        dist.destroy_process_group()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
        init_distributed(backend="nccl")
    return DEVICE


def _fused_adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WD, fused=True)  # what the trainer uses on CUDA


def _zero_on_device(stage):
    device = _device_world()
    model = make_model().to(device)
    zdp = ZeroDataParallel(
        model,
        ZeroConfig(stage=stage, overlap=True, grad_clip=None),
        dp_group=dist.group.WORLD,
        optimizer_factory=_fused_adamw,
        units=list(model.blocks),
    )
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(zdp(x.to(device)), y.to(device))
        zdp.backward(loss)
        zdp.step()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu() for n, p in zdp.full_parameters().items()}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_zero_with_fused_adamw_on_the_device_matches_one_cpu_process(stage):
    # plain module + torch.optim.AdamW (foreach) on the CPU, in a child too: on a CUDA build of torch a backward
    # in this (pytest) process starts autograd's device threads, and every later forked child then fails
    ref_losses, _, ref_params = run_ranks(reference_run, 1, timeout=120)[0]
    losses, params = run_ranks(_zero_on_device, 1, stage, timeout=120)[0]
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, atol=1e-4, rtol=1e-4)


def _fused_vs_foreach():
    device = _device_world()
    torch.manual_seed(0)
    ws = [torch.randn(64, 32), torch.randn(32), torch.randn(7, 5, 3)]
    runs = {}
    for kind, dev in (("fused", device), ("foreach", torch.device("cpu"))):
        params = [nn.Parameter(w.clone().to(dev)) for w in ws]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **{kind: True})
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(dev)
            opt.step()
        runs[kind] = [p.detach().cpu() for p in params]
    return runs


def test_fused_adamw_on_the_device_matches_foreach_adamw_on_the_cpu():
    runs = run_ranks(_fused_vs_foreach, 1, timeout=120)[0]
    for a, b in zip(runs["fused"], runs["foreach"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _trainer_losses(on_device: bool, **overrides):
    from recipes.training.trainer import Trainer

    if on_device:
        _device_world()
    rc = tiny_recipe(train__max_steps=3, **overrides)
    rc.parallel.backend = None if on_device else "gloo"
    trainer = Trainer(rc, run_dir=".")
    assert trainer.device.type == (DEVICE.type if on_device else "cpu")
    assert all(p.device.type == trainer.device.type for p in trainer.engine.model.parameters())
    losses = [trainer.train_step(step)["loss"] for step in range(3)]
    return losses, str(trainer.device)


#: what runs differently on a device: host buffers (pinned), side streams and events (offload), the
#: router's host read and the experts' grouped dispatch (MoE), full fp32 gradients kept across micro-batches
VARIANTS = {
    "zero1": {},
    "offload_optimizer": dict(parallel__zero=1, parallel__offload="optimizer"),
    "offload_params": dict(parallel__zero=3, parallel__offload="optimizer+params"),
    "zero3_unsharded": dict(parallel__zero=3, parallel__zero_accumulate="unsharded"),
    "moe": dict(model__moe_experts=4, model__moe_top_k=2),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_rank_trainer_on_the_device_matches_the_cpu(variant):
    """The whole step on the device (executor, ZeRO buckets, fused AdamW, TP layers at tp=1, vocab-parallel
    cross-entropy, and per variant offload's pinned buffers and streams, MoE, ZeRO-3) gives the CPU's losses."""
    cpu, _ = run_ranks(_trainer_losses, 1, False, timeout=180, **VARIANTS[variant])[0]
    dev, where = run_ranks(_trainer_losses, 1, True, timeout=180, **VARIANTS[variant])[0]
    assert where.startswith(DEVICE.type)
    assert dev == pytest.approx(cpu, abs=2e-4)
