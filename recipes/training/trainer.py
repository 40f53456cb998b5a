"""The training loop every recipe shares, as one rank runs it.

Read top to bottom: validate the config (pure, before any collective) → join
the process group → build this rank's grid groups → build this rank's step
engine (:func:`recipes.training.gpt_engine.build_gpt_engine`: its GPT chunks under ZeRO,
the pipeline schedule; :class:`parallel.engine.StepEngine` owns the step) → the
loop: learning rate, evaluation, logging, checkpoint policy, profiler, timeline, and the step's
guards (:mod:`recipes.training.guards`: hang watchdog, stragglers, fault drills, OOM forensics).

Every layout runs the same math: the global batch of a step is fixed by
``(seed, step)``; DP ranks take disjoint slices; micro-batches are accumulated
through the pipeline schedule (``pp = 1`` is a one-stage pipeline); ZeRO
averages over DP; the loss reported is the mean over the global batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from parallel.checkpoint import latest_checkpoint
from parallel.compile import compile_report, compile_stats, use_inductor_cache
from parallel.engine import read_stats
from parallel.groups import ParallelGroups, build_groups, default_device, init_distributed
from parallel.layers import Fp8Recipe, check_token_ids_together, enable_fp8
from parallel.layers.moe import moe_metrics
from parallel.plan.shape import model_flops_per_token, tflops_per_device
from parallel.precision import FP8, TORCH_DTYPES, base_precision
from parallel.topology import Topology

from ..config import Layout, RecipeConfig
from ..validation import validate
from . import checkpointing, runlock
from .data import open_data
from .divergence import SkipWatch, stop_message
from .exits import EXIT_DIVERGED, LauncherWatch, finish_distributed
from .flight import dump_now
from .flight import install as install_flight_dumps
from .gpt_engine import build_gpt_engine
from .guards import StepGuards
from .prefetch import Prefetcher
from .profiling import StepProfiler, profile_steps
from .reports import cpu_wait_clock, memory_report, time_report, timeline_step
from .runlog import RunLogger, lr_at, measured_matmul_tflops
from .target_model import build_target_engine

COMPUTE_DTYPES = TORCH_DTYPES  # one home: parallel.precision


class Trainer:
    """One rank's training state: groups, the step engine (model chunks, ZeRO, pipeline), data."""

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
        self.topology = Topology(self.layout.dp, p.pp, p.tp, p.cp, ep=p.ep, world_size=world, order=p.order)
        self.groups: ParallelGroups = build_groups(self.topology, timeout_s=p.timeout_s)
        self.rank = self.groups.rank
        self.device = default_device(self.groups.backend)
        self.dtype = COMPUTE_DTYPES[base_precision(t.precision)]  # fp8: a bf16 run, its TP GEMMs in fp8
        self.model_cfg = self.layout.model
        # train.compile: inductor's kernels under the run (parallel/compile.py), set before anything compiles
        self.compile_cache = use_inductor_cache(run_dir) if t.compile and t.compile_backend == "inductor" else None
        if rc.model.target:  # your own model, given as pieces (recipes/training/target_model.py)
            built = build_target_engine(rc, self.layout, self.groups, self.device, self.dtype)
            self.ranges, self.engine, self.flops_per_token = built
        else:
            self.ranges, self.engine = build_gpt_engine(rc, self.layout, self.groups, self.device, self.dtype)
            self.flops_per_token = model_flops_per_token(self.model_cfg)  # the MFU numerator
        if t.precision == FP8:  # the blocks' linears only: the head and the embedding stay bf16
            blocks = [b for ch in self.engine.model.chunks for b in ch.blocks.values()]
            enable_fp8(blocks, Fp8Recipe(t.fp8_recipe, emulate=t.fp8_emulate))
        self.train_data = self.open_data("train")
        if self.train_data.vocab_size > self.model_cfg.vocab_size:
            raise ValueError(
                f"the data's vocabulary ({self.train_data.vocab_size}) is larger than "
                f"model.vocab_size {self.model_cfg.vocab_size}; set model.vocab_size="
                f"{self.train_data.vocab_size}"
            )
        self.val_data = self.open_data("val") if t.eval_every else None
        self.prefetch = Prefetcher(self.host_microbatches)  # its thread starts at the first read
        self.step = 0
        self.guards = None  # the loop's StepGuards (recipes/training/guards.py): data time, stragglers

    def open_data(self, split: str):
        """The token dataset of ``split`` ("train" / "val") that ``rc.data`` names."""
        d = self.rc.data
        seq = self.model_cfg.seq_len
        return open_data(d.source, d.path, split, seq, d.embedded_mb, d.val_fraction, d.sampling, d.blend, d.packing)

    def microbatches(self, step: int, data=None, seed: int | None = None):
        """This rank's micro-batches of ``step``: its DP slice of the layout-independent global batch,
        on the device. The training split's host batches are read one step ahead in a background
        thread (:class:`.prefetch.Prefetcher`); only the copy to the device is on the step's path."""
        host = self.prefetch.get(step) if data is None and seed is None else self.host_microbatches(step, data, seed)
        inputs, targets, *positions = ([t.to(self.device, non_blocking=True) for t in ts] for ts in zip(*host))
        if positions:  # packing=documents: every stage's chunks take them (parallel.engine.StepEngine.step)
            return inputs, targets, [{"positions": p} for p in positions[0]]
        return inputs, targets

    def host_microbatches(self, step: int, data=None, seed: int | None = None) -> list:
        """The host side of :meth:`microbatches`: ids checked against the vocabulary, pinned on CUDA."""
        lay, t = self.layout, self.rc.train
        mbs = (data or self.train_data).rank_microbatches(
            step,
            global_batch=t.global_batch,
            dp=lay.dp,
            dp_rank=self.groups.dp_rank,
            micro_batch=t.micro_batch,
            seed=t.seed if seed is None else seed,
            cp=self.rc.parallel.cp,
            cp_rank=self.groups.cp_rank,
        )
        # on the host batch, before it moves (no device read), the whole step's ids in one pass
        check_token_ids_together(
            [(t, what) for x, y, *_ in mbs for t, what in ((x, "token ids"), (y, "targets"))], self.model_cfg.vocab_size
        )
        if self.device.type == "cuda":  # a pinned source makes the non-blocking copy asynchronous
            mbs = [tuple(t.pin_memory() for t in mb) for mb in mbs]
        return mbs

    def evaluate(self, read: bool = True) -> float | torch.Tensor:
        """Mean loss over ``train.eval_batches`` fixed global batches of the held-out split
        (``read=False``: a device tensor, unread)."""
        seed = self.rc.train.seed + 1
        mean = self.engine.evaluate(
            [self.microbatches(i, data=self.val_data, seed=seed) for i in range(self.rc.train.eval_batches)]
        )
        return mean.item() if read else mean

    def train_step(
        self, step: int, measure_memory: bool = False, read: bool = True, norm: bool | None = None
    ) -> dict[str, Any]:
        """One optimizer step over the global batch of ``step`` at its learning rate; the record
        rank 0 logs (see :meth:`parallel.engine.StepEngine.step` for ``read`` and ``measure_memory``)."""
        o = self.rc.optim
        lr = lr_at(
            step,
            lr=o.lr,
            min_lr=o.min_lr,
            warmup_steps=o.warmup_steps,
            max_steps=self.rc.train.max_steps,
            schedule=o.schedule,
        )
        self.engine.set_lr(lr)
        g = self.guards
        inputs, targets, *context = (
            g.read_data(step + 1, lambda: self.microbatches(step)) if g else self.microbatches(step)
        )
        gather = g.gather() if g and read else None  # every rank's times, read with the loss (the stragglers)
        step_kw = dict(read=read, measure_memory=measure_memory, norm=norm, gather=gather)
        stats = self.engine.step(inputs, targets, context=context[0] if context else None, **step_kw)
        return {"lr": lr, **stats}

    # ------------------------------------------------------ checkpoint (recipes/training/checkpointing.py)
    def state_dict(self) -> dict:
        """This rank's checkpoint pieces by global key (views into ZeRO's shards; no copies)."""
        return checkpointing.state_pieces(self)

    def load_state_dict(self, ckpt: str | Path) -> int:
        """Load a checkpoint directory saved by any layout; return the step to continue from."""
        return checkpointing.load(self, ckpt)


