"""The training loop every recipe shares, as one rank runs it.

Read top to bottom: validate the config (pure, before any collective) → join
the process group → build this rank's grid groups → build this rank's model
chunks (its pipeline stage's layers, its tensor-parallel shards) → wrap them
in ZeRO data parallelism → run the pipeline schedule step by step, logging on
rank 0.

Every layout runs the same math: the global batch of a step is fixed by
``(seed, step)``; DP ranks take disjoint slices; micro-batches are accumulated
through the pipeline schedule (``pp = 1`` is a one-stage pipeline); ZeRO
averages over DP; the loss reported is the mean over the global batch.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from models.transformer import build_model
from parallel import comm
from parallel.groups import ParallelGroups, build_groups, default_device, init_distributed
from parallel.layers import check_token_ids
from parallel.memory import SavedActivationMeter, peak_memory_bytes
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.partition import stage_chunks
from parallel.pipeline.schedules import Backward, Forward, build_schedule
from parallel.pipeline.simulator import Span
from parallel.pipeline.timeline import bubble_fraction, draw_timeline
from parallel.plan.shape import ModelShape, layer_partition, model_tflops_per_device
from parallel.precision import TORCH_DTYPES
from parallel.timing import StepClock
from parallel.topology import Topology
from parallel.zero import ZeroDataParallel

from . import checkpointing
from .config import Layout, RecipeConfig, validate
from .data import open_data
from .exits import finish_distributed
from .profiling import StepProfiler, profile_steps
from .runlog import RunLogger, lr_at, measured_matmul_tflops

COMPUTE_DTYPES = TORCH_DTYPES  # one home: parallel.precision
READ_KEYS = ("loss", "grad_norm", "skipped")  # the values train_step leaves on the device


def read_record(rec: dict[str, Any]) -> dict[str, Any]:
    """``rec`` with its device values (:data:`READ_KEYS`) read as Python numbers: one host read."""
    keys = [k for k in READ_KEYS if torch.is_tensor(rec.get(k))]
    if not keys:
        return rec
    values = torch.stack([rec[k].detach().float().reshape(()) for k in keys]).tolist()
    out = dict(rec, **dict(zip(keys, values)))
    if "skipped" in keys:
        out["skipped"] = bool(out["skipped"])
    return out


class StageChunks(nn.Module):
    """This rank's model chunks (one per virtual stage it holds) as one module,
    so ZeRO shards all of them together; ``forward(x, chunk)`` runs one."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        return self.chunks[chunk](x)


class ChunkView(nn.Module):
    """Chunk ``c`` seen through the ZeRO wrapper (what the pipeline executor calls)."""

    def __init__(self, zero: ZeroDataParallel, chunk: int):
        super().__init__()
        object.__setattr__(self, "_zero", zero)  # not a submodule: no double registration
        self.chunk = chunk
        self.inner = zero.module.chunks[chunk]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._zero(x, chunk=self.chunk)


