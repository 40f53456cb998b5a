"""Fault drills (``train.fault=<kind>@<rank>:<step>``): rehearse what a 17,920-rank job meets, on gloo.

The process faults (``raise``, ``kill``, ``term``, ``kill_in_save``, ``raise_in_save``) are
:func:`recipes.training.checkpointing.fault_drill`'s. The communication faults arm
:class:`parallel.comm.flight.Drill` on rank ``r`` as it starts step ``s``:

* ``skip_allreduce``: it skips the step's all-reduce over the world (the pre-emption flag's, at
  the step's end): its peers wait in it, it goes on into the next step and waits there;
* ``allreduce_size``: it issues that all-reduce one element short (0 elements: it returns at once,
  its peers wait; on NCCL another size hangs or corrupts, on gloo a larger mismatch aborts the
  process in C++ before any dump);
* ``hang_send``: it blocks for good inside the step's first pipeline send;
* ``die_in_comm``: it is killed by SIGKILL inside the step's third call (mid-step, no dump);
* ``straggle``: it reads its batch :data:`STRAGGLE_FACTOR` × its last step time late (a slow
  rank: every step of the job waits for it);
* ``oom``: it raises ``torch.OutOfMemoryError`` as the step starts (the memory forensics,
  :mod:`recipes.training.forensics`, without a GPU to fill).

Each ends within ``parallel.hang_s`` (the watchdog, :mod:`recipes.training.watchdog`) or at once,
and ``python -m recipes.diagnose <run>`` names the rank and the call (``docs/debugging.md``).
Like the process faults, only on a job's first attempt.
"""

from __future__ import annotations

import os
import time

import torch

from parallel.comm import flight

PROCESS_KINDS = ("raise", "kill", "term", "kill_in_save", "raise_in_save")
COMM_KINDS = {  # kind -> (op, flight.Drill action, nth call of the op in the step, group label or None: any)
    "skip_allreduce": ("all_reduce", "skip", 0, "world"),
    "allreduce_size": ("all_reduce", "size", 0, "world"),
    "hang_send": ("send", "hang", 0, None),
    "die_in_comm": ("*", "die", 2, None),
}
FAULT_KINDS = (*PROCESS_KINDS, *COMM_KINDS, "straggle", "oom")
STRAGGLE_FACTOR = 3.0


def parse(fault: str | None) -> tuple[str, int, int] | None:
    """``(kind, rank, step)`` of ``train.fault`` (validated by recipes/validation.py); None: no drill,
    or a restarted attempt (``TORCHELASTIC_RESTART_COUNT`` ≠ 0 runs clean)."""
    if not fault or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    kind, at = fault.split("@")
    r, s = (int(x) for x in at.split(":"))
    return kind, r, s


def arm(fault: str | None, rank: int, step: int) -> None:
    """As rank ``rank`` starts ``step``: arm a communication drill, or raise the injected OOM."""
    drill = parse(fault)
    if drill is None or drill[1:] != (rank, step):
        return
    kind = drill[0]
    if kind in COMM_KINDS:
        op, action, nth, group = COMM_KINDS[kind]
        flight.RECORDER.drill = flight.Drill(op, action, nth=nth, group=group)
    elif kind == "oom":
        raise torch.OutOfMemoryError(
            f"fault drill: rank {rank} runs out of memory at step {step} (train.fault={fault}): "
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        )


def straggle(fault: str | None, rank: int, step: int, last_step_s: float) -> None:
    """``straggle@r:s``: rank ``r`` sleeps :data:`STRAGGLE_FACTOR` × ``last_step_s`` before it reads
    step ``s``'s batch (counted in its data time)."""
    drill = parse(fault)
    if drill is not None and drill == ("straggle", rank, step):
        time.sleep(STRAGGLE_FACTOR * max(last_step_s, 0.05))