def _report_first_steps(trainer, log: RunLogger, step: int, first: int, step_t0: float, read: bool) -> None:
    """The first step's memory table and the second's step time beside the planner's (collective
    on the first step: every rank calls this every step)."""
    if step == first and (report := memory_report(trainer)):
        log.info(report)
    if step == first and trainer.rc.train.compile:  # compiled during the first step: said once
        log.info(compile_report(compile_stats(), trainer.compile_cache))
    if step == first + 1:  # a steady step against the planner's time (reports.time_report)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        if report := time_report(trainer, time.perf_counter() - step_t0, read):  # like with like
            log.info(report)


def _open_log(trainer, rc: RecipeConfig, run_dir: str) -> RunLogger:
    log = RunLogger(
        run_dir,
        enabled=trainer.rank == 0,
        total_steps=rc.train.max_steps,
        progress=rc.logger.progress,
        wandb_mode=rc.logger.wandb,
        wandb_project=rc.logger.project,
        config=OmegaConf.to_container(OmegaConf.structured(rc)),
    )
    if trainer.rank == 0:
        OmegaConf.save(OmegaConf.structured(rc), Path(run_dir) / "config.yaml")
        per_node = (
            rc.parallel.gpus_per_node
            if trainer.device.type == "cuda"
            else int(os.environ.get("LOCAL_WORLD_SIZE", trainer.topology.world_size))
        )
        log.info(trainer.topology.describe(per_node, device=trainer.device.type))
    return log


