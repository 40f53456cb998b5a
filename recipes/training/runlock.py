"""One live run per run directory: ``<run_dir>/.lock``, taken before anything is written.

The process that owns a run directory (the self-spawning launcher, or rank 0 under
torchrun) takes a POSIX record lock (``fcntl.lockf``, exclusive, non-blocking) on byte 0
of ``<run_dir>/.lock`` and writes its holder record into it: pid, host, start time.
Each worker of the job on the same host then locks a byte of its own (``1 + rank``) and
appends a line with its rank and pid (:func:`register_worker`): the lock covers the whole
job, and the kernel drops each part when its process dies, whatever the pids became.

* Byte 0 held (the launcher lives): refused with :class:`RunDirLocked`, whose one-line
  message names the holder's pid, host and start time.
* Byte 0 free but a worker's byte held (the launcher was killed, its workers still run:
  they stop at the end of their step, :class:`recipes.training.exits.LauncherWatch`):
  the new run waits up to ``train.lock_wait_s`` for them, then takes over, or is refused
  naming the workers still alive.
* All free but the file still names a holder: a crashed run. Same host and no recorded pid
  alive: taken over (``took_over`` records the dead holder). Another host, or a recorded pid
  still alive (a file system without working locks, or a reused pid): refused, asking the
  user to delete the file if that run is gone — never guessed.
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
from omegaconf import DictConfig, OmegaConf

LOCK_NAME = ".lock"


class RunDirLocked(RuntimeError):
    """The run directory belongs to another live run (the message is one line)."""


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, dead but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: it exists


def _read_record(fd: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The holder record (the first line) and the workers' lines of a lock file."""
    raw = os.pread(fd, 1 << 16, 0).decode(errors="replace").strip()
    if not raw:
        return {}, []
    first, *rest = raw.splitlines()
    try:
        holder = json.loads(first)
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return {"raw": first[:80]}, []
    workers = []
    for line in rest:
        try:
            w = json.loads(line)
        except ValueError:
            continue
        if isinstance(w, dict) and isinstance(w.get("pid"), int):
            workers.append(w)
    return holder, workers


def _read_holder(fd: int) -> dict[str, Any]:
    holder, workers = _read_record(fd)
    return {**holder, "workers": workers} if workers else holder


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 123 on host h (started 2026-11-30 14:00:00 UTC)``, or what the record holds."""
    if "pid" not in holder:
        return f"an unreadable holder record {holder.get('raw', '')!r}"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder['pid']} on host {holder.get('host', '?')} (started {when})"


def _pids(workers: list[dict[str, Any]]) -> str:
    ordered = sorted(workers, key=lambda w: (str(w.get("rank")), w["pid"]))
    return ", ".join(f"{w['pid']} (rank {w.get('rank', '?')})" for w in ordered)


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
_WORKER_FDS: dict[str, int] = {}  # this worker's registration, kept open (closing any fd drops its locks)


def _try_lock(fd: int, length: int, start: int = 0) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        return False
    return True


def _check_dead(path: Path, fd: int, wait_s: float) -> dict[str, Any]:
    """Byte 0 is ours: the record's run must be over. Waits up to ``wait_s`` for its workers to end;
    returns its record (empty: a free directory) or raises :class:`RunDirLocked`."""
    holder, workers = _read_record(fd)
    if holder:
        here = holder.get("host") == socket.gethostname()
        if not here or not isinstance(holder.get("pid"), int) or _pid_alive(holder["pid"]):
            why = "on another host" if not here else "still alive (or its record is unreadable)"
            raise RunDirLocked(
                f"run directory {path.parent} holds the lock record of {describe_holder(holder)}, {why}: "
                f"it cannot be checked from here; if that run is gone, delete {path}"
            )
    deadline = time.monotonic() + wait_s
    while True:  # the whole file: no worker of that job holds its byte (the kernel knows), no pid lives
        alive = [w for w in workers if _pid_alive(w["pid"])]
        if _try_lock(fd, 0) and not alive:
            break
        if time.monotonic() >= deadline:
            fcntl.lockf(fd, fcntl.LOCK_UN, 0, 1)  # keep byte 0 only, as before the check
            raise RunDirLocked(
                f"run directory {path.parent}: its launcher ({describe_holder(holder)}) is gone but worker(s) "
                f"{_pids(alive) or '(unrecorded)'} still run after {wait_s:g} s (train.lock_wait_s); they stop "
                f"at the end of their step: wait and rerun, or end them (kill {' '.join(str(w['pid']) for w in alive)})"
            )
        time.sleep(0.2)
    fcntl.lockf(fd, fcntl.LOCK_UN, 0, 1)  # free the workers' bytes again: byte 0 is the holder's
    return {**holder, "workers": workers} if workers else holder


def acquire(run_dir: str | os.PathLike, *, wait_s: float = 0.0) -> RunLock:
    """Take ``<run_dir>/.lock`` for this process (creating the directory), or raise :class:`RunDirLocked`.

    ``wait_s``: how long to wait for the workers of a run whose launcher died (``train.lock_wait_s``).
    Idempotent within a process: a second call for the same directory returns the held lock.
    """
    path = (Path(run_dir) / LOCK_NAME).resolve()
    if str(path) in _HELD:
        return _HELD[str(path)]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd, 1):
            raise RunDirLocked(
                f"run directory {path.parent} is in use by {describe_holder(_read_holder(fd))}; wait for that run "
                f"to end, or give this one another hydra.run.dir"
            )
        holder = _check_dead(path, fd, wait_s)
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


def register_worker(run_dir: str | os.PathLike, rank: int) -> bool:
    """A worker of the job holding ``run_dir``'s lock adds itself to it (see the module doc): locks
    byte ``1 + rank`` for its lifetime and appends ``{"rank", "pid"}``. Only a worker on the holder's
    host, and only if a holder is recorded (a run without the lock, e.g. a test's ranks, registers
    nothing). Returns whether it registered."""
    path = (Path(run_dir) / LOCK_NAME).resolve()
    if str(path) in _WORKER_FDS or str(path) in _HELD or not path.is_file():
        return False
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    holder, _ = _read_record(fd)
    if holder.get("host") != socket.gethostname() or not _try_lock(fd, 1, 1 + rank):
        os.close(fd)
        return False
    os.write(fd, (json.dumps({"rank": rank, "pid": os.getpid()}) + "\n").encode())
    _WORKER_FDS[str(path)] = fd  # held until the process ends: the kernel then drops the byte
    return True


def release(run_dir: str | os.PathLike) -> None:
    """Release this process's lock on ``run_dir`` if it holds one."""
    lock = _HELD.get(str((Path(run_dir) / LOCK_NAME).resolve()))
    if lock is not None:
        lock.release()


def _owner() -> bool:
    """The process that owns the run directory: the launcher (no ``RANK``) or rank 0."""
    return os.environ.get("RANK", "0") == "0"


def _take(run_dir: str, config: DictConfig) -> None:
    fresh = str((Path(run_dir) / LOCK_NAME).resolve()) not in _HELD
    try:
        lock = acquire(run_dir, wait_s=float(OmegaConf.select(config, "train.lock_wait_s", default=0.0) or 0.0))
    except RunDirLocked as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if lock.took_over and fresh:
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
            _take(str(config.hydra.run.dir), config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _owner():
            _take(str(config.hydra.runtime.output_dir), config)

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        release(str(config.hydra.runtime.output_dir))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        release(str(config.hydra.run.dir))
