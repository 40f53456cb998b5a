"""The training loop's checkpoint writer (``checkpointing.Saver``), and what it does when the storage
refuses a save (``train.ckpt_on_error``; ``docs/checkpoint.md``, "Storage faults and damaged checkpoints")."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from parallel.checkpoint import BackgroundSaver, CheckpointStorageError, format_bytes

from .checkpointing import SAVE_FAILED, Preemption, _meta, checkpoint_root, save, state_pieces


class Saver:
    """The loop's checkpoint writer: :func:`save` itself, or (``train.ckpt_async``) the same
    checkpoint staged to host memory and written by a :class:`BackgroundSaver`.

    Every rank constructs it (the background writer's group is created then), calls
    :meth:`save` at the same steps, :meth:`poll` every step (it raises a failed background
    write, with the writer's traceback chained) and :meth:`close` at the end of training
    (it waits for the last save).

    A save the storage refuses (:class:`CheckpointStorageError`: disk full, read-only; every
    rank's save fails alike and the partial save is removed) is said in one line (``say``, rank
    0's log) and, with ``train.ckpt_on_error=stop``, stops the run: :attr:`stopped` turns True
    on every rank at the same step — at once where the failure is seen at a step every rank
    shares (a synchronous save, the next save, the end), else through ``preemption``'s per-step
    agreement — and no further save is started. With ``continue`` training goes on and the next
    scheduled save tries again. Any other failure still raises."""

    def __init__(self, trainer, *, preemption: Preemption | None = None, say=None):
        from .storage import checkpoint_size

        self.trainer = trainer
        t = trainer.rc.train
        self.background = BackgroundSaver(timeout_s=trainer.rc.parallel.timeout_s) if t.ckpt_async else None
        self._config = OmegaConf.to_container(OmegaConf.structured(trainer.rc))  # fixed for the run: once
        self.policy, self.preemption, self.say = t.ckpt_on_error, preemption, say or (lambda text: None)
        world, cuda = trainer.topology.world_size, trainer.device.type == "cuda"
        self.needed = checkpoint_size(trainer.model_cfg, trainer.rc.optim.name, world, cuda)  # the model on meta
        self.failure: CheckpointStorageError | None = None  # the last save the storage refused
        self._stop = False

    def _absorb(self, fn):
        """``fn()``; a storage failure is said, recorded (and, to stop, proposed to the peers) instead."""
        try:
            return fn()
        except CheckpointStorageError as e:
            self.failure = e
            stop = self.policy == "stop"
            self.say(
                ("error: " if stop else "warning: ")
                + str(e).removeprefix(f"the background save of step {e.step} failed: ")
                + ("; stopping (train.ckpt_on_error=continue trains on without it)" if stop else "; training goes on")
            )
            if stop and self.preemption is not None:
                self.preemption.request(SAVE_FAILED)
            return None

    def _settle(self) -> None:
        """At a point every rank reaches at the same step: a known failure stops (policy ``stop``)
        or is forgotten (``continue``: the next save tries again)."""
        if self.failure is not None:
            if self.policy == "stop":
                self._stop = True
            else:
                self.failure = None

    def save(self, *, on_written=None) -> Path | None:
        """Save at ``trainer.step`` and say so; returns the directory (published once :meth:`poll`
        returns it), or None: not saved (a save the storage refused stops the saving; class doc)."""
        if self.background is not None:
            self._published(self._absorb(self.background.wait))
        self._settle()
        if self._stop:
            return None
        tr = self.trainer
        if self.background is None:
            path = self._absorb(lambda: save(tr, on_written=on_written, needed=self.needed))
            self._settle()
            if path is not None:
                self.say(f"checkpoint {path}")
            return path
        path = self.background.save(
            state_pieces(tr),
            checkpoint_root(tr.run_dir),
            tr.step,
            meta=_meta(tr, self._config),
            keep=tr.rc.train.ckpt_keep,
            on_written=on_written,
            needed=self.needed,
        )
        self.say(f"checkpoint {path} (writing in the background)")
        return path

    def _published(self, done: Path | None) -> Path | None:
        if done is not None:
            self.say(f"checkpoint {done} published")
        return done

    @property
    def stall_s(self) -> float | None:
        """The training thread's time in the last background save (None: synchronous saves)."""
        return self.background.stall_s if self.background else None

    def poll(self) -> Path | None:
        """A background save published since the last call (once, and said), else None; raises its
        failure (a storage failure: see the class doc)."""
        return self._published(self._absorb(self.background.poll)) if self.background else None

    def close(self) -> Path | None:
        """Wait for the save under way; return (and say) its directory if it was published just now."""
        done = self._published(self._absorb(self.background.wait)) if self.background else None
        self._settle()
        return done

    @property
    def stopped(self) -> bool:
        """Every rank agrees the run stops for a save the storage refused (``train.ckpt_on_error=stop``)."""
        return self._stop or (self.preemption is not None and self.preemption.agreed == SAVE_FAILED)

    def stop_message(self) -> str | None:
        """After :meth:`close`: the line that ends a stopped run (None: not stopped)."""
        if not self.stopped:
            return None
        try:
            latest = (checkpoint_root(self.trainer.run_dir) / "latest").read_text().strip()
        except OSError:
            latest = None
        f = self.failure
        what = f"checkpoint {f.path.name} could not be written ({f.path.parent})" if f else "a checkpoint failed"
        run_dir = self.trainer.run_dir
        return (
            f"stopped after step {self.trainer.step}: {what}; "
            + (f"the latest checkpoint is {latest}" if latest else "no checkpoint was saved")
            + f"; make room for {format_bytes(self.needed)} and continue with train.resume=auto "
            f"hydra.run.dir={run_dir}, or train on without saving: train.ckpt_on_error=continue"
        )
