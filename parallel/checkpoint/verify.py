"""Is a checkpoint intact? Sizes and CRC32s against its manifest, shared over the ranks.

Every file of a checkpoint is listed in its manifest (``checkpoint.json``) with its size
and CRC32. :func:`find_damage` compares them (sizes of all files; CRC32s of every
``world``-th file from ``rank``'s position, so ranks share the reading), and
:func:`verify_checkpoint` does so on all ranks of a group together, the verdict
all-reduced so every rank fails alike, naming the file. A checkpoint found damaged can be
marked (:func:`mark_damaged`: a ``DAMAGED`` file saying what), and :func:`quick_damage`
finds what needs no reading of the data (no manifest, the marker, a missing file), so
pruning and ``resume=auto`` pass over a damaged checkpoint without reading it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from .chunks import CheckpointError

MANIFEST = "checkpoint.json"


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _digest(path: Path) -> dict:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return {"bytes": path.stat().st_size, "crc32": crc}


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(ckpt: str | os.PathLike) -> dict:
    path = Path(ckpt) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read the manifest {path}: {e}") from None


def find_damage(ckpt: str | os.PathLike, rank: int = 0, world: int = 1) -> list[str]:
    """Problems with the files of ``ckpt``: missing or wrong-sized files (all), CRC32 mismatches
    (every ``world``-th file from ``rank``'s position, so ranks share the reading). Empty: intact."""
    ckpt = Path(ckpt)
    files = read_manifest(ckpt)["files"]
    problems = []
    for i, (name, want) in enumerate(sorted(files.items())):
        path = ckpt / name
        if not path.exists():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path} has {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)")
        elif i % world == rank and (got := _digest(path)["crc32"]) != want["crc32"]:
            problems.append(f"{path} has CRC32 {got:#010x}, the manifest says {want['crc32']:#010x} (corrupted)")
    return problems


def agreed_damage(ckpt: str | os.PathLike, group=None, *, mark: bool = False) -> list[str]:
    """Collective over ``group``: the problems with ``ckpt`` (:func:`find_damage`, ranks sharing the
    CRC32s), empty on every rank exactly when no rank found one (one 4-byte ``all_reduce`` MAX).

    ``mark``: a checkpoint already marked counts as damaged without reading it, and the ranks that
    find damage mark it (:func:`mark_damaged`); the others then name it from that record. Every
    rank reaches the all-reduce whatever it found, so a choice made from the result is the same on
    every rank (a rank must not skip a candidate on a marker its peer has just written)."""
    rank, world = _rank_world(group)
    marker = Path(ckpt) / DAMAGED
    if mark and marker.exists():
        problems = [marker.read_text(errors="replace").strip() or "marked damaged"]
    else:
        try:
            problems = find_damage(ckpt, rank, world)
        except CheckpointError as e:  # no readable manifest
            problems = [str(e)]
        if problems and mark:
            mark_damaged(ckpt, "; ".join(problems))
    flag = torch.tensor([float(len(problems) > 0)], device=comm.device_for(group))
    if world > 1:
        comm.all_reduce(flag, group=group, op=comm.ReduceOp.MAX)
    if not problems and flag.item():
        recorded = quick_damage(ckpt) if mark else None
        problems = [recorded or "another rank found a bad file; see its error"]
    return problems


def verify_checkpoint(ckpt: str | os.PathLike, group=None, *, mark: bool = False) -> dict:
    """Check ``ckpt``'s files on all ranks of ``group`` together; return the manifest.

    Raises :class:`CheckpointError` on *every* rank if any rank found damage
    (:func:`agreed_damage`), naming the files.
    """
    problems = agreed_damage(ckpt, group, mark=mark)
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt} is damaged: "
            + "; ".join(problems)
            + ". Load an older one (its directory path) or delete this one and its 'latest'"
        )
    return read_manifest(ckpt)


DAMAGED = "DAMAGED"  # a marker in a checkpoint that failed verification: what was found (one line)


def mark_damaged(ckpt: str | os.PathLike, problem: str) -> None:
    """Record in ``ckpt`` that it failed verification (best effort: a read-only copy stays unmarked)."""
    path = Path(ckpt) / DAMAGED
    tmp = path.with_name(f"{DAMAGED}.{os.getpid()}.tmp")  # ranks that found damage may write it at once
    try:
        tmp.write_text(problem + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def quick_damage(ckpt: str | os.PathLike) -> str | None:
    """What makes ``ckpt`` unusable without reading its data, or None: no readable manifest, a
    :data:`DAMAGED` marker (an earlier verification failed), a file missing (one directory listing)."""
    ckpt = Path(ckpt)
    marker = ckpt / DAMAGED
    if marker.exists():
        return marker.read_text(errors="replace").strip() or "marked damaged"
    try:
        files = read_manifest(ckpt)["files"]
        present = set(os.listdir(ckpt))
    except (CheckpointError, OSError, KeyError, TypeError) as e:
        return str(e)
    missing = sorted(set(files) - present)
    return (
        f"{ckpt / missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        if missing
        else None
    )
