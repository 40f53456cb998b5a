"""One training step of one rank, in one place: :class:`StepEngine`.

The engine owns, each exactly once: the rank's model chunks (one per virtual
pipeline stage it holds) under ZeRO data parallelism, the pipeline schedule and
its executor, the gradient reductions (DP through ZeRO — each chunk's last backward
launches its reduction; the tied embedding and replicated tensor-parallel parameters
are reduced by ZeRO, on its shard), the clipping and the optimizer step (ZeRO's
``step``). The fp16 loss scale is ZeRO's: ``zero.scale_loss`` applies it, ``zero.step``
(gradients) and ``zero.unscale_loss`` (the loss value) remove it. Following one batch:

    step(inputs, targets) → executor.run (forwards/backwards of the schedule on
    ``zero.scale_loss(loss)``; ZeRO 0–1 accumulate under ``no_sync`` and reduce in each
    chunk's final backward) → ``zero.unscale_loss`` of the summed loss → ZeroDataParallel.step
    (÷ dp·scale, clip, optimizer, publish) → the loss averaged over DP when the step is
    read (:class:`PendingLoss`: an unread step issues no loss collective).

It takes process groups and modules as arguments and knows nothing of the
models or the recipes (the dependency rule of ``docs/architecture.md``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .checkpoint import prepare_optimizer_state, publish, zero_state_pieces
from .checkpoint.zero_state import whole_tensor_pieces
from .layers.moe import router_biases, update_router_bias_
from .memory import SavedActivationMeter, peak_memory_bytes
from .params import init_key
from .pieces import chunks_from_pieces  # noqa: F401 (re-exported: from_pieces' split)
from .pipeline.executor import PipelineExecutor
from .pipeline.schedules import Action, build_schedule
from .pipeline.transfers import transfer_split
from .stats import READ_KEYS, PendingLoss, read_stats, reduce_stats  # noqa: F401 (the engine's read API)
from .timing import StepClock
from .zero import DynamicLossScaler, ZeroConfig, ZeroDataParallel


class ModelChunks(nn.Module):
    """A rank's model chunks (one per virtual stage it holds) as one module, so that ZeRO
    shards all of them together; ``forward(x, chunk)`` runs chunk ``chunk``."""

    def __init__(self, chunks: Sequence[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def forward(self, x: torch.Tensor, chunk: int = 0, **context: Any) -> torch.Tensor:
        return self.chunks[chunk](x, **context)

    def global_names(self) -> dict[str, str]:
        """Local parameter name → layout-independent name: the ``chunks.<c>.`` prefix dropped;
        a parameter marked ``init_key`` (a tied head is the embedding) takes that name."""
        return {local: init_key(p, re.sub(r"^chunks\.\d+\.", "", local)) for local, p in self.named_parameters()}


class _ChunkCall:
    """Chunk ``chunk`` called through ZeRO (its compute-dtype cast): what the executor runs.
    Not a module, so nothing is registered twice."""

    def __init__(self, zero: ZeroDataParallel, chunk: int):
        self.zero, self.chunk = zero, chunk

    def __call__(self, x: torch.Tensor, **context: Any) -> torch.Tensor:
        return self.zero(x, chunk=self.chunk, **context)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.zero.module.chunks[self.chunk].parameters()


class StepEngine:
    """One rank's training step: chunks under ZeRO, the pipeline schedule, loss scaling,
    gradient reduction, clipping and the optimizer step.

    Args:
        chunks: the rank's model chunks, chunk ``c`` being virtual stage ``c·pp + pp_rank``.
        actions: this stage's action list (or the whole schedule) from
            :func:`parallel.pipeline.schedules.build_schedule`.
        loss_fn: ``loss_fn(output, targets)``, the mean loss of one micro-batch (last stage).
        groups: ``dp``, ``pp``, ``tp`` process groups (``None``: that dimension is 1);
            ``embedding_group`` sums a tied embedding's gradient (ZeRO does it, on its shard).
        activation_shape: one micro-batch's activation between stages.
        compute_dtype: the dtype of activations (and of ZeRO's compute parameters).
        sequence_parallel: activations between stages are sequence-sharded over TP.
        zero: ZeRO's settings (:class:`~parallel.zero.ZeroConfig`); ``optimizer_factory``,
            ``units``, ``loss_scaler`` and the further groups (``clip_groups``, ``expert_group``,
            ``ep_group``) go to :class:`~parallel.zero.ZeroDataParallel` as they are, except that the
            gradient norm always sums over ``pp_group`` too (listed or not: counted once), so every
            stage clips by the whole model's norm, as one process does.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        actions: Sequence[Action] | Sequence[Sequence[Action]],
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        zero: ZeroConfig,
        optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer],
        dp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup,
        tp_group: dist.ProcessGroup | None = None,
        embedding_group: dist.ProcessGroup | None = None,
        clip_groups: Sequence[dist.ProcessGroup | None] = (),
        expert_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None,
        units: Sequence[nn.Module] | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        activation_shape: Sequence[int],
        compute_dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ):
        self.model = ModelChunks(chunks)
        self.dp_group = dp_group
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.zero = ZeroDataParallel(
            self.model,
            zero,
            optimizer_factory=optimizer_factory,
            dp_group=dp_group,
            tp_group=tp_group,
            embedding_group=embedding_group,
            # the norm spans the whole model: every pipeline stage's gradients, whatever the caller lists
            clip_groups=[pp_group, *(g for g in clip_groups if g is not pp_group)],
            expert_group=expert_group,
            ep_group=ep_group,
            units=units,
            loss_scaler=loss_scaler,
        )
        self.executor = PipelineExecutor(
            [_ChunkCall(self.zero, c) for c in range(len(chunks))],
            actions,
            pp_group=pp_group,
            activation_shape=activation_shape,
            dtype=compute_dtype,
            loss_fn=lambda out, targets: self.zero.scale_loss(loss_fn(out, targets)),
            tp_group=tp_group if transfer_split(comm.group_size(tp_group), sequence_parallel) > 1 else None,
            embedding_group=None,  # ZeRO sums the tied-embedding gradient (on its shard, any stage)
            # ZeRO 0-1 run the step under no_sync(); each chunk's last backward launches its DP reduction
            final_backward=lambda chunk: self.zero.sync_gradients(),
        )
        # the groups whose ranks route different tokens: dp (spans ep, and cp), tp under sequence parallelism
        self.routing_groups = (dp_group, tp_group) if sequence_parallel else (dp_group,)
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self.activation_bytes = 0.0  # saved activations at the schedule's peak (a measured step)
        self.model_state_bytes: dict = {}
        self.last_comm: comm.CommCounter | None = None

    @classmethod
    def from_pieces(
        cls,
        first: nn.Module,
        blocks: Sequence[nn.Module],
        last: nn.Module,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        pp_group: dist.ProcessGroup,
        microbatches: int,
        schedule: str = "1f1b",
        vpp: int = 1,
        embedding_cost: float = 0.0,
        head_cost: float = 0.0,
        pp_layers: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> StepEngine:
        """An engine for a model given as pieces (:func:`parallel.pieces.chunks_from_pieces`: checkpoint
        keys ``first.…``, ``blocks.<i>.…``, ``last.…`` for every split): this rank's chunks of the
        cost-balanced split (``pp_layers``: the blocks of each rank), scheduled by ``schedule`` over
        ``microbatches`` micro-batches per step; ``kwargs`` as for the constructor."""
        pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        costs = dict(embedding_cost=embedding_cost, head_cost=head_cost, pp_layers=pp_layers)
        chunks = chunks_from_pieces(first, blocks, last, pp=pp, pp_rank=pp_rank, vpp=vpp, **costs)
        actions = build_schedule(schedule, pp, microbatches, vpp)[pp_rank]
        return cls(chunks, actions, loss_fn=loss_fn, pp_group=pp_group, **kwargs)

    # ---------------------------------------------------------------- the step
    def set_lr(self, lr: float) -> None:
        """Set every parameter group's learning rate (the loop's schedule)."""
        for group in self.zero.optimizer.param_groups:
            group["lr"] = lr

    def step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        *,
        context: Sequence[dict] | None = None,
        read: bool = True,
        measure_memory: bool = False,
        norm: bool | None = None,
        gather: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches; the step's stats. ``context``: per
        micro-batch, keyword arguments for every chunk on every stage (:meth:`PipelineExecutor.run
        <parallel.pipeline.executor.PipelineExecutor.run>`), such as packed documents' ``positions``.

        ``loss`` is the mean over the DP replicas (the global batch). ``read``: reduce the
        loss (a 4-byte ``broadcast`` over PP from the last stage, a 4-byte ``all_reduce``
        over DP) and read ``loss``, ``grad_norm``, ``skipped`` on the host (one device
        synchronisation, inside the timed region, so ``step_time_s`` is device time).
        Otherwise the step issues no loss collective: ``loss`` is a :class:`PendingLoss`
        (:func:`read_stats` reduces and reads it, :func:`reduce_stats` only reduces it; every
        rank of the step's groups must then do so at the same step), ``grad_norm``/``skipped``
        stay device tensors, None unless the step clips or scales the loss (nothing needs
        the norm: it is not computed), and ``step_time_s`` is host (enqueueing) time.
        ``measure_memory``: also record :attr:`activation_bytes` (autograd's saved activations
        at the schedule's peak) and :attr:`model_state_bytes`. ``norm``: compute the gradient
        norm (its collectives) even unread; None: when read (a dry run of a logged step passes True).
        ``gather`` (read steps): this rank's few numbers (its step and data time, on the device), all-gathered
        over the world with the loss's reduction and read with it: ``rank_times``, rank by rank.
        """
        counter = comm.CommCounter()
        clock = StepClock(self.device)  # CUDA events on a GPU (host clocks would time enqueueing)
        t0, host_t0 = clock.mark(), time.perf_counter()
        meter = SavedActivationMeter(self.model.parameters()) if measure_memory else None
        with counter, self.zero.no_sync(), meter or contextlib.nullcontext():
            loss = self.executor.run(
                inputs, targets, context=context, share_loss=False
            )  # shared when read (PendingLoss)
        loss = self.zero.unscale_loss(loss)  # before the step, which may change the scale
        if meter is not None:  # per (micro-batch, chunk) × the most the schedule held at once
            pairs = len(inputs or targets) * len(self.model.chunks)
            self.activation_bytes = meter.bytes / pairs * self.executor.peak_activations
        with counter:
            stats = self.zero.step(norm=read if norm is None else norm)  # unread: no norm unless it clips or scales
            # aux-loss-free balancing (DeepSeek-V3): the routers' selection biases follow this step's load,
            # summed over the ranks that routed other tokens (dp, which spans ep, × cp; × tp under SP)
            update_router_bias_(self.model, self.routing_groups)
        if measure_memory:  # after the step: the optimizer state exists from its first step
            self.model_state_bytes = self.zero.held_bytes()
        # the mean over the DP replicas (the global batch), reduced only when read: an unread step
        # issues no loss collective (torchtitan likewise reduces the loss on logged steps only)
        pending = PendingLoss(loss, share=self.executor.share_loss, dp_group=self.dp_group, dp=self.dp)
        rec = {
            "loss": pending,
            "grad_norm": stats["grad_norm"],
            "skipped": stats["skipped"],
            "loss_scale": float(stats["loss_scale"]),
        }
        if read:
            with counter:
                pending.reduce()
                if gather is not None:  # the stragglers: every rank's times, in the same read
                    rec["rank_times"] = every = gather.new_empty(gather.numel() * dist.get_world_size())
                    comm.all_gather(every, gather)
        end = clock.mark()
        host_s = time.perf_counter() - host_t0
        if read:
            rec = read_stats(rec)  # waits for the device: the step's work is all in
            host_s = time.perf_counter() - host_t0
            elapsed = clock.seconds(t0, end)  # device time; resolving after the read waits for nothing
            rec.update(step_time_s=elapsed, comm_frac=min(1.0, counter.wait_seconds() / elapsed))
        else:  # no read: on a GPU the step is only enqueued, its events resolve later
            rec.update(step_time_s=host_s)
        rec.update(host_time_s=host_s, comm_bytes=counter.sent_bytes(), mem_gb=peak_memory_bytes(self.device) / 2**30)
        self.last_comm = counter
        return rec

    def evaluate(self, batches: Sequence[tuple]) -> torch.Tensor:
        """Forward-only mean loss over ``batches`` (``(inputs, targets)`` or ``(inputs, targets,
        context)`` per global batch, as for :meth:`step`), averaged over DP: a device tensor, unread."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for inputs, targets, *context in batches:  # each batch's mean, summed on the last stage; shared once at the end
            run = self.executor.run(
                inputs, targets, context=(context or [None])[0], forward_only=True, share_loss=False
            )
            total += self.zero.unscale_loss(run)
        self.executor.share_loss(total)
        comm.all_reduce(total, group=self.dp_group)
        return total / (len(batches) * self.dp)

    @contextlib.contextmanager
    def recording_timeline(self) -> Iterator[None]:
        """Within: steps keep the executor's :class:`~parallel.pipeline.simulator.Span` list
        (:attr:`timeline`) of every computation and transfer."""
        self.executor.record_timeline = True
        try:
            yield
        finally:
            self.executor.record_timeline = False

    @property
    def timeline(self) -> list:
        return self.executor.timeline

    # -------------------------------------------------------------- checkpoint
    def checkpoint_pieces(self, tp_group: dist.ProcessGroup | None = None) -> dict[str, object]:
        """This rank's model and optimizer state as ``{global key: Chunked | tensor}`` views
        (see :mod:`parallel.checkpoint.zero_state`); no collective, no copy."""
        names = self.model.global_names()
        pieces = zero_state_pieces(self.zero, global_name=names.__getitem__, tp_group=tp_group)
        biases = {re.sub(r"^chunks\.\d+\.", "", n): t for n, t in router_biases(self.model).items()}
        return pieces | whole_tensor_pieces(biases, "buffer/")  # DeepSeek's router biases: all experts' everywhere

    def prepare_load(self, saved: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Create the optimizer state a checkpoint holds (``saved``: key → (shape, dtype)),
        so :meth:`checkpoint_pieces` has views to load into."""
        names = self.model.global_names()
        prepare_optimizer_state(self.zero, saved, names.__getitem__)

    def finish_load(self, scaler_state: dict | None) -> None:
        """After loading into :meth:`checkpoint_pieces`: publish the master weights to the
        compute parameters and restore the fp16 loss scaler."""
        publish(self.zero)
        if self.zero.scaler and scaler_state:
            self.zero.scaler.load_state_dict(scaler_state)

    def scaler_state(self) -> dict | None:
        """The fp16 loss scaler's state (``None`` without one)."""
        return self.zero.scaler.state_dict() if self.zero.scaler else None