class Trainer:
    """One rank's training state: groups, model chunks, ZeRO, executor, data."""

    def __init__(self, rc: RecipeConfig, run_dir: str | Path, layout: Layout | None = None):
        self.rc = rc
        self.run_dir = Path(run_dir)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # every rank, before any collective; once per process (a caller that validated passes its Layout)
        self.layout: Layout = layout if layout is not None else validate(rc, world_size=world)
        p, t = rc.parallel, rc.train
        threads = t.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(threads)
        self.owns_process_group = not torch.distributed.is_initialized()  # then train() destroys it at the end
        init_distributed(backend=p.backend, timeout_s=p.timeout_s)
        self.topology = Topology(self.layout.dp, p.pp, p.tp, world_size=world, order=p.order)
        self.groups: ParallelGroups = build_groups(self.topology, timeout_s=p.timeout_s)
        self.rank = self.groups.rank
        self.device = default_device(self.groups.backend)
        self.dtype = COMPUTE_DTYPES[t.precision]
        self.model_cfg = self.layout.model
        self._build_model()
        self._build_pipeline()
        self.train_data = self.open_data("train")
        if self.train_data.vocab_size > self.model_cfg.vocab_size:
            raise ValueError(
                f"the data's vocabulary ({self.train_data.vocab_size}) is larger than "
                f"model.vocab_size {self.model_cfg.vocab_size}; set model.vocab_size="
                f"{self.train_data.vocab_size}"
            )
        self.val_data = self.open_data("val") if t.eval_every else None
        self.step = 0

    def open_data(self, split: str):
        """The token dataset of ``split`` ("train" / "val") that ``rc.data`` names."""
        d = self.rc.data
        return open_data(d.source, d.path, split, self.model_cfg.seq_len, d.embedded_mb, d.val_fraction)

    # ------------------------------------------------------------------ model
    def _build_model(self) -> None:
        p, g, mc = self.rc.parallel, self.groups, self.model_cfg
        # the planner's split, so that its per-stage predictions describe this very run
        self.ranges = layer_partition(ModelShape.of(mc), p.pp, p.vpp, p.pp_layers)
        n_virtual = len(self.ranges)
        chunks = []
        for c, layers in enumerate(stage_chunks(self.ranges, p.pp, g.pp_rank)):
            virtual = c * p.pp + g.pp_rank
            chunks.append(
                build_model(
                    mc,
                    tp_group=g.tp,
                    sequence_parallel=p.sequence_parallel,
                    layers=layers,
                    has_embedding=virtual == 0,
                    has_head=virtual == n_virtual - 1,
                    device=self.device,
                    dtype=torch.float32,
                    seed=self.rc.train.seed,
                )
            )
        self.stage_module = StageChunks(chunks)
        units = [b for ch in chunks for b in ch.blocks.values()]
        o, t, cm = self.rc.optim, self.rc.train, self.rc.comm

        fused = True if self.device.type == "cuda" else None  # one kernel for all tensors; None: foreach

        def optimizer_factory(param_groups):
            if o.name == "sgd":
                return torch.optim.SGD(param_groups, lr=o.lr, weight_decay=o.weight_decay)
            return torch.optim.AdamW(
                param_groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=fused
            )

        self.zero = ZeroDataParallel(
            self.stage_module,
            dp_group=g.dp,
            stage=p.zero,
            optimizer_factory=optimizer_factory,
            units=units,
            precision=t.precision,
            comm_dtype=cm.dtype,
            bucket_mb=cm.bucket_mb,
            overlap=cm.overlap,
            grad_clip=t.grad_clip or None,
            tp_group=g.tp,
            embedding_group=g.embedding,
            clip_groups=[g.pp],
            compression=cm.compression,
            topk_ratio=cm.topk_ratio,
        )
        self.is_last_virtual = [c * p.pp + g.pp_rank == n_virtual - 1 for c in range(len(chunks))]

    def _build_pipeline(self) -> None:
        p, g, mc, lay = self.rc.parallel, self.groups, self.model_cfg, self.layout
        seq = mc.seq_len // p.tp if p.sequence_parallel else mc.seq_len
        self.schedule = build_schedule(p.pp_schedule, p.pp, lay.grad_accum, p.vpp)
        last_chunk = self.stage_module.chunks[-1]

        def loss_fn(logits, targets):
            loss = last_chunk.loss(logits, targets)
            return loss * self.zero.scaler.scale if self.zero.scaler else loss

        self.executor = PipelineExecutor(
            [ChunkView(self.zero, c) for c in range(len(self.stage_module.chunks))],
            self.schedule[g.pp_rank],
            pp_group=g.pp,
            activation_shape=(lay.micro_batch, seq, mc.d_model),
            dtype=self.dtype,
            loss_fn=loss_fn,
            tp_group=None if p.sequence_parallel else g.tp,
            embedding_group=None,  # ZeRO sums the tied-embedding gradient (on its shard, any stage)
            # ZeRO 0-1 run the step under no_sync(); each chunk's last backward launches its DP reduction
            final_backward=lambda chunk: self.zero.sync_gradients(),
        )

    # ------------------------------------------------------------------- step
    def microbatches(self, step: int, data=None, seed: int | None = None):
        """This rank's micro-batches of ``step``: its DP slice of the layout-independent global batch."""
        lay, t = self.layout, self.rc.train
        mbs = (data or self.train_data).rank_microbatches(
            step,
            global_batch=t.global_batch,
            dp=lay.dp,
            dp_rank=self.groups.dp_rank,
            micro_batch=t.micro_batch,
            seed=t.seed if seed is None else seed,
        )
        for x, y in mbs:  # on the host batch, before it moves: no device read per micro-batch
            check_token_ids(x, self.model_cfg.vocab_size)
            check_token_ids(y, self.model_cfg.vocab_size, what="targets")
        return [x.to(self.device) for x, _ in mbs], [y.to(self.device) for _, y in mbs]

    def evaluate(self, read: bool = True) -> float | torch.Tensor:
        """Mean loss over ``train.eval_batches`` fixed global batches of the held-out split.

        ``read=False``: the mean as a device tensor, unread."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        n = self.rc.train.eval_batches
        scale = self.zero.scaler.scale if self.zero.scaler else 1.0  # loss_fn multiplies by it
        for i in range(n):
            inputs, targets = self.microbatches(i, data=self.val_data, seed=self.rc.train.seed + 1)
            total += self.executor.run(inputs, targets, forward_only=True).float() / scale
        comm.all_reduce(total, group=self.groups.dp)
        mean = total / (n * self.layout.dp)
        return mean.item() if read else mean

    def train_step(self, step: int, measure_memory: bool = False, read: bool = True) -> dict[str, Any]:
        """One optimizer step over the global batch of ``step``; the record rank 0 logs.

        ``measure_memory``: also count the activations autograd saves (first step's report).
        ``read``: read the loss and the gradient norm on the host (one device
        synchronisation, inside the timed region, so ``step_time_s`` then covers the
        device's work). With ``read=False`` the step issues no host read of its own
        (see :mod:`parallel.zero.engine` for the skip decision): ``loss``,
        ``grad_norm`` and ``skipped`` stay device tensors and ``step_time_s`` is the
        host's (enqueueing) time; :func:`read_record` reads them when the loop logs.
        """
        o = self.rc.optim
        lr = lr_at(
            step,
            lr=o.lr,
            min_lr=o.min_lr,
            warmup_steps=o.warmup_steps,
            max_steps=self.rc.train.max_steps,
            schedule=o.schedule,
        )
        for group in self.zero.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = self.microbatches(step)
        scale = self.zero.scaler.scale if self.zero.scaler else 1.0  # loss_fn multiplies by it
        counter = comm.CommCounter()
        clock = StepClock(self.device)  # CUDA events on a GPU (host clocks would time enqueueing)
        t0, host_t0 = clock.mark(), time.perf_counter()
        meter = SavedActivationMeter(self.stage_module.parameters()) if measure_memory else None
        with counter, self.zero.no_sync(), meter or contextlib.nullcontext():
            loss = self.executor.run(inputs, targets)
        if meter is not None:  # per (micro-batch, chunk) × the most the schedule held at once
            pairs = self.layout.grad_accum * len(self.stage_module.chunks)
            self.activation_bytes = meter.bytes / pairs * self.executor.peak_activations
        with counter:
            stats = self.zero.step()
        if measure_memory:  # after the step: the optimizer state exists from its first step
            self.model_state_bytes = self.zero.held_bytes()
        loss = loss.detach().float() / scale
        with counter:
            comm.all_reduce(loss, group=self.groups.dp)  # mean over DP replicas = the global batch
        end = clock.mark()
        rec = {
            "loss": loss / self.layout.dp,
            "lr": lr,
            "grad_norm": stats["grad_norm"],
            "skipped": stats["skipped"],
            "loss_scale": float(stats["loss_scale"]),
        }
        host_s = time.perf_counter() - host_t0
        if read:
            rec = read_record(rec)  # waits for the device: the step's work is all in
            host_s = time.perf_counter() - host_t0
            elapsed = clock.seconds(t0, end)  # device time; resolving after the read waits for nothing
            rec.update(step_time_s=elapsed, comm_frac=min(1.0, counter.wait_seconds() / elapsed))
        else:  # no read: on a GPU the step is only enqueued, its events resolve later
            rec.update(step_time_s=host_s)
        rec.update(host_time_s=host_s, comm_bytes=counter.sent_bytes(), mem_gb=peak_memory_bytes(self.device) / 2**30)
        self.last_comm = counter
        return rec

    def timeline_step(self, step: int, path: str | Path) -> dict[str, Any]:
        """Train ``step`` while recording every stage's actions; rank 0 draws ``path`` (PNG).

        Collective. Stages start together (one world all-reduce), so the per-rank
        clocks are aligned to within that collective's skew. Returns the step's
        record with ``bubble`` (measured, from the recorded timeline) added.
        """
        comm.barrier()  # host-synchronising: a queued all-reduce would not align the clocks on NCCL
        self.executor.record_timeline = True
        try:
            rec = self.train_step(step)
        finally:
            self.executor.record_timeline = False
        kinds = {Forward: 0, Backward: 1}
        rows = [
            [
                sp.start,
                sp.end,
                kinds.get(type(sp.action), 2),
                getattr(sp.action, "mb", -1),
                getattr(sp.action, "chunk", -1),
            ]
            for sp in self.executor.timeline
        ]
        n = torch.tensor([len(rows)], dtype=torch.float64, device=self.device)
        comm.all_reduce(n, op=comm.ReduceOp.MAX)
        width = int(n.item())
        mine = torch.full((width, 5), -1.0, dtype=torch.float64, device=self.device)
        if rows:
            mine[: len(rows)] = torch.tensor(rows, dtype=torch.float64)
        every = torch.empty(self.topology.world_size * width * 5, dtype=torch.float64, device=self.device)
        comm.all_gather(every, mine.view(-1))
        every = every.view(self.topology.world_size, width, 5).cpu()
        timeline = []
        for stage in range(self.topology.pp):
            spans = []
            for start, end, kind, mb, chunk in every[self.topology.rank(dp=0, pp=stage, tp=0)].tolist():
                if kind < 0:
                    continue
                action = (Forward, Backward)[int(kind)](int(mb), int(chunk)) if kind < 2 else ()
                spans.append(Span(action, start, end))
            timeline.append(spans)
        rec["bubble"] = bubble_fraction(timeline)
        if self.rank == 0:
            draw_timeline(
                timeline,
                path,
                title=f"step {step + 1}: {self.rc.parallel.pp_schedule}, "
                f"pp={self.topology.pp}, m={self.layout.grad_accum}, vpp={self.rc.parallel.vpp}",
            )
        return rec

    def memory_report(self) -> str | None:
        """Rank 0: a table of what each rank class (pipeline stage) holds after the first step.

        Collective (every rank calls it): one all-gather of five numbers per rank.
        """
        ms = self.model_state_bytes
        mine = torch.tensor(
            [ms["params"], ms["grads"], ms["optimizer"], self.activation_bytes, peak_memory_bytes(self.device)],
            dtype=torch.float64,
            device=self.device,
        )
        world = self.topology.world_size
        every = torch.empty(world * 5, dtype=torch.float64, device=self.device)
        comm.all_gather(every, mine)
        if self.rank != 0:
            return None
        every = every.view(world, 5).cpu()
        try:  # the planner's figures for this very layout, beside the measured ones
            from .plan import plan_from_config

            plan = plan_from_config(self.rc)
            predicted = [r.memory["model_states"] + r.memory["activations"] for r in plan.ranks]
        except (ValueError, KeyError):
            predicted = None
        mb = 2**20
        lines = [
            "memory per rank after the first step (MiB; max over each stage's ranks)",
            f"{'stage':>5} {'ranks':>6} {'params':>9} {'grads':>9} {'optimizer':>9} "
            f"{'activations':>11} {'model+act':>9} {'predicted':>9} {'peak (process)':>14}",
        ]
        for stage in range(self.topology.pp):
            ranks = [r for r in range(world) if self.topology.coords(r).pp == stage]
            top = every[ranks].max(dim=0).values / mb
            pred = f"{predicted[stage] / mb:>9.1f}" if predicted else f"{'-':>9}"
            lines.append(
                f"{stage:>5} {len(ranks):>6} {top[0]:>9.1f} {top[1]:>9.1f} {top[2]:>9.1f} "
                f"{top[3]:>11.1f} {top[:4].sum():>9.1f} {pred} {top[4]:>14.1f}"
            )
        return "\n".join(lines)

    # ------------------------------------------------------ checkpoint (recipes/checkpointing.py)
    def state_dict(self) -> dict:
        """This rank's checkpoint pieces by global key (views into ZeRO's shards; no copies)."""
        return checkpointing.state_pieces(self)

    def load_state_dict(self, ckpt: str | Path) -> int:
        """Load a checkpoint directory saved by any layout; return the step to continue from."""
        return checkpointing.load(self, ckpt)


def train(rc: RecipeConfig, run_dir: str, layout: Layout | None = None) -> dict[str, Any]:
    """Run a whole training job as this rank; return a summary (rank 0's is the job's).
    ``layout``: :func:`recipes.config.validate`'s result for this world, if the caller has it."""
    trainer = Trainer(rc, run_dir, layout)
    is_rank0 = trainer.rank == 0
    t = rc.train
    log = RunLogger(
        run_dir,
        enabled=is_rank0,
        total_steps=t.max_steps,
        progress=rc.logger.progress,
        wandb_mode=rc.logger.wandb,
        wandb_project=rc.logger.project,
        config=OmegaConf.to_container(OmegaConf.structured(rc)),
    )
    if is_rank0:
        OmegaConf.save(OmegaConf.structured(rc), Path(run_dir) / "config.yaml")
        per_node = (
            rc.parallel.gpus_per_node
            if trainer.device.type == "cuda"
            else int(os.environ.get("LOCAL_WORLD_SIZE", trainer.topology.world_size))
        )
        log.info(trainer.topology.describe(per_node, device=trainer.device.type))
    tokens_per_step = t.global_batch * trainer.model_cfg.seq_len
    peak = rc.logger.peak_tflops or (measured_matmul_tflops() if trainer.device.type == "cpu" else None)
    world = trainer.topology.world_size
    last: dict[str, Any] = {}
    # --- checkpoint: resume, pre-emption (recipes/checkpointing.py) ---
    resume_from = checkpointing.find_resume_point(t.resume, run_dir)
    if resume_from is not None:
        log.info(f"resuming from {resume_from} (step {trainer.load_state_dict(resume_from)})")
        log.advance(trainer.step)
    preemption = checkpointing.Preemption(grace_s=t.sigterm_grace_s)
    preempted = False
    # --- end checkpoint ---
    profiler = StepProfiler(profile_steps(rc.logger.profile, t.max_steps), run_dir, trainer.rank, trainer.device)
    try:
        first = trainer.step  # 0, or the step a resumed checkpoint continues from
        window_start, window_steps = time.perf_counter(), 0  # wall time and steps since the last read
        for step in range(first, t.max_steps):
            checkpointing.fault_drill(t.fault, trainer.rank, step + 1)  # checkpoint: fault drills
            eval_due = bool(t.eval_every) and ((step + 1) % t.eval_every == 0 or step + 1 == t.max_steps)
            save_due = checkpointing.save_due(step + 1, rc)
            # the host reads the device (loss, norm) on logged steps only; a save reads it anyway
            read = (step + 1) % t.log_every == 0 or step == first or step + 1 == t.max_steps or eval_due or save_due
            profiler.before(step + 1)  # logger.profile
            if rc.logger.timeline and step == first + 1:  # a steady step (the first warms up, measures memory)
                rec = trainer.timeline_step(step, Path(run_dir) / "timeline.png")
            else:
                rec = trainer.train_step(step, measure_memory=step == first, read=read)
            profiler.after(step + 1)
            if step == first:
                report = trainer.memory_report()
                if report:
                    log.info(report)
            rec["step"] = step + 1
            window_steps += 1
            if read:  # the device has done every step since the last read: wall time is its time
                rec["tokens_per_s"] = tokens_per_step * window_steps / (time.perf_counter() - window_start)
                if peak:
                    rec["mfu"] = model_tflops_per_device(rec["tokens_per_s"], trainer.model_cfg, world) / peak
            if eval_due:
                rec["val_loss"] = trainer.evaluate()
            last = rec
            log.advance()
            if read:
                log.log(rec)
            # --- checkpoint: periodic / final save, SIGTERM → save and stop ---
            trainer.step = step + 1
            preempted = preemption.poll()  # every step, no host wait: agreed by all ranks one step late
            if save_due or preempted:
                path = checkpointing.save(
                    trainer,
                    on_written=lambda: checkpointing.fault_drill(t.fault, trainer.rank, trainer.step, where="save"),
                )
                log.info(f"checkpoint {path}")
            if preempted:
                if not read:
                    log.log(read_record(rec))
                log.info(f"SIGTERM: stopped after step {trainer.step} with a checkpoint")
                break
            # --- end checkpoint ---
            if read:  # evaluation, logging and saving are not training time
                window_start, window_steps = time.perf_counter(), 0
    finally:
        profiler.close()
        preemption.close()
        log.close()
    last = read_record(last)
    finish_distributed(trainer.device, owned=trainer.owns_process_group)  # a clean exit (recipes/exits.py)
    return {
        "final_loss": last.get("loss"),
        "val_loss": last.get("val_loss"),
        "steps": trainer.step,
        "run_dir": str(run_dir),
        "preempted": preempted,
    }
