"""Checkpoints that do not stop training: stage to host memory, write in a thread.

:meth:`BackgroundSaver.save` (collective in the sense that every rank calls it at
the same step) first waits for the previous save, then copies this rank's pieces
into host buffers it keeps from save to save (on CUDA: pinned buffers filled with
non-blocking copies, and one event the writer waits on; the training stream is
never synchronised), and returns. A writer thread then runs exactly the
synchronous save's steps (:func:`~.store.begin_save`, :func:`~.store.write_shards`,
:func:`~.store.publish_save`): DCP shards, sizes and CRC32s, a real barrier, the
manifest, the atomic rename, ``latest``, pruning — so a background checkpoint is
byte for byte the one a synchronous save would have written, and it is published
only once every rank's writer has its shards on disk.

The writers talk over a gloo group of their own (the same ranks, created once, in
the constructor, by every rank): training's collectives and the writers' never share
a group, so neither can reorder the other's. Their collectives are not counted by
:class:`parallel.comm.CommCounter` (a thread starts without the caller's counters).

A failure in the writer (disk full, a peer gone) is kept and raised by the next
:meth:`~BackgroundSaver.poll`, :meth:`~BackgroundSaver.save` or
:meth:`~BackgroundSaver.wait` in the training thread — the trainer polls every step —
as :class:`~.chunks.CheckpointError` chained to the writer's own exception and traceback:
never silently lost. The writers agree on a failure (:mod:`.faults`), so every rank's
writer fails alike and the partial save is removed; a storage fault (a full disk, a
read-only file system) is a :class:`~.faults.CheckpointStorageError` whose message is one
line, on every rank.

Host memory: one copy of the rank's checkpoint pieces (its shards: fp32 master
weights and optimizer state), held from the first save on.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .chunks import CheckpointError, Chunked
from .faults import CheckpointStorageError
from .store import begin_save, publish_save, step_dir_name, write_shards


class _Staging:
    """Host buffers for one rank's pieces, reused while the shapes stay the same."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        return buf

    def stage(self, state: dict) -> dict:
        """A host copy of ``state`` (``{key: tensor | Chunked}``) in this staging's buffers."""
        out: dict = {}
        for name, obj in state.items():
            if isinstance(obj, Chunked):
                staged = Chunked(tuple(obj.global_shape), obj.dtype)
                for offsets, view in obj.pieces.items():
                    staged.add(offsets, self.copy((name, tuple(offsets)), view))
                out[name] = staged
            elif isinstance(obj, torch.Tensor):
                out[name] = self.copy((name,), obj)
            else:
                out[name] = obj
        return out


class BackgroundSaver:
    """Asynchronous :func:`~.store.save_checkpoint` (see the module docstring).

    Args:
        group: the ranks that save together (default: the world); every rank of the world
            constructs the saver, in the same order as its other groups.
        timeout_s: the writers' group timeout (a peer that never arrives fails the save).
    """

    def __init__(self, group=None, *, timeout_s: float | None = None):
        self.group = None
        if dist.is_initialized():
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
            self.group = dist.new_group(ranks, backend="gloo", timeout=timeout, group_desc="checkpoint_writer")
        self._staging = _Staging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        self._published: Path | None = None
        self.stall_s = 0.0  # the training thread's time in the last save() (waiting + staging)
        self.write_s = 0.0  # the writer's time for the last completed save

    def save(
        self,
        state: dict,
        root: str | os.PathLike,
        step: int,
        *,
        meta: dict | None = None,
        keep: int = 0,
        on_written=None,
        needed: int | None = None,
    ) -> Path:
        """Stage ``state`` and start writing it as ``root/step_<step>``; return that (future) path.

        Waits for the previous save first (and raises its error, if any). ``needed``: as for
        :func:`~.store.save_checkpoint`."""
        t0 = time.perf_counter()
        self.wait()
        staged = self._staging.stage(state)
        event = None
        if any(b.is_pinned() for b in self._staging.buffers.values()) and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()  # after the non-blocking copies on the current stream
        self._step, self._published = step, None
        self._thread = threading.Thread(
            target=self._write,
            args=(staged, Path(root), step, meta, keep, on_written, event, needed),
            name=f"checkpoint-writer-{step}",
            daemon=True,
        )
        self._thread.start()
        self.stall_s = time.perf_counter() - t0
        return Path(root) / step_dir_name(step)

    def _write(self, staged, root, step, meta, keep, on_written, event, needed) -> None:
        t0 = time.perf_counter()
        try:
            if event is not None:
                event.synchronize()  # the host copies have landed
            tmp = begin_save(root, step, self.group, needed=needed)
            write_shards(staged, tmp, self.group, on_written, needed=needed)
            self._published = publish_save(tmp, step, meta=meta, keep=keep, group=self.group, needed=needed)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there
            self._error = e
        self.write_s = time.perf_counter() - t0

    @property
    def busy(self) -> bool:
        """Whether a save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> Path | None:
        """Never blocks: the directory of a save that has just been published (once), else None.
        Raises the writer's failure as :class:`CheckpointError`."""
        if self.busy or self._thread is None:
            return None
        return self._finish()

    def wait(self) -> Path | None:
        """Block until the save under way (if any) is published; return its directory (or None)."""
        if self._thread is None:
            return None
        self._thread.join()
        return self._finish()

    def _finish(self) -> Path | None:
        self._thread = None
        error, self._error = self._error, None
        if isinstance(error, CheckpointStorageError):  # every rank's writer failed alike: one line, the cause kept
            raise CheckpointStorageError(
                f"the background save of step {self._step} failed: {error}",
                step=error.step,
                errno_=error.errno,
                rank=error.rank,
                path=error.path,
                needed=error.needed,
                free=error.free,
            ) from (error.__cause__ or error)
        if error is not None:
            raise CheckpointError(
                f"the background save of step {self._step} failed on this rank: {type(error).__name__}: {error}"
            ) from error
        return self._published
