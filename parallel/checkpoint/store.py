"""Checkpoint directories: sharded, atomic, verified, pruned.

Layout of a run's checkpoint root::

    checkpoints/
      latest                    the name of the newest *complete* checkpoint (one line)
      step_00000004/            one published checkpoint
        .metadata               DCP's index: every global tensor, its chunks, where they lie
        __<rank>_0.distcp       the chunks rank <rank> wrote (each rank writes its own, in parallel)
        checkpoint.json         manifest: step, caller's meta (config, layout ...), size + CRC32 of every file
      .tmp-step_00000008/       a save in progress (or one that died): never read

:func:`save_checkpoint` is collective: every rank writes its shards into the
temporary directory (no rank gathers the model); once *all* ranks have
written and checksummed their files (a barrier), rank 0 writes the manifest,
renames the directory to its final name (atomic on POSIX), moves ``latest``
(write + ``os.replace``, atomic), and deletes all but the newest ``keep``. A
rank killed at any point before the rename leaves only a ``.tmp-`` directory:
``latest`` still names the previous, complete checkpoint.

:func:`load_checkpoint` first verifies the files (sizes on every rank; CRC32s
spread over the ranks; the verdict all-reduced so all ranks fail together,
naming the file), then reads with DCP, which reshards.

Communication: the barriers are 1-element ``all_reduce``s through
:mod:`parallel.comm` on ``group`` (4 bytes each), each followed by a host read
of its result, so the host really waits for every peer on NCCL too (tests run
the publication under :func:`parallel.comm.late_completion`); DCP itself gathers the
ranks' plans and scatters the global plan (its own collectives on ``group``,
a few KB of metadata per rank; tensor bytes go to files, never between ranks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import comm
from .chunks import CheckpointError
from .planner import LoadPlanner, SafeFileSystemReader, SavePlanner, read_dcp_metadata

MANIFEST = "checkpoint.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def barrier(group=None) -> None:
    """Return once every rank of ``group`` has reached this point (:func:`parallel.comm.barrier`:
    a 4-byte all-reduce *and a host read of it*; a queued all-reduce alone would not make the
    host wait under NCCL, and rank 0 could read files its peers have not written yet)."""
    if dist.is_initialized():
        comm.barrier(group)


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


def save_checkpoint(
    state: dict,
    root: str | os.PathLike,
    step: int,
    *,
    meta: dict | None = None,
    keep: int = 0,
    group=None,
    on_written=None,
) -> Path:
    """Write ``state`` (``{key: tensor | Chunked}``) as ``root/step_<step>`` and publish it (see module doc).

    Collective over ``group`` (default: the world). ``meta``: JSON-able facts
    stored in the manifest (config, layout). ``keep``: how many published
    checkpoints to keep (0: all). ``on_written()``: called once this rank's shards
    are on disk, before the publishing barrier (fault drills). Returns the
    published directory. :class:`~parallel.checkpoint.background.BackgroundSaver`
    runs the same steps on a host copy of ``state``, in a thread.
    """
    tmp = begin_save(root, step, group)
    write_shards(state, tmp, group, on_written)
    return publish_save(tmp, step, meta=meta, keep=keep, group=group)


def begin_save(root: str | os.PathLike, step: int, group=None) -> Path:
    """Collective: the empty temporary directory of step ``step``'s save, on every rank."""
    root = Path(root)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if _rank_world(group)[0] == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died earlier
    barrier(group)
    return tmp


def write_shards(state: dict, tmp: Path, group=None, on_written=None) -> None:
    """Collective: every rank writes its shards (DCP) and their sizes + CRC32s into ``tmp``."""
    rank = _rank_world(group)[0]
    dcp.save(
        state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), planner=SavePlanner(), process_group=group
    )
    mine = {p.name: _digest(p) for p in sorted(tmp.glob(f"__{rank}_*"))}  # DCP names files by group rank
    _write_durably(tmp / f"sums.{rank}.json", json.dumps(mine))
    if on_written is not None:
        on_written()


def publish_save(tmp: Path, step: int, *, meta: dict | None = None, keep: int = 0, group=None) -> Path:
    """Collective: once every rank's shards are on disk (a barrier), rank 0 writes the manifest,
    renames ``tmp`` to its final name, moves ``latest`` and prunes; nobody returns before."""
    rank, world = _rank_world(group)
    root, name = tmp.parent, step_dir_name(step)
    final = root / name
    barrier(group)  # every rank's shards are on disk
    if rank == 0:
        files = {".metadata": _digest(tmp / ".metadata")}
        for r in range(world):
            part = tmp / f"sums.{r}.json"
            files.update(json.loads(part.read_text()))
            part.unlink()
        manifest = {"format": 1, "step": step, "world_size": world, "meta": meta or {}, "files": files}
        _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        if final.exists():  # the same step was published before (a resumed run saving again): keep it
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, final)
        _write_durably(root / LATEST, name + "\n")
        for stale in root.glob(".tmp-step_*"):  # saves that died earlier (no other save runs now)
            shutil.rmtree(stale, ignore_errors=True)
        prune(root, keep)
    barrier(group)  # nobody returns before `latest` has moved
    return final


def published(root: str | os.PathLike) -> list[Path]:
    """Published checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` published checkpoints (never ``latest``'s); return the deleted."""
    if keep <= 0:
        return []
    current = latest_checkpoint(root)
    doomed = [p for p in published(root)[:-keep] if p != current]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The directory ``root/latest`` names, or None if there is no published checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is not a complete checkpoint (no {MANIFEST})")
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from itself, from a checkpoint root (its ``latest``) or from a run directory."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / MANIFEST).exists():
            return candidate
        found = latest_checkpoint(candidate) if (candidate / LATEST).exists() else None
        if found is not None:
            return found
    raise CheckpointError(
        f"no checkpoint at {path}: expected a directory with {MANIFEST}, or one with a "
        f"'{LATEST}' file (a checkpoint root or a run directory with checkpoints/)"
    )


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


def verify_checkpoint(ckpt: str | os.PathLike, group=None) -> dict:
    """Check ``ckpt``'s files on all ranks of ``group`` together; return the manifest.

    Raises :class:`CheckpointError` on *every* rank if any rank found damage
    (one 4-byte ``all_reduce`` MAX on ``group``), naming the files.
    """
    rank, world = _rank_world(group)
    manifest = read_manifest(ckpt)
    problems = find_damage(ckpt, rank, world)
    flag = torch.tensor([float(len(problems) > 0)], device=comm.device_for(group))
    if world > 1:
        comm.all_reduce(flag, group=group, op=comm.ReduceOp.MAX)
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt} is damaged: "
            + "; ".join(problems)
            + ". Load an older one (its directory path) or delete this one and its 'latest'"
        )
    if flag.item():
        raise CheckpointError(f"checkpoint {ckpt} is damaged (another rank found a bad file; see its error)")
    return manifest


def saved_tensors(ckpt: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor in ``ckpt`` (reads only the index)."""
    md = read_dcp_metadata(ckpt)
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def load_checkpoint(state: dict, ckpt: str | os.PathLike, *, group=None, verify: bool = True) -> dict:
    """Fill ``state``'s tensors and :class:`Chunked` views in place from ``ckpt``; return its manifest.

    Collective over ``group``. Any layout reads any other's checkpoint (DCP
    reads each stored chunk's overlap with each requested one).
    """
    manifest = verify_checkpoint(ckpt, group) if verify else read_manifest(ckpt)
    dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=LoadPlanner(), process_group=group)
    return manifest
