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
renames the directory to its final name (atomic on POSIX; a directory of the same
step already there is replaced), moves ``latest`` (write + ``os.replace``, atomic),
and deletes all but the newest ``keep`` intact checkpoints (:func:`prune`). A
rank killed at any point before the rename leaves only a ``.tmp-`` directory:
``latest`` still names the previous, complete checkpoint.

A rank that *fails* (a full disk, a read-only file system, any exception) does not
leave its peers in a barrier: each barrier of a save carries a failure code
(:mod:`parallel.checkpoint.faults`), so every rank raises at the same point, the
storage's faults as one-line :class:`~.faults.CheckpointStorageError`, and rank 0
removes the partial save; ``latest`` keeps the previous checkpoint.

:func:`load_checkpoint` first verifies the files (sizes on every rank; CRC32s
spread over the ranks; the verdict all-reduced so all ranks fail together,
naming the file), then reads with DCP, which reshards. A checkpoint found damaged
can be marked (:func:`mark_damaged`: a ``DAMAGED`` file saying what), so pruning
and ``resume=auto`` (:func:`resume_candidates`) pass over it without reading it again.

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
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from .chunks import CheckpointError
from .faults import agree, failure_code, raise_agreed
from .verify import MANIFEST, _digest, _rank_world, _write_durably, quick_damage, read_manifest, verify_checkpoint

LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def barrier(group=None) -> None:
    """Return once every rank of ``group`` has reached this point (:func:`parallel.comm.barrier`:
    a 4-byte all-reduce *and a host read of it*; a queued all-reduce alone would not make the
    host wait under NCCL, and rank 0 could read files its peers have not written yet)."""
    if dist.is_initialized():
        comm.barrier(group)


def save_checkpoint(
    state: dict,
    root: str | os.PathLike,
    step: int,
    *,
    meta: dict | None = None,
    keep: int = 0,
    group=None,
    on_written=None,
    needed: int | None = None,
) -> Path:
    """Write ``state`` (``{key: tensor | Chunked}``) as ``root/step_<step>`` and publish it (see module doc).

    Collective over ``group`` (default: the world). ``meta``: JSON-able facts
    stored in the manifest (config, layout). ``keep``: how many intact published
    checkpoints to keep (0: all). ``on_written()``: called once this rank's shards
    are on disk, before the publishing barrier (fault drills). ``needed``: the bytes a
    checkpoint takes (:func:`~.size.checkpoint_bytes`), for the message of a full disk.
    Returns the published directory. A failure on any rank raises on every rank
    (:class:`~.faults.CheckpointStorageError` for the storage's) with the partial save
    removed. :class:`~parallel.checkpoint.background.BackgroundSaver` runs the same steps
    on a host copy of ``state``, in a thread.
    """
    tmp = begin_save(root, step, group, needed=needed)
    write_shards(state, tmp, group, on_written, needed=needed)
    return publish_save(tmp, step, meta=meta, keep=keep, group=group, needed=needed)


def _step_of(tmp: Path) -> int:
    return int(tmp.name.rsplit("_", 1)[1])


def _settle(error: BaseException | None, rank: int, group, *, tmp: Path, needed: int | None, where: Path) -> None:
    """Every rank: agree whether any rank failed this part of the save (the barrier it needed
    anyway, :func:`~.faults.agree`); if one did, rank 0 removes ``tmp`` and every rank raises."""
    code = agree(failure_code(error, rank, where), group)
    cleanup = (lambda: shutil.rmtree(tmp, ignore_errors=True) or not tmp.exists()) if rank == 0 else None
    step = _step_of(tmp)
    path = tmp.parent / step_dir_name(step)
    raise_agreed(code, error, step=step, path=path, needed=needed, cleanup=cleanup, group=group)


def begin_save(root: str | os.PathLike, step: int, group=None, *, needed: int | None = None) -> Path:
    """Collective: the empty temporary directory of step ``step``'s save, on every rank."""
    root = Path(root)
    tmp = root / f".tmp-{step_dir_name(step)}"
    rank, error = _rank_world(group)[0], None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died earlier
            tmp.mkdir()
        except OSError as e:
            error = e
    _settle(error, rank, group, tmp=tmp, needed=needed, where=root)
    return tmp


