"""The trainer's checkpoints: what goes in, when, resuming, pre-emption, fault drills.

A checkpoint (``<run dir>/checkpoints/step_<n>/``, written by
:func:`parallel.checkpoint.save_checkpoint`) holds

* the fp32 master weights and every optimizer state tensor, as *global*
  tensors by layout-independent name (``model/blocks.3.attn.q_proj.weight``,
  ``optim/<name>/exp_avg`` ...), each rank writing the pieces its ZeRO shard of
  its TP shard covers — so any dp/pp/tp/vpp/ZeRO stage loads it;
* each rank's RNG states (``rng/<rank>/cpu``), restored only into the same layout;
* in the manifest (JSON): the step (which is also the data position and the LR
  schedule position — both are pure functions of the step), the fp16 loss
  scaler, the layout it was saved with and the whole config.

Resuming the same layout is bit-exact in fp32; another layout continues within
float rounding (the reductions add in another order).

With ``train.ckpt_async`` (the default) a save copies the pieces to host memory and
returns; a writer thread writes and publishes them
(:class:`parallel.checkpoint.BackgroundSaver`): the next save, and the end of
training, wait for it, and the loop's per-step :meth:`Saver.poll` raises a failed
write at once (see ``docs/checkpoint.md``).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import torch
from omegaconf import OmegaConf

from parallel import comm
from parallel.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    saved_tensors,
    verify_checkpoint,
)

from .drills import PROCESS_KINDS
from .resume import checkpoint_root, find_resume_point, is_verified, note_verified

CKPT_ON_ERROR = ("stop", "continue")  # train.ckpt_on_error: what a save the storage refuses does
SIGNALLED, SAVE_FAILED = 1, 2  # Preemption's agreed codes (the larger wins)


def layout_of(trainer) -> dict:
    p = trainer.rc.parallel
    return {
        "world_size": trainer.topology.world_size,
        "dp": trainer.layout.dp,
        "pp": p.pp,
        "tp": p.tp,
        "cp": p.cp,
        "vpp": p.vpp,
        "zero": p.zero,
        "sequence_parallel": p.sequence_parallel,
        "pp_schedule": p.pp_schedule,
        "precision": trainer.rc.train.precision,
    }


def state_pieces(trainer, *, with_rng: bool = True) -> dict:
    """This rank's part of the checkpoint: ``{key: Chunked | tensor}`` (views, no copies)."""
    state = trainer.engine.checkpoint_pieces(tp_group=trainer.groups.tp)
    if with_rng:
        state[f"rng/{trainer.rank}/cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and trainer.device.type == "cuda":
            state[f"rng/{trainer.rank}/cuda"] = torch.cuda.get_rng_state(trainer.device)
    return state


def _meta(trainer, config: dict | None = None) -> dict:
    """The manifest's facts; ``config``: the config as plain data, if already converted."""
    return {
        "step": trainer.step,
        "layout": layout_of(trainer),
        "scaler": trainer.engine.scaler_state(),
        "config": config if config is not None else OmegaConf.to_container(OmegaConf.structured(trainer.rc)),
    }


def save(trainer, *, on_written=None, needed: int | None = None) -> Path:
    """Save the trainer's state at ``trainer.step`` (collective over the world), synchronously.
    ``needed``: a checkpoint's bytes, for the message of a full disk."""
    return save_checkpoint(
        state_pieces(trainer),
        checkpoint_root(trainer.run_dir),
        trainer.step,
        meta=_meta(trainer),
        keep=trainer.rc.train.ckpt_keep,
        on_written=on_written,
        needed=needed,
    )


def load(trainer, ckpt: str | Path) -> int:
    """Load ``ckpt`` (any layout's) into the trainer; return the step to continue from. Its sums are
    checked here unless this resume already checked them (:mod:`recipes.training.resume`: once)."""
    manifest = None
    if not is_verified(ckpt):
        manifest = verify_checkpoint(ckpt)
        note_verified(ckpt)
    manifest = manifest or read_manifest(ckpt)
    trainer.engine.prepare_load(saved_tensors(ckpt))
    same_layout = manifest["meta"].get("layout") == layout_of(trainer)
    state = state_pieces(trainer, with_rng=same_layout)
    load_checkpoint(state, ckpt, verify=False)
    trainer.engine.finish_load(manifest["meta"].get("scaler"))
    if same_layout:
        torch.set_rng_state(state[f"rng/{trainer.rank}/cpu"])
        if f"rng/{trainer.rank}/cuda" in state:
            torch.cuda.set_rng_state(state[f"rng/{trainer.rank}/cuda"], trainer.device)
    trainer.step = int(manifest["step"])
    return trainer.step


def save_due(step: int, rc) -> bool:
    t = rc.train
    return bool((t.ckpt_every and step % t.ckpt_every == 0) or (t.ckpt_at_end and step == t.max_steps))


class Preemption:
    """Turns SIGTERM (Slurm pre-emption, torchrun shutting down) or SIGINT (Ctrl-C reaches every
    worker of a terminal's job) into "checkpoint, then stop"; :meth:`close` joins the watchdog.

    :meth:`poll`, called by every rank at the end of every step, agrees on the flag
    across ranks (a 4-byte ``all_reduce`` MAX over the world), so all ranks save the
    same step and stop together even if the signal reached only some. It never makes
    the host wait for the step's work: it reads the previous step's agreed flag, copied
    to the host asynchronously and long finished, so a signal is acted upon one step
    after it arrives (``grace_s`` must cover one step plus the save). A rank that cannot
    reach a step's end — blocked in a collective with a dead peer, which is how
    torchrun's SIGTERM usually finds the survivors of a failure — must still
    die: a watchdog thread wakes on the signal at once (``signal.set_wakeup_fd``
    writes even while the main thread is inside C++) and exits the process
    with status 143 if the main thread has not acknowledged it within
    ``grace_s`` seconds. ``on_signal(name)``, if given, runs on that thread as the
    signal arrives (the trainer dumps its flight recorder there).

    The same agreement carries a request to stop without a save (:meth:`request`
    ``SAVE_FAILED``: a rank's background save was refused by the storage); the larger code
    wins, and :attr:`agreed` holds the code every rank agreed on (0 until then).
    """

    agreed = 0  # the code the ranks agreed on: 0, SIGNALLED or SAVE_FAILED
    _asked = 0  # this rank's request besides a signal (request())

    def __init__(self, grace_s: float, on_signal=None):
        self.flag = False
        self.grace_s = grace_s
        self.on_signal = on_signal  # called by the watcher thread as the signal arrives (the flight dump)
        self._pending: tuple | None = None  # the previous poll's (copy event, host flag)
        self._device_flag: torch.Tensor | None = None
        self._acknowledged = threading.Event()
        self._installed = threading.current_thread() is threading.main_thread()  # signals need it
        if not self._installed:
            return
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        self._thread = threading.Thread(target=self._watch, name="sigterm-watchdog", daemon=True)
        self._thread.start()

    def _handle(self, signum, frame) -> None:
        self.flag = True

    def request(self, code: int) -> None:
        """Ask every rank to stop for ``code`` (``SAVE_FAILED``); agreed by the next polls."""
        self._asked = max(self._asked, code)

    def _watch(self) -> None:
        try:
            while True:
                data = self._read.recv(64)
                if not data:
                    return  # closed
                if signal.SIGTERM in data or signal.SIGINT in data:
                    self.flag = True
                    if self.on_signal is not None:  # at once, even with the main thread stuck in C++
                        self.on_signal("SIGTERM" if signal.SIGTERM in data else "SIGINT")
                    if not self._acknowledged.wait(self.grace_s):
                        os._exit(128 + signal.SIGTERM)
                    return
        except OSError:
            return

    def poll(self) -> bool:
        """Collective over the world, every rank at the end of every step: True once every rank
        has seen the previous call's agreement that some rank was signalled.

        Queues this call's MAX all-reduce of the local flag and an asynchronous copy of the
        result to the host, then returns the previous call's result: on a GPU its copy finished
        a whole step ago, so the event wait costs nothing (no stream synchronisation); on gloo
        the all-reduce has completed on return. Every rank therefore decides on the same step."""
        agreed = 0
        if self._pending is not None:
            done, host = self._pending
            if done is not None:
                done.synchronize()
            agreed = int(host.numpy()[0])  # host memory: no device read
        if self._device_flag is None:
            self._device_flag = torch.zeros(1, device=comm.device_for())
        local = max(SIGNALLED if self.flag else 0, self._asked)
        flag = self._device_flag.fill_(float(local))  # a kernel, not a host-to-device copy
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        if flag.device.type == "cuda":  # one pinned buffer and event, reused: the last copy was read above
            done, host = self._pending or (torch.cuda.Event(), torch.empty(1, pin_memory=True))
            host.copy_(flag, non_blocking=True)
            done.record()
            self._pending = (done, host)
        else:
            self._pending = (None, flag.clone())
        if agreed:
            self.agreed = agreed
            self._acknowledged.set()
        return agreed == SIGNALLED

    def close(self) -> None:
        if not self._installed:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._acknowledged.set()
        self._write.close()
        self._read.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv
        self._thread.join(timeout=5)
        self._read.close()


def fault_drill(fault: str | None, rank: int, step: int, where: str = "step") -> None:
    """``train.fault``: ``raise@r:s`` / ``kill@r:s`` / ``term@r:s`` make rank ``r`` raise / die by
    SIGKILL / receive SIGTERM as it starts step ``s``; ``kill_in_save@r:s`` kills it after it wrote
    its shards of step ``s``'s checkpoint, before publication; ``raise_in_save@r:s`` makes that
    save fail there instead (a background writer's failure, raised by the loop's next poll).
    Only on a job's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0: a restarted job runs clean)."""
    if not fault or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    kind, at = fault.split("@")
    r, s = (int(x) for x in at.split(":"))
    if kind not in PROCESS_KINDS:  # a communication drill, a straggler, an OOM: recipes/training/drills.py
        return
    if r != rank or s != step or kind.endswith("_in_save") != (where == "save"):
        return
    if kind in ("raise", "raise_in_save"):
        where = "while saving step" if kind == "raise_in_save" else "at step"
        raise RuntimeError(f"fault drill: rank {rank} raises {where} {step} (train.fault={fault})")
    os.kill(os.getpid(), signal.SIGTERM if kind == "term" else signal.SIGKILL)


def __getattr__(name: str):
    """``checkpointing.Saver``: the loop's writer lives in :mod:`recipes.training.saving`."""
    if name == "Saver":
        from .saving import Saver

        return Saver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "Preemption",
    "checkpoint_root",
    "fault_drill",
    "find_resume_point",
    "load",
    "save",
    "save_due",
    "state_pieces",
]
