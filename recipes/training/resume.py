"""Which checkpoint a run continues from (``train.resume``), its sums checked once.

* None: start fresh.
* A path (a checkpoint, a checkpoint root, a run directory): that checkpoint, which must be
  intact; a damaged one is refused, naming the file.
* ``auto``: the run's newest checkpoint that verifies — ``latest``'s, else the older ones,
  newest first (:func:`parallel.checkpoint.resume_candidates`) — with a warning naming each
  damaged one it skips; each is marked (``DAMAGED``), so pruning counts it out and the next
  resume passes over it without reading it again. Checkpoints there but none intact: refused.

Verifying reads every byte (CRC32s), once per resume:

* the process that launches the workers (``python -m recipes.…``, or a one-rank torchrun job)
  verifies in its preflight and hands the checkpoint to the workers (:data:`VERIFIED_ENV`: its
  path and its manifest's modification time), which load it without reading the sums again;
* under torchrun with N ranks, each rank's preflight reads its 1/N of a named checkpoint (a
  damaged file ends the job with its one line on that rank, before any rank loads); for
  ``auto`` the ranks must choose alike, so preflight only looks at what needs no reading and
  the workers verify the candidates together (:func:`find_resume_point`: CRC32s shared over
  the ranks, the verdict all-reduced), newest first;
* a caller that went round preflight (``train()`` called directly) verifies in the workers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from parallel.checkpoint import (
    CheckpointError,
    agreed_damage,
    find_damage,
    mark_damaged,
    quick_damage,
    resolve_checkpoint,
    resume_candidates,
    verify_checkpoint,
)
from parallel.checkpoint.verify import MANIFEST

VERIFIED_ENV = "GRIDTRAIN_VERIFIED_CHECKPOINT"  # "<checkpoint>@<manifest mtime ns>", set by the verifier
_VERIFIED: set[str] = set()  # the same, for checkpoints this process verified


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _token(ckpt: str | Path) -> str | None:
    path = Path(ckpt).resolve()
    try:
        return f"{path}@{(path / MANIFEST).stat().st_mtime_ns}"
    except OSError:
        return None


def note_verified(ckpt: str | Path, *, hand_on: bool = False) -> None:
    """Record that ``ckpt``'s sums were checked (``hand_on``: for the workers this process starts too)."""
    token = _token(ckpt)
    if token is not None:
        _VERIFIED.add(token)
        if hand_on:
            os.environ[VERIFIED_ENV] = token


def is_verified(ckpt: str | Path) -> bool:
    """Whether this resume already checked ``ckpt``'s sums (here, or in the process that launched this one)."""
    token = _token(ckpt)
    return token is not None and (token in _VERIFIED or os.environ.get(VERIFIED_ENV) == token)


def _handed_on(root: Path) -> Path | None:
    """The checkpoint under ``root`` the launching process verified and chose, if any."""
    token = os.environ.get(VERIFIED_ENV, "")
    path = Path(token.rpartition("@")[0]) if "@" in token else None
    if path is not None and path.parent == root.resolve() and _token(path) == token:
        return path
    return None


def _say_on_rank0(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def newest_intact(root: Path, *, together: bool, say=_say_on_rank0, read: bool = True) -> Path | None:
    """``resume=auto``'s choice under ``root`` (see the module doc); ``together``: every rank of the
    world calls it and they share the reading (collective); ``read=False``: only what needs no
    reading (torchrun's preflight). Raises :class:`CheckpointError` if none of those there is intact."""
    candidates, notes = resume_candidates(root)
    for note in notes:
        say(f"warning: train.resume=auto: {note}; trying the published checkpoints, newest first")
    skipped = []
    for ckpt in candidates:
        if together:  # every rank checks every candidate it reaches, the verdict agreed: the same choice
            problem = "; ".join(agreed_damage(ckpt, mark=True)) or None
        else:
            problem = quick_damage(ckpt)
            if problem is None and read and (problems := find_damage(ckpt)):
                problem = "; ".join(problems)
                mark_damaged(ckpt, problem)
        if problem is None:
            return ckpt
        skipped.append(ckpt.name)
        if read:
            say(f"warning: train.resume=auto: skipping damaged checkpoint {ckpt} ({problem})")
    if skipped:
        raise CheckpointError(
            f"every checkpoint in {root} is damaged ({', '.join(skipped)}); resume from another run's checkpoint "
            "(train.resume=<path>), or move these away to start afresh"
        )
    return None


def find_resume_point(resume: str | None, run_dir: str | Path, *, say=_say_on_rank0) -> Path | None:
    """``train.resume`` in a worker (collective when the process group is up: every rank calls it):
    None → start fresh; ``auto`` → the newest intact checkpoint of the run, if any; else a checkpoint,
    checkpoint root or run directory that must hold an intact one. Raises :class:`CheckpointError`
    saying which (missing, a file, no checkpoint, a bad ``latest``, damaged)."""
    if not resume:
        return None
    if resume == "auto":
        root = checkpoint_root(run_dir)
        ckpt = _handed_on(root) or newest_intact(root, together=True, say=say)
    else:
        ckpt = resolve_checkpoint(check_path(resume))
        if not is_verified(ckpt):
            verify_checkpoint(ckpt)
    if ckpt is not None:
        note_verified(ckpt)
    return ckpt


def check_path(resume: str) -> Path:
    """A named ``train.resume`` exists and is a directory."""
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    return path