def _resume(trainer, log: RunLogger, resume: str | None, run_dir: str) -> None:
    """``train.resume``: load the checkpoint it finds; a resumed run's ``metrics.jsonl`` loses the rows
    logged after that step (by the attempt that died), which it logs again: no step appears twice."""
    resume_from = checkpointing.find_resume_point(resume, run_dir)
    if resume_from is not None:
        log.info(f"resuming from {resume_from} (step {trainer.load_state_dict(resume_from)})")
        log.advance(trainer.step)
    if resume and (dropped := log.drop_rows_after(trainer.step)):
        log.info(f"metrics.jsonl: dropped {dropped} row(s) after step {trainer.step}, logged before the restart")


def _save_or_hold(saver, log: RunLogger, skips: SkipWatch, trainer, on_written, preempted: bool) -> None:
    """A due checkpoint, unless the latest step was skipped (then its weights give inf/NaN gradients:
    the previous checkpoint stays the newest). A pre-emption saves regardless: nothing is lost."""
    if skips.holds_save and not preempted:
        log.warn(
            f"the checkpoint of step {trainer.step} is not written: the last {skips.streak} step(s) were skipped "
            f"(inf/NaN gradients); the previous checkpoint stays the newest"
        )
        return
    saver.save(on_written=on_written)  # it says where


