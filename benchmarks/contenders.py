"""One rank's side of a suite row: our trainer's step and PyTorch's equivalent,
built from the same recipe and weights, fed the same tokens.

A contender is ``step()`` (one optimizer step), ``state_bytes()`` (model-state
bytes this rank holds: parameters, gradients, optimizer state) and
``sent_bytes`` (bytes this rank sent during its last step, counted by
:class:`parallel.comm.CommCounter`; ``None`` where PyTorch's traffic cannot be
seen: DTensor's functional collectives and pipelining's p2p).
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile

import torch
import torch.distributed as dist

from parallel import comm
from parallel.pipeline.simulator import Span
from recipes.config import RecipeConfig
from recipes.training.gpt_engine import FUSED_ADAMW_DEVICES

from .common import counting_torch, ddp_comm_hook, torch_state_bytes
from .gpt import plain_like_ours, plain_loss, suite_model


class Ours:
    """Our whole training step (``recipes.training.trainer.Trainer.train_step``)."""

    def __init__(self, rc: RecipeConfig, record_timeline: bool = False):
        from recipes.training.trainer import Trainer

        self.trainer = Trainer(rc, run_dir=tempfile.gettempdir())
        self.trainer.engine.executor.record_timeline = record_timeline  # the suite records one extra step only
        self._steps = itertools.count()
        self.sent_bytes = 0.0

    def step(self) -> None:
        # an unlogged step (read=False), as PyTorch's side: no loss read, no grad norm (no clipping)
        self.sent_bytes = self.trainer.train_step(next(self._steps), read=False)["comm_bytes"]

    def state_bytes(self) -> int:
        return self.trainer.engine.zero.held_bytes()["total"]

    def timeline(self) -> list[Span]:
        """The last step's recorded computations, on the machine-wide perf_counter clock."""
        ex = self.trainer.engine.executor
        return [Span(s.action, s.start + ex.timeline_origin, s.end + ex.timeline_origin) for s in ex.timeline]


