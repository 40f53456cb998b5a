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

import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from models.config import ModelConfig
from models.transformer import build_model
from parallel import comm
from parallel.groups import ParallelGroups, build_groups, default_device, init_distributed
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.partition import partition_layers, stage_chunks
from parallel.pipeline.schedules import build_schedule
from parallel.topology import Topology
from parallel.zero import ZeroDataParallel

from . import checkpointing
from .config import Layout, RecipeConfig, validate
from .data import open_data
from .runlog import RunLogger, lr_at, measured_matmul_tflops

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def model_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), PaLM-style:
    6·N for the matmul parameters plus 12·L·d·s for attention scores."""
    d, L = cfg.d_model, cfg.n_layers
    kv = cfg.n_kv_heads * cfg.head_dim
    mlp_mats = 3 if cfg.arch == "llama" else 2
    n_block = d * (d + 2 * kv) + d * d + mlp_mats * d * cfg.d_ff
    n = L * n_block + cfg.vocab_size * d  # the head matmul
    return 6 * n + 12 * L * d * cfg.seq_len


class Trainer:
    """One rank's training state: groups, model chunks, ZeRO, executor, data."""

    def __init__(self, rc: RecipeConfig, run_dir: str | Path):
        self.rc = rc
        self.run_dir = Path(run_dir)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.layout: Layout = validate(rc, world_size=world)  # every rank, before any collective
        p, t = rc.parallel, rc.train
        threads = t.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(threads)
        init_distributed(backend=p.backend, timeout_s=p.timeout_s)
        self.topology = Topology(self.layout.dp, p.pp, p.tp, world_size=world, order=p.order)
        self.groups: ParallelGroups = build_groups(self.topology, timeout_s=p.timeout_s)
        self.rank = self.groups.rank
        self.device = default_device(self.groups.backend)
        self.dtype = COMPUTE_DTYPES[t.precision]
        self.model_cfg = self.layout.model
        self._build_model()
        self._build_pipeline()
        self.train_data = open_data(rc.data.source, rc.data.path, "train", self.model_cfg.seq_len,
                                    rc.data.embedded_mb, rc.data.val_fraction)
        if self.train_data.vocab_size > self.model_cfg.vocab_size:
            raise ValueError(
                f"the data's vocabulary ({self.train_data.vocab_size}) is larger than "
                f"model.vocab_size {self.model_cfg.vocab_size}; set model.vocab_size="
                f"{self.train_data.vocab_size}"
            )
        self.val_data = (open_data(rc.data.source, rc.data.path, "val", self.model_cfg.seq_len,
                                   rc.data.embedded_mb, rc.data.val_fraction)
                         if t.eval_every else None)
        self.step = 0

    # ------------------------------------------------------------------ model
    def _build_model(self) -> None:
        p, g, mc = self.rc.parallel, self.groups, self.model_cfg
        embedding_cost = 1.0 / max(1, mc.n_layers)  # the embedding is a lookup: cheap
        head_cost = (mc.vocab_size * mc.d_model) / (12 * mc.d_model**2 + 1)  # vs one block's matmuls
        self.ranges = partition_layers(mc.n_layers, p.pp, layer_cost=1.0, embedding_cost=embedding_cost,
                                       head_cost=head_cost, pp_layers=p.pp_layers, vpp=p.vpp)
        n_virtual = len(self.ranges)
        chunks = []
        for c, layers in enumerate(stage_chunks(self.ranges, p.pp, g.pp_rank)):
            virtual = c * p.pp + g.pp_rank
            chunks.append(build_model(
                mc, tp_group=g.tp, sequence_parallel=p.sequence_parallel, layers=layers,
                has_embedding=virtual == 0, has_head=virtual == n_virtual - 1,
                device=self.device, dtype=torch.float32, seed=self.rc.train.seed,
            ))
        self.stage_module = StageChunks(chunks)
        units = [b for ch in chunks for b in ch.blocks.values()]
        o, t, cm = self.rc.optim, self.rc.train, self.rc.comm

        def optimizer_factory(param_groups):
            if o.name == "sgd":
                return torch.optim.SGD(param_groups, lr=o.lr, weight_decay=o.weight_decay)
            return torch.optim.AdamW(param_groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                     weight_decay=o.weight_decay)

        self.zero = ZeroDataParallel(
            self.stage_module, dp_group=g.dp, stage=p.zero, optimizer_factory=optimizer_factory,
            units=units, precision=t.precision, comm_dtype=cm.dtype, bucket_mb=cm.bucket_mb,
            overlap=cm.overlap, grad_clip=t.grad_clip or None, tp_group=g.tp,
            embedding_group=g.embedding, clip_groups=[g.pp],
            compression=cm.compression, topk_ratio=cm.topk_ratio,
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
            self.schedule[g.pp_rank], pp_group=g.pp,
            activation_shape=(lay.micro_batch, seq, mc.d_model), dtype=self.dtype, loss_fn=loss_fn,
            tp_group=None if p.sequence_parallel else g.tp,
            embedding_group=None,  # ZeRO sums the tied-embedding gradient (on its shard, any stage)
        )

    # ------------------------------------------------------------------- step
    def microbatches(self, step: int, data=None, seed: int | None = None):
        """This rank's micro-batches of ``step``: its DP slice of the layout-independent global batch."""
        lay, t = self.layout, self.rc.train
        mbs = (data or self.train_data).rank_microbatches(
            step, global_batch=t.global_batch, dp=lay.dp, dp_rank=self.groups.dp_rank,
            micro_batch=t.micro_batch, seed=t.seed if seed is None else seed)
        return [x.to(self.device) for x, _ in mbs], [y.to(self.device) for _, y in mbs]

    def evaluate(self) -> float:
        """Mean loss over ``train.eval_batches`` fixed global batches of the held-out split."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        n = self.rc.train.eval_batches
        scale = self.zero.scaler.scale if self.zero.scaler else 1.0  # loss_fn multiplies by it
        for i in range(n):
            inputs, targets = self.microbatches(i, data=self.val_data, seed=self.rc.train.seed + 1)
            total += self.executor.run(inputs, targets, forward_only=True).float() / scale
        comm.all_reduce(total, group=self.groups.dp)
        return total.item() / (n * self.layout.dp)

    def train_step(self, step: int) -> dict[str, Any]:
        o = self.rc.optim
        lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                   max_steps=self.rc.train.max_steps, schedule=o.schedule)
        for group in self.zero.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = self.microbatches(step)
        scale = self.zero.scaler.scale if self.zero.scaler else 1.0  # loss_fn multiplies by it
        counter = comm.CommCounter()
        t0 = time.perf_counter()
        with counter, self.zero.no_sync():
            loss = self.executor.run(inputs, targets)
        with counter:
            stats = self.zero.step()
        loss = loss.detach().float() / scale
        comm.all_reduce(loss, group=self.groups.dp)  # mean over DP replicas = the global batch
        loss /= self.layout.dp
        elapsed = time.perf_counter() - t0
        return {"loss": loss.item(), "lr": lr, "grad_norm": float(stats["grad_norm"]),
                "skipped": bool(stats["skipped"]), "loss_scale": float(stats["loss_scale"]),
                "step_time_s": elapsed, "comm_bytes": counter.sent_bytes()}

    # ------------------------------------------------------ checkpoint (recipes/checkpointing.py)
    def state_dict(self) -> dict:
        """This rank's checkpoint pieces by global key (views into ZeRO's shards; no copies)."""
        return checkpointing.state_pieces(self)

    def load_state_dict(self, ckpt: str | Path) -> int:
        """Load a checkpoint directory saved by any layout; return the step to continue from."""
        return checkpointing.load(self, ckpt)


def train(rc: RecipeConfig, run_dir: str) -> dict[str, Any]:
    """Run a whole training job as this rank; return a summary (rank 0's is the job's)."""
    trainer = Trainer(rc, run_dir)
    is_rank0 = trainer.rank == 0
    t = rc.train
    log = RunLogger(run_dir, enabled=is_rank0, total_steps=t.max_steps, progress=rc.logger.progress,
                    wandb_mode=rc.logger.wandb, wandb_project=rc.logger.project,
                    config=OmegaConf.to_container(OmegaConf.structured(rc)))
    if is_rank0:
        OmegaConf.save(OmegaConf.structured(rc), Path(run_dir) / "config.yaml")
        log.info(trainer.topology.describe(rc.parallel.gpus_per_node))
    tokens_per_step = t.global_batch * trainer.model_cfg.seq_len
    flops_per_token = model_flops_per_token(trainer.model_cfg)
    peak = rc.logger.peak_tflops or (measured_matmul_tflops() if trainer.device.type == "cpu" else None)
    world = trainer.topology.world_size
    last: dict[str, Any] = {}
    # --- checkpoint: resume, pre-emption (recipes/checkpointing.py) ---
    resume_from = checkpointing.find_resume_point(t.resume, run_dir)
    if resume_from is not None:
        log.info(f"resuming from {resume_from} (step {trainer.load_state_dict(resume_from)})")
    preemption = checkpointing.Preemption(grace_s=t.sigterm_grace_s)
    preempted = False
    # --- end checkpoint ---
    try:
        for step in range(trainer.step, t.max_steps):
            checkpointing.fault_drill(t.fault, trainer.rank, step + 1)  # checkpoint: fault drills
            rec = trainer.train_step(step)
            rec["step"] = step + 1
            rec["tokens_per_s"] = tokens_per_step / rec["step_time_s"]
            if peak:
                rec["mfu"] = rec["tokens_per_s"] * flops_per_token / (peak * 1e12 * world)
            if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.max_steps):
                rec["val_loss"] = trainer.evaluate()
            last = rec
            log.advance()
            if (step + 1) % t.log_every == 0 or step == 0 or step + 1 == t.max_steps or "val_loss" in rec:
                log.log(rec)
            # --- checkpoint: periodic / final save, SIGTERM → save and stop ---
            trainer.step = step + 1
            preempted = preemption.requested()
            if checkpointing.save_due(trainer.step, rc) or preempted:
                path = checkpointing.save(trainer, on_written=lambda: checkpointing.fault_drill(
                    t.fault, trainer.rank, trainer.step, where="save"))
                log.info(f"checkpoint {path}")
            if preempted:
                log.info(f"SIGTERM: stopped after step {trainer.step} with a checkpoint")
                break
            # --- end checkpoint ---
    finally:
        preemption.close()
        log.close()
    return {"final_loss": last.get("loss"), "val_loss": last.get("val_loss"), "steps": trainer.step,
            "run_dir": str(run_dir), "preempted": preempted}