def train(rc: RecipeConfig, run_dir: str, layout: Layout | None = None) -> dict[str, Any]:
    """Run a whole training job as this rank; return a summary (rank 0's is the job's).
    ``layout``: :func:`recipes.validation.validate`'s result for this world, if the caller has it.
    A run the divergence policy stopped returns ``stopped`` (the reason, with the checkpoint to go
    back to) and ``exit_code``; a worker whose launcher died leaves at once (exits.LauncherWatch)."""
    trainer = Trainer(rc, run_dir, layout)
    t = rc.train
    launched = "LOCAL_RANK" in os.environ  # a worker of the self-spawn or of torchrun (not a test's rank)
    launcher = LauncherWatch(launched)
    if launched:
        runlock.register_worker(run_dir, trainer.rank)  # the run lock covers this process too
    log = _open_log(trainer, rc, run_dir)
    tokens_per_step = t.global_batch * trainer.model_cfg.seq_len
    peak = rc.logger.peak_tflops or (measured_matmul_tflops() if trainer.device.type == "cpu" else None)
    world = trainer.topology.world_size
    last: dict[str, Any] = {}
    _resume(trainer, log, t.resume, run_dir)  # checkpoint: resume (recipes/training/checkpointing.py)
    preemption = checkpointing.Preemption(t.sigterm_grace_s, on_signal=lambda name: dump_now(run_dir, name))
    install_flight_dumps(run_dir)  # kill -USR1 <pid>: this rank's flight recorder to <run>/flight
    saver = checkpointing.Saver(trainer, preemption=preemption, say=log.info)  # train.ckpt_async: in the background
    skips = SkipWatch(t.max_skipped_steps, trainer.device, lr=rc.optim.lr, grad_clip=t.grad_clip, precision=t.precision)
    preempted, stopped = False, None
    profiler = StepProfiler(profile_steps(rc.logger.profile, t.max_steps), run_dir, trainer.rank, trainer.device)
    trainer.guards = guards = StepGuards(trainer, run_dir)  # watchdog, drills, stragglers, memory forensics
    try:
        first = trainer.step  # 0, or the step a resumed checkpoint continues from
        window_start, window_steps = time.perf_counter(), 0  # wall time and steps since the last read
        cpu_wait = cpu_wait_clock(rc)  # calibrated CPU profiles only: this process's wait for a CPU
        window_rq = cpu_wait() if cpu_wait else 0.0
        for step in range(first, t.max_steps):
            checkpointing.fault_drill(t.fault, trainer.rank, step + 1)  # checkpoint: fault drills
            eval_due = bool(t.eval_every) and ((step + 1) % t.eval_every == 0 or step + 1 == t.max_steps)
            save_due = checkpointing.save_due(step + 1, rc)
            # the host reads the device (loss, norm) on logged steps only; a save reads it anyway. Every rank
            # decides from the step number alone: a read reduces the loss over DP and PP (collective,
            # parallel.engine.PendingLoss), which an unread step does not
            read = (step + 1) % t.log_every == 0 or step == first or step + 1 == t.max_steps or eval_due or save_due
            profiler.before(step + 1)  # logger.profile
            guards.begin(step + 1)  # the flight recorder's phase, the watchdog's clock, the drills
            step_t0 = time.perf_counter()
            if rc.logger.timeline and step == first + 1:  # a steady step (the first warms up, measures memory)
                rec = timeline_step(trainer, step, Path(run_dir) / "timeline.png", read=read)
            else:
                rec = trainer.train_step(step, measure_memory=step == first, read=read)
            profiler.after(step + 1)
            _report_first_steps(trainer, log, step, first, step_t0, read)
            skips.after_step(rec)  # the divergence policy's counts, on the device (no host read)
            rec["step"] = step + 1
            guards.after(step + 1, rec)  # read: the slowest rank and its lag
            window_steps += 1
            if read:  # the device has done every step since the last read: wall time is its time
                rec["tokens_per_s"] = tokens_per_step * window_steps / (time.perf_counter() - window_start)
                if cpu_wait:  # per step
                    rec["runqueue_s"] = (cpu_wait() - window_rq) / window_steps
                if peak:
                    rec["mfu"] = tflops_per_device(rec["tokens_per_s"], trainer.flops_per_token, world) / peak
                rec.update(trainer.train_data.metrics(step + 1, t.global_batch))
                rec.update(moe_metrics(trainer.engine.model))  # MoE: router loss, tokens per expert, dropped
            if eval_due:
                rec["val_loss"] = trainer.evaluate()
            last = rec
            log.advance()
            trainer.step = step + 1
            if read:
                log.log(rec)
                verdict = skips.check(trainer.step, rec)  # every rank: the same numbers, the same verdict
                for warning in verdict.warnings:
                    log.warn(warning)
                if verdict.stop:  # before any save: the last good checkpoint stays the newest
                    stopped = verdict.stop
                    break
            # --- checkpoint: periodic / final save, SIGTERM → save and stop ---
            preempted = preemption.poll()  # every step, no host wait: agreed by all ranks one step late
            guards.watchdog.end()  # the step's collectives are all issued: saves are not timed
            if launcher.gone():  # its launcher was killed: no save, no barrier with its dead store
                launcher.stop(trainer.rank, trainer.step)
            saver.poll()  # says a published background save; raises a failed one here, at once
            if save_due or preempted:

                def on_written(at=trainer.step):  # the drill's step is bound now: a background writer calls it later
                    checkpointing.fault_drill(t.fault, trainer.rank, at, where="save")
                    if launcher.gone():  # written, not published: a dead launcher's job publishes nothing
                        launcher.stop(trainer.rank, trainer.step)

                _save_or_hold(saver, log, skips, trainer, on_written, preempted)
            if saver.stopped:  # the storage refused a save, train.ckpt_on_error=stop: all ranks stop here
                break
            if preempted:
                if not read:  # an unlogged step computed no norm: log what it has, no nulls. Every rank
                    # reads (the loss's reduction is collective; `preempted` is agreed by all ranks)
                    log.log({k: v for k, v in read_stats(rec).items() if v is not None})
                log.info(f"SIGTERM: stopped after step {trainer.step} with a checkpoint")
                break
            # --- end checkpoint ---
            if read:  # evaluation, logging and saving are not training time
                window_start, window_steps = time.perf_counter(), 0
                window_rq = cpu_wait() if cpu_wait else 0.0
        saver.close()  # the end of training waits for the last save
    except torch.OutOfMemoryError as e:
        guards.out_of_memory(e)  # its bytes by kind beside the planner's; a CUDA snapshot
        raise
    finally:
        for part in (guards, profiler, preemption, log, trainer.prefetch):  # the data thread stops reading ahead
            part.close()
    last = read_stats(last)  # the last step was read, or reduced by the pre-emption log: no collective here
    finish_distributed(trainer.device, owned=trainer.owns_process_group)  # a clean exit (recipes/training/exits.py)
    summary = {
        "final_loss": last.get("loss"),
        "val_loss": last.get("val_loss"),
        "steps": trainer.step,
        "run_dir": str(run_dir),
        "preempted": preempted,
        "stopped": saver.stop_message(),  # a save the storage refused stopped the run (recipes/main.py: exit 1)
    }
    if stopped:  # the launcher (or, under torchrun, every rank) prints it as the last line and exits non-zero
        latest = latest_checkpoint(checkpointing.checkpoint_root(run_dir))
        summary.update(stopped=stop_message(stopped, trainer.step, latest, t.ckpt_every), exit_code=EXIT_DIVERGED)
    return summary
