"""``train.resume=auto`` in a fresh run directory: find the run it means, or say there is none.

``train.resume=auto`` continues from the run directory's own newest checkpoint: what a job
restarted in place (``torchrun --max-restarts``, a requeued Slurm job: the same run id, so the
same directory) needs. A plain ``python -m recipes.<name> train.resume=auto`` without
``hydra.run.dir`` gets a new timestamped directory every time, which never holds one: there,
:func:`resolve_auto` looks through the outputs folder for the latest run of the same recipe
(Hydra's ``config_name`` in its ``.hydra/hydra.yaml``) with a published checkpoint and resumes from
it (this run writes into its own new directory); if there is none, it says so and where it looked.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


def recipe_of(run_dir: Path) -> str | None:
    """The recipe (Hydra config name) a run directory was written by, if it says."""
    try:
        return OmegaConf.select(OmegaConf.load(run_dir / ".hydra" / "hydra.yaml"), "hydra.job.config_name")
    except Exception:  # noqa: BLE001 - an unreadable run is not a candidate
        return None


def latest_run_checkpoint(outputs: Path, recipe: str, exclude: Path) -> Path | None:
    """The checkpoint ``train.resume=auto`` would take in the run of ``recipe`` under ``outputs``
    whose newest checkpoint is the most recent (``exclude``: this run's own directory)."""
    from parallel.checkpoint import CheckpointError, latest_checkpoint

    from .checkpointing import find_resume_point

    candidates = []
    for d in outputs.iterdir() if outputs.is_dir() else ():
        if not d.is_dir() or d.resolve() == exclude.resolve() or recipe_of(d) != recipe:
            continue
        try:
            newest = latest_checkpoint(d / "checkpoints")
        except CheckpointError:
            newest = None
        if newest is not None:
            candidates.append(((newest / "checkpoint.json").stat().st_mtime, d))
    for _, d in sorted(candidates, reverse=True):
        try:
            found = find_resume_point("auto", d)
        except CheckpointError:
            continue
        if found is not None:
            return found
    return None


def resolve_auto(rc, run_dir: str | Path, *, recipe: str, fresh: bool) -> str | None:
    """For ``train.resume=auto``: a note for the user (None: nothing to say). ``fresh``: this run's
    directory was made for it (no ``hydra.run.dir``, a new timestamped id); then the latest run of
    ``recipe`` beside it is looked for, and ``rc.train.resume`` set to its checkpoint if found."""
    from parallel.checkpoint import CheckpointError

    from .checkpointing import checkpoint_root, find_resume_point

    if rc.train.resume != "auto":
        return None
    run_dir = Path(run_dir)
    try:
        if find_resume_point("auto", run_dir, say=lambda text: None) is not None:
            return None  # its own checkpoint: the usual restart (preflight says what it skipped, once)
    except CheckpointError:
        return None  # preflight names what is wrong with it
    if not fresh:
        return f"train.resume=auto: nothing to resume in {checkpoint_root(run_dir)}; starting from step 1"
    outputs = run_dir.parent
    found = latest_run_checkpoint(outputs, recipe, run_dir)
    if found is None:
        return (
            f"train.resume=auto: nothing to resume: this run's directory {run_dir} is new (no hydra.run.dir) "
            f"and no {recipe} run under {outputs}/ has a checkpoint; starting from step 1"
        )
    rc.train.resume = str(found)
    run = found.parent.parent if found.parent.name == "checkpoints" else found.parent
    return (
        f"train.resume=auto: resuming from {found}, the latest {recipe} run under {outputs}/ "
        f"(this run writes to {run_dir}; to continue in that directory instead: hydra.run.dir={run})"
    )