def write_shards(state: dict, tmp: Path, group=None, on_written=None, *, needed: int | None = None) -> None:
    """Collective: every rank writes its shards (DCP) and their sizes + CRC32s into ``tmp``; returns
    once every rank has (the check that no rank failed is the barrier publication needs)."""
    import torch.distributed.checkpoint as dcp  # here, not at import: ~1 s of start-up a run without saves skips

    from .planner import SavePlanner

    rank, error = _rank_world(group)[0], None
    try:
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
            planner=SavePlanner(),
            process_group=group,
        )
        mine = {p.name: _digest(p) for p in sorted(tmp.glob(f"__{rank}_*"))}  # DCP names files by group rank
        _write_durably(tmp / f"sums.{rank}.json", json.dumps(mine))
        if on_written is not None:
            on_written()
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - agreed with the peers, then raised
        error = e
    _settle(error, rank, group, tmp=tmp, needed=needed, where=tmp)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (atomic); a directory already there (the same step saved by an
    earlier attempt, a resumed run saving it again) is replaced by the one just written and checked."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def publish_save(
    tmp: Path, step: int, *, meta: dict | None = None, keep: int = 0, group=None, needed: int | None = None
) -> Path:
    """Collective, after :func:`write_shards` (every rank's shards are on disk): rank 0 writes the
    manifest, renames ``tmp`` to its final name, moves ``latest`` and prunes; nobody returns before."""
    rank, world = _rank_world(group)
    root, name = tmp.parent, step_dir_name(step)
    final, error, late = root / name, None, None
    if rank == 0:
        try:
            files = {".metadata": _digest(tmp / ".metadata")}
            for r in range(world):
                part = tmp / f"sums.{r}.json"
                files.update(json.loads(part.read_text()))
                part.unlink()
            manifest = {"format": 1, "step": step, "world_size": world, "meta": meta or {}, "files": files}
            _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            _replace_dir(tmp, final)
            try:
                _write_durably(root / LATEST, name + "\n")
            except OSError:
                shutil.rmtree(final, ignore_errors=True)  # never published: `latest` still names the previous
                raise
        except Exception as e:  # noqa: BLE001 - agreed with the peers, then raised
            error = e
        else:  # published: what follows frees space; its failure is not the save's
            try:
                for stale in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:  # saves that died earlier
                    shutil.rmtree(stale, ignore_errors=True)
                prune(root, keep, final)
            except Exception as e:  # noqa: BLE001 - raised on this rank once the peers know the save is published
                late = e
    _settle(error, rank, group, tmp=tmp, needed=needed, where=root)  # nobody returns before `latest` has moved
    if late is not None:
        raise late
    return final


def published(root: str | os.PathLike) -> list[Path]:
    """Published checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def prune(root: str | os.PathLike, keep: int, newest: Path | None = None) -> list[Path]:
    """Keep the newest ``keep`` *intact* published checkpoints (``newest``, just published, is; the
    others by :func:`quick_damage`), never ``latest``'s; delete the rest, damaged ones included.
    Return the deleted."""
    if keep <= 0:
        return []
    try:
        current = latest_checkpoint(root)
    except CheckpointError:
        current = None
    kept, doomed = 0, []
    for p in reversed(published(root)):
        intact = p == newest or quick_damage(p) is None
        if intact and kept < keep:
            kept += 1
        elif p not in (current, newest):
            doomed.append(p)
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


def resume_candidates(root: str | os.PathLike) -> tuple[list[Path], list[str]]:
    """What ``train.resume=auto`` may take, in order: ``latest``'s checkpoint, then every older
    published one, newest first (newer ones, of a timeline a resume from an older step abandoned,
    are not); with no usable ``latest``, every published one. Also notes on a missing ``latest``
    (with checkpoints there) or one that names no complete checkpoint."""
    root = Path(root)
    found = list(reversed(published(root)))
    pointer = root / LATEST
    if not pointer.exists():
        return found, [f"{pointer} is missing"] if found else []
    name = pointer.read_text().strip()
    m = _STEP_DIR.match(name)
    notes = [] if (root / name / MANIFEST).exists() and m else [f"{pointer} names {name!r}, not a complete checkpoint"]
    if m is None:
        return found, notes
    return [p for p in found if int(_STEP_DIR.match(p.name).group(1)) <= int(m.group(1))], notes


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


def saved_tensors(ckpt: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor in ``ckpt`` (reads only the index)."""
    from .planner import read_dcp_metadata

    md = read_dcp_metadata(ckpt)
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def load_checkpoint(state: dict, ckpt: str | os.PathLike, *, group=None, verify: bool = True) -> dict:
    """Fill ``state``'s tensors and :class:`Chunked` views in place from ``ckpt``; return its manifest.

    Collective over ``group``. Any layout reads any other's checkpoint (DCP
    reads each stored chunk's overlap with each requested one).
    """
    import torch.distributed.checkpoint as dcp

    from .planner import LoadPlanner, SafeFileSystemReader

    manifest = verify_checkpoint(ckpt, group) if verify else read_manifest(ckpt)
    dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=LoadPlanner(), process_group=group)
    return manifest
