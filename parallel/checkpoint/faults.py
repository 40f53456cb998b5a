"""Storage faults during a save, found by every rank together and said in one line.

A save can fail because the file system is full (``ENOSPC``, a quota's ``EDQUOT``), read-only
(``EROFS``: a remount after a disk error, a wrong mount) or no longer writable (``EACCES``).
Such a failure is rarely on every rank: one rank's shard, or rank 0's manifest, hits it.
Each step of a save therefore ends with :func:`agree` — the one 4-byte all-reduce the step
already needed as its barrier, carrying a failure code instead of a zero — so every rank
learns that the save failed, which rank failed first and whether it was the storage, and
every rank raises the same kind of exception at the same point (the caller can then stop, or
train on, on every rank alike; no rank is left waiting in a barrier its peers never reach).

The storage kind is found in the exception's chain (:func:`storage_errno`): an ``OSError``
with one of :data:`STORAGE_ERRNOS`, inside DCP's ``CheckpointException`` (which carries every
rank's failure), or torch's zip writer's ``RuntimeError`` after a failed write, which has lost
the errno ("unexpected pos ..."): that one counts as ``ENOSPC`` when the file system it was
writing to has (almost) no space left.

:class:`CheckpointStorageError`'s message is one line: the step, what happened, where, the
bytes a checkpoint needs (when the caller knows them: :func:`~.size.checkpoint_bytes`) and
the bytes free once the partial save was removed.
"""

from __future__ import annotations

import errno
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..comm.late import complete_pending
from .chunks import CheckpointError
from .size import format_bytes, free_bytes

STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EFBIG)  # full, quota, read-only …
_KIND = {code: i + 2 for i, code in enumerate(STORAGE_ERRNOS)}  # 1: any other failure; 0: none
_ERRNO = {kind: code for code, kind in _KIND.items()}
_RANKS = 1 << 20  # the code is kind * _RANKS + (_RANKS - 1 - rank): exact in a float32 (< 2**24); MAX: lowest rank
NEARLY_FULL = 1 << 20  # bytes: a failed zip write with less free than this was the disk filling up


class CheckpointStorageError(CheckpointError):
    """A save failed on the storage (on this rank or another); ``str()`` is one line.

    ``errno``: the :data:`STORAGE_ERRNOS` code; ``rank``: the rank that hit it; ``path``: the
    checkpoint directory that was not published; ``needed`` / ``free``: bytes (None if unknown)."""

    def __init__(self, message: str, *, step: int, errno_: int, rank: int, path: Path, needed, free):
        super().__init__(message)
        self.step, self.errno, self.rank, self.path, self.needed, self.free = step, errno_, rank, path, needed, free


def _chain(exc: BaseException):
    """``exc``, its causes and contexts, and the per-rank failures inside DCP's CheckpointException."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint.api.CheckpointException: {rank: (exc, tb)}
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [e.__cause__, e.__context__]


def storage_errno(exc: BaseException, where: Path | None = None) -> int | None:
    """The :data:`STORAGE_ERRNOS` code behind ``exc``, or None (see the module doc).
    ``where``: the directory being written, to recognise torch's zip writer's errno-less failure."""
    for e in _chain(exc):
        if isinstance(e, CheckpointStorageError):
            return e.errno
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e.errno
    if where is not None and any(isinstance(e, RuntimeError) and "unexpected pos" in str(e) for e in _chain(exc)):
        free = free_bytes(where)
        if free is not None and free < NEARLY_FULL:
            return errno.ENOSPC
    return None


def failure_code(exc: BaseException | None, rank: int, where: Path | None = None) -> int:
    """This rank's contribution to :func:`agree`: 0 (no failure), else its kind and the rank that
    failed (this one, or the first of those DCP's exception names)."""
    if exc is None:
        return 0
    code = storage_errno(exc, where)
    for e in _chain(exc):
        if isinstance(getattr(e, "failures", None), dict) and e.failures:
            rank = min(e.failures)
            break
    return (_KIND[code] if code is not None else 1) * _RANKS + (_RANKS - 1 - rank)


def agree(code: int, group=None) -> int:
    """Collective over ``group``: the largest of every rank's :func:`failure_code` (a storage
    failure outranks any other), once every rank has reached this point — a barrier
    (:func:`parallel.comm.barrier`: the all-reduce *and a host read of it*) that says why."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = torch.tensor([float(code)], device=comm.device_for(group))
        comm.all_reduce(flag, group=group, op=comm.ReduceOp.MAX)
        code = int(flag.item())
    complete_pending()
    return code


def _latest_says(root: Path) -> str:
    try:
        return f"the latest checkpoint is still {(root / 'latest').read_text().strip()}"
    except OSError:
        return "no checkpoint was published before"


def raise_agreed(
    code: int,
    mine: BaseException | None,
    *,
    step: int,
    path: Path,
    needed: int | None = None,
    cleanup=None,
    group=None,
) -> None:
    """After :func:`agree`: return if no rank failed; else run ``cleanup()`` (rank 0 removes the
    partial save; it returns whether it is gone) and raise on this rank — :class:`CheckpointStorageError` (one line) when the
    agreed failure is the storage's, else this rank's own exception, or a :class:`CheckpointError`
    naming the rank that failed, with its error (collective over ``group`` then)."""
    if not code:
        return
    kind, rank = divmod(code, _RANKS)
    rank = _RANKS - 1 - rank
    removed = cleanup() if cleanup is not None else True
    if kind in _ERRNO:
        code_, root = _ERRNO[kind], path.parent
        free = free_bytes(root)
        need = f"a checkpoint needs {format_bytes(needed)}, " if needed else ""
        have = f"{format_bytes(free)} free there" if free is not None else "free space unknown"
        message = (
            f"checkpoint {path.name} not saved: {os.strerror(code_)} ({errno.errorcode[code_]}) writing "
            f"{root} on rank {rank} ({need}{have}); "
            + ("the partial save was removed, " if removed else f"the partial save {root}/.tmp-{path.name} is left, ")
            + _latest_says(root)
        )
        raise CheckpointStorageError(
            message, step=step, errno_=code_, rank=rank, path=path, needed=needed, free=free
        ) from mine
    told = _tell(mine, rank, group)  # collective: every rank learns the failing rank's error
    if mine is not None:
        raise mine
    raise CheckpointError(f"checkpoint {path.name} not saved: rank {rank} failed:\n{told}")


def _tell(mine: BaseException | None, src: int, group) -> str:
    """The failing rank's exception with its traceback, sent to every rank of ``group`` (collective;
    on the failure path only), so a healthy rank's error names the cause, not only the rank."""
    text = "".join(traceback.format_exception(mine))[-4000:] if mine is not None else ""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return text
    box = [text]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return box[0]
