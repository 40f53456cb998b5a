"""Memory forensics: what a rank that ran out of memory held, beside what the planner predicted.

On ``torch.OutOfMemoryError`` the rank (:func:`report`)

* on CUDA with ``logger.memory_snapshot``: writes ``<run>/memory/rank<r>.pickle``, the allocator's
  history since the start (:func:`start` turned on ``torch.cuda.memory._record_memory_history``):
  open it at https://pytorch.org/memory_viz;
* prints on stderr a table of its bytes by kind (parameters, gradients, optimizer state: what ZeRO
  holds now; activations at the first step's peak; the allocator's allocated, reserved and peak on
  CUDA) beside the planner's prediction for its pipeline stage (``mode=plan``'s figures);

then the error goes on as any other: the flight dump, the traceback, the launcher's summary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

MIB = 2**20
SNAPSHOT_ENTRIES = 100_000  # allocation events kept (torch's own default)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError)


def start(enabled: bool, device: torch.device) -> bool:
    """``logger.memory_snapshot``: record the allocator's history (CUDA only); whether it does."""
    if not enabled or device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
    return True


def measured(trainer) -> dict[str, float]:
    """This rank's bytes by kind now (no collective, no device work)."""
    engine = trainer.engine
    held = engine.zero.held_bytes()
    out = {k: float(held.get(k, 0.0)) for k in ("params", "grads", "optimizer")}
    out["activations"] = float(getattr(engine, "activation_bytes", 0.0) or 0.0)
    if trainer.device.type == "cuda":
        out["allocated"] = float(torch.cuda.memory_allocated(trainer.device))
        out["reserved"] = float(torch.cuda.memory_reserved(trainer.device))
        out["peak allocated"] = float(torch.cuda.max_memory_allocated(trainer.device))
    return out


def predicted(trainer) -> dict[str, float]:
    """The planner's bytes for this rank's stage (empty if the layout cannot be planned)."""
    try:
        from ..tools.plan import plan_from_config

        plan = plan_from_config(trainer.rc)
    except (ValueError, KeyError):
        return {}
    return dict(plan.ranks[trainer.groups.pp_rank].memory)


def table(rank: int, step: int, have: dict[str, float], plan: dict[str, float]) -> str:
    """The stderr table (MiB): each measured kind beside the planner's, then the planner's total."""
    lines = [
        f"rank {rank} ran out of memory in step {step}; its memory by kind (MiB):",
        f"{'kind':<16}{'held':>10}{'predicted':>11}",
    ]
    for kind, value in have.items():
        pred = plan.get(kind)
        lines.append(f"{kind:<16}{value / MIB:>10.1f}{(f'{pred / MIB:.1f}' if pred is not None else '-'):>11}")
    if "total" in plan:
        lines.append(f"{'planned total':<16}{'':>10}{plan['total'] / MIB:>11.1f}")
    return "\n".join(lines)


def report(trainer, run_dir: str | Path, error: BaseException, snapshot: bool) -> Path | None:
    """The rank's forensics (module docstring); returns the snapshot's path, if one was written."""
    path = None
    if snapshot and trainer.device.type == "cuda":
        path = Path(run_dir) / "memory" / f"rank{trainer.rank}.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except OSError:
            path = None
    text = table(trainer.rank, trainer.step + 1, measured(trainer), predicted(trainer))
    where = (
        f"memory snapshot: {path} (open it at https://pytorch.org/memory_viz)"
        if path
        else ("no memory snapshot (logger.memory_snapshot=true on CUDA records one)")
    )
    print(f"{text}\n{where}", file=sys.stderr, flush=True)
    return path
