"""One live run per run directory: ``<run_dir>/.lock``, taken before anything is written.

The process that owns a run directory (the self-spawning launcher, or rank 0 under
torchrun) takes a POSIX record lock (``fcntl.lockf``, exclusive, non-blocking) on
``<run_dir>/.lock`` and writes its holder record into it: pid, host, start time.

* Held by a live process: refused with :class:`RunDirLocked`, whose one-line
  message names the holder's pid, host and start time.
* Free (the kernel drops a dead process's lock) but the file still names a holder:
  a crashed run. Same host and that pid no longer alive: the lock is taken over
  (``took_over`` records the dead holder). Another host, or a pid still alive
  (a file system without working locks, or a reused pid): refused, asking the user
  to delete the file if that run is gone — never guessed.
* Released at the end of the run (and at interpreter exit): the record is emptied
  and the lock dropped. The file stays; an empty ``.lock`` is a free directory, so
  no unlink/re-create race exists.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

LOCK_NAME = ".lock"


class RunDirLocked(RuntimeError):
    """The run directory belongs to another live run (the message is one line)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM  # exists, owned by someone else
    return True


def _read_holder(fd: int) -> dict[str, Any]:
    raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not raw:
        return {}
    try:
        holder = json.loads(raw)
    except ValueError:
        return {"raw": raw[:80]}
    return holder if isinstance(holder, dict) else {"raw": raw[:80]}


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 123 on host h (started 2026-11-30 14:00:00 UTC)``, or what the record holds."""
    if "pid" not in holder:
        return f"an unreadable holder record {holder.get('raw', '')!r}"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder['pid']} on host {holder.get('host', '?')} (started {when})"


@dataclass
class RunLock:
    """A held run-directory lock; :meth:`release` is idempotent."""

    path: Path
    fd: int
    took_over: dict[str, Any] = field(default_factory=dict)  # the dead holder's record, if any

    def release(self) -> None:
        if self.fd < 0:
            return
        _HELD.pop(str(self.path), None)
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # closing drops the lock
            self.fd = -1


_HELD: dict[str, RunLock] = {}


def acquire(run_dir: str | os.PathLike) -> RunLock:
    """Take ``<run_dir>/.lock`` for this process (creating the directory), or raise :class:`RunDirLocked`.

    Idempotent within a process: a second call for the same directory returns the held lock.
    """
    path = (Path(run_dir) / LOCK_NAME).resolve()
    if str(path) in _HELD:
        return _HELD[str(path)]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            raise RunDirLocked(
                f"run directory {path.parent} is in use by {describe_holder(_read_holder(fd))}; wait for that run "
                f"to end, or give this one another hydra.run.dir"
            ) from None
        holder = _read_holder(fd)
        if holder:
            here = holder.get("host") == socket.gethostname()
            if not here or not isinstance(holder.get("pid"), int) or _pid_alive(holder["pid"]):
                why = "on another host" if not here else "still alive (or its record is unreadable)"
                raise RunDirLocked(
                    f"run directory {path.parent} holds the lock record of {describe_holder(holder)}, {why}: "
                    f"it cannot be checked from here; if that run is gone, delete {path}"
                )
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    lock = RunLock(path, fd, took_over=holder)
    _HELD[str(path)] = lock
    atexit.register(lock.release)
    return lock


def release(run_dir: str | os.PathLike) -> None:
    """Release this process's lock on ``run_dir`` if it holds one."""
    lock = _HELD.get(str((Path(run_dir) / LOCK_NAME).resolve()))
    if lock is not None:
        lock.release()


def _owner() -> bool:
    """The process that owns the run directory: the launcher (no ``RANK``) or rank 0."""
    return os.environ.get("RANK", "0") == "0"


def _take(run_dir: str) -> None:
    try:
        lock = acquire(run_dir)
    except RunDirLocked as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if lock.took_over:
        print(
            f"note: took over {lock.path} from {describe_holder(lock.took_over)}, which is no longer running",
            file=sys.stderr,
            flush=True,
        )


class RunLockCallback(Callback):
    """Hydra callback: lock the run directory before Hydra writes ``.hydra/`` (run mode) or
    before each multirun job runs; release it when the run or job ends."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _owner():
            _take(str(config.hydra.run.dir))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _owner():
            _take(str(config.hydra.runtime.output_dir))

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        release(str(config.hydra.runtime.output_dir))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        release(str(config.hydra.run.dir))