def _batches(trainer, step: int, dp: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of ``step`` for a layout with ``dp`` replicas (the
    same global batch our trainer's step ``step`` takes)."""
    t = trainer.rc.train
    return trainer.train_data.rank_microbatches(
        step, global_batch=t.global_batch, dp=dp, dp_rank=dp_rank, micro_batch=t.micro_batch, seed=t.seed
    )


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class Theirs:
    """PyTorch's own equivalent of a row, on the same recipe and initial weights.

    ``kind``: ``plain`` (one process, no wrapper), ``ddp``, ``zero_redundancy``
    (DDP + ZeroRedundancyOptimizer), ``fsdp2_zero2`` / ``fsdp2_zero3``
    (``fully_shard`` per block and root, without / with resharding after
    forward; both accumulate unsharded gradients and reduce-scatter once per step,
    ``set_requires_gradient_sync``, and ``fsdp2_zero2`` also keeps the parameters
    gathered between micro-batches, ``set_reshard_after_backward``), ``dtensor_tp``
    (``torch.distributed.tensor.parallel`` on the blocks: q/k/v/fc_in column-wise, o/fc_out row-wise: the plan torch's TP tutorial gives, on
    separate q/k/v projections as ours has), ``torch_1f1b`` /
    ``torch_interleaved`` (``torch.distributed.pipelining``), ``fsdp2_zero3_each`` (``fsdp2_zero3``
    with its default gradient sync: a reduce-scatter after every micro-batch's backward, into sharded
    gradients). DP kinds use the whole world as the data-parallel group."""

    def __init__(self, kind: str, ours: Ours):
        self.kind, tr = kind, ours.trainer
        rc, cfg = tr.rc, suite_model(tr.rc)
        self.trainer, self.cfg, self.sent_bytes = tr, cfg, None
        self._steps = itertools.count()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.dp, self.dp_rank = (world, rank) if kind in DP_KINDS else (1, 0)
        self.pipeline = kind.startswith("torch_")
        if self.pipeline:
            self.model, self.schedule = self._pipeline(kind, tr, cfg)
        else:
            self.model = self._wrapped(kind, plain_like_ours(cfg, rc.train.seed))
        params = [p for p in self.model.parameters()]
        o = rc.optim
        # the optimizer implementation ours uses (fused where torch has the kernel): one home, the recipe's
        fused = True if tr.device.type in FUSED_ADAMW_DEVICES else None
        hyper = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=fused)
        if kind == "zero_redundancy":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **hyper)
            self._held_optimizer = self.optimizer.optim
        else:
            # DTensor TP holds DTensors beside plain tensors (norms, embeddings): a fused kernel takes one
            # kind per call, and torch calls it once per parameter group
            kinds = [[p for p in params if is_dtensor(p) == d] for d in (True, False)]
            groups = [{"params": ps} for ps in kinds if ps]
            self.optimizer = self._held_optimizer = torch.optim.AdamW(groups, **hyper)

    @staticmethod
    def _wrapped(kind: str, model: torch.nn.Module) -> torch.nn.Module:
        if kind in ("ddp", "ddp_compiled", "zero_redundancy"):
            from torch.nn.parallel import DistributedDataParallel

            if kind == "ddp_compiled":  # DDP over the compiled model (dynamo splits graphs at its buckets)
                model = torch.compile(model)
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
            ddp.register_comm_hook(None, ddp_comm_hook)
            return ddp
        if kind.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            reshard = kind != "fsdp2_zero2"
            for block in model.blocks.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        if kind == "dtensor_tp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {}
            for i in model.blocks:
                plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc_in")})
                plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "fc_out")})
            return parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), plan)
        if kind == "plain":
            return model
        if kind == "plain_compiled":  # the whole model under torch.compile (inductor), as a user would
            return torch.compile(model)
        raise ValueError(f"unknown contender {kind!r}; known: {sorted(KINDS)}")

    @staticmethod
    def _pipeline(kind: str, tr, cfg):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        p = tr.rc.parallel
        n_virtual, rank = len(tr.ranges), tr.groups.pp_rank
        modules, stages = torch.nn.ModuleList(), []
        for virtual in range(rank, n_virtual, p.pp):  # the same chunks our trainer gave this rank
            module = plain_like_ours(
                cfg, tr.rc.train.seed, tr.ranges[virtual], has_embedding=virtual == 0, has_head=virtual == n_virtual - 1
            )
            modules.append(module)
            stages.append(PipelineStage(module, virtual, n_virtual, torch.device("cpu"), group=tr.groups.pp))
        m = tr.layout.grad_accum
        if kind == "torch_1f1b":
            return modules, Schedule1F1B(stages[0], n_microbatches=m, loss_fn=plain_loss)
        return modules, ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=plain_loss)

    def step(self) -> None:
        counter = None if self.kind in INVISIBLE else comm.CommCounter()
        batches = _batches(self.trainer, next(self._steps), self.dp, self.dp_rank)
        with counting_torch(counter):
            self.optimizer.zero_grad(set_to_none=True)  # gradients stay alive after the step, as ours
            self._pipeline_step(batches) if self.pipeline else self._accumulate(batches)
            self.optimizer.step()
        self.sent_bytes = counter.sent_bytes() if counter is not None else None

    def _accumulate(self, batches) -> None:
        m = len(batches)
        for i, (x, y) in enumerate(batches):
            last = i == m - 1
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
                # accumulate unsharded, one reduce-scatter; or (its default) reduce every micro-batch
                self.model.set_requires_gradient_sync(last or self.kind == "fsdp2_zero3_each")
                if self.kind == "fsdp2_zero2":  # as ours keeps ZeRO-2's parameters: no re-gather per micro-batch
                    self.model.set_reshard_after_backward(last)
            sync = self.model.no_sync() if hasattr(self.model, "no_sync") and not last else contextlib.nullcontext()
            with sync:
                (plain_loss(self.model(x), y) / m).backward()

    def _pipeline_step(self, batches) -> None:
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        first, last = self.model[0].has_embedding, self.model[-1].has_head
        args = (x,) if first else ()
        kwargs = dict(target=y, losses=[]) if last else {}
        self.schedule.step(*args, **kwargs)

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self._held_optimizer)


DP_KINDS = ("ddp", "ddp_compiled", "zero_redundancy", "fsdp2_zero2", "fsdp2_zero3", "fsdp2_zero3_each")
INVISIBLE = ("dtensor_tp", "torch_1f1b", "torch_interleaved")
KINDS = ("plain", "plain_compiled", *DP_KINDS, *INVISIBLE)
