"""The run directory's storage, checked before anything is written into it.

* :func:`check_writable`: the run directory can be created and written — a real write (a
  probe file, created and removed), since ``os.access`` and permission bits do not tell: as
  root a ``chmod a-w`` directory is still writable, a read-only mount is not for anyone.
* :func:`checkpoint_size`: the bytes of one checkpoint of this model, computed: every
  parameter's global shape (the model built on the ``meta`` device, as the planner and the
  resume check count it), fp32 weights plus the optimizer's fp32 states per parameter
  (:data:`parallel.plan.memory.OPTIMIZER_STATES`, the planner's table) and its per-parameter
  step, each rank's RNG state, through :func:`parallel.checkpoint.checkpoint_bytes` (DCP's
  framing and index). Whatever the layout: a checkpoint holds every global tensor once.
* :func:`check_space`: a run that will save has room for one checkpoint.
* :class:`RunDirCallback`: Hydra runs :func:`check_writable` before it writes ``.hydra/``
  and before the run lock (``recipes/conf/base.yaml`` lists it first), so a read-only run
  directory is one ``error:`` line, exit 2, not Hydra's traceback.

Each refusal is one :class:`~recipes.config.ConfigError` line naming ``hydra.run.dir``.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..config import ConfigError, bad

FIX_DIR = "give a writable hydra.run.dir (a directory on a file system you may write to)"


def _why(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    return f"{e.strerror or e}" + (f" ({name})" if name else "")


def check_writable(run_dir: str | os.PathLike) -> Path:
    """Create ``run_dir`` if needed and write (then remove) a probe file in it; raise
    :class:`ConfigError` naming the path and the reason if either fails."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise bad("hydra.run.dir", run_dir, f"cannot create {e.filename or path}: {_why(e)}", FIX_DIR) from None
    probe = path / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "w") as f:
            f.write("gridtrain\n")
    except OSError as e:
        raise bad("hydra.run.dir", run_dir, f"cannot write into {path}: {_why(e)}", FIX_DIR) from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return path


def checkpoint_tensors(mc: Any, optimizer: str, world: int, cuda: bool = False) -> dict:
    """``{key: (global shape, dtype)}`` of every tensor a checkpoint of model ``mc`` holds
    (``recipes/training/checkpointing.py``'s keys), from the model on the meta device."""
    import torch

    from models.transformer import build_model
    from parallel.params import init_key, vocab_rows
    from parallel.plan.memory import OPTIMIZER_STATES

    states = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq")}.get(optimizer, ())
    states = states[: OPTIMIZER_STATES.get(optimizer, 0)]
    scalars = ("step",) if states else ()  # torch's Adam/AdamW count steps per parameter
    fp32, out = torch.float32, {}
    for name, p in build_model(mc, device="meta").named_parameters():
        shape = (p.vocab_size, *p.shape[1:]) if vocab_rows(p) is not None else tuple(p.shape)
        key = init_key(p, name)
        out[f"model/{key}"] = (shape, fp32)
        out.update({f"optim/{key}/{s}": (shape, fp32) for s in states})
        out.update({f"optim/{key}/{s}": ((), fp32) for s in scalars})
    rng = tuple(torch.get_rng_state().shape)
    for r in range(world):
        out[f"rng/{r}/cpu"] = (rng, torch.uint8)
        if cuda:
            out[f"rng/{r}/cuda"] = ((16,), torch.uint8)  # torch.cuda.get_rng_state(): 16 bytes
    return out


def checkpoint_size(mc: Any, optimizer: str, world: int, cuda: bool = False) -> int:
    """Bytes of one checkpoint of model ``mc`` (at least; see the module doc)."""
    from parallel.checkpoint import checkpoint_bytes

    return checkpoint_bytes(checkpoint_tensors(mc, optimizer, world, cuda))


def saves(rc: Any) -> bool:
    """Whether the run saves on schedule (a pre-emption's save is not scheduled)."""
    return bool(rc.train.ckpt_every or rc.train.ckpt_at_end)


def check_space(rc: Any, mc: Any, run_dir: str | os.PathLike, world: int) -> int | None:
    """A run that saves has room under ``run_dir`` for one checkpoint; return its bytes (None: no saves)."""
    from parallel.checkpoint import format_bytes, free_bytes

    if not saves(rc):
        return None
    needed = checkpoint_size(mc, rc.optim.name, world, cuda=_on_cuda(rc))
    free = free_bytes(run_dir)
    if free is not None and free < needed:
        raise bad(
            "hydra.run.dir",
            run_dir,
            f"one checkpoint of this model needs {format_bytes(needed)} ({mc.n_layers} layers, fp32 weights "
            f"and {rc.optim.name} state), but its file system has {format_bytes(free)} free",
            "free some space, give another hydra.run.dir, or save no checkpoints (train.ckpt_every=0 "
            "train.ckpt_at_end=false)",
        )
    return needed


def _on_cuda(rc: Any) -> bool:
    import torch

    return rc.parallel.backend != "gloo" and torch.cuda.is_available()


def _refuse(e: ConfigError) -> None:
    print(f"error: {e}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


class RunDirCallback(Callback):
    """Hydra callback: the run directory is writable before Hydra writes ``.hydra/`` into it (run
    mode) and before each multirun job; on the process that owns it (the launcher, or rank 0)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if os.environ.get("RANK", "0") == "0":
            try:
                check_writable(str(config.hydra.run.dir))
            except ConfigError as e:
                _refuse(e)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if os.environ.get("RANK", "0") == "0":
            try:
                check_writable(str(config.hydra.runtime.output_dir))
            except ConfigError as e:
                _refuse(e)
