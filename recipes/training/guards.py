"""What the loop does around each step so that a stuck, slow or out-of-memory rank is named.

:class:`StepGuards` gathers, for the trainer's loop:

* the flight recorder's phase (``step N``) and the fault drills as a step starts
  (:mod:`recipes.training.drills`);
* the hang watchdog (``parallel.hang_s``, :mod:`recipes.training.watchdog`);
* the stragglers: on logged steps each rank's time per step and data time are all-gathered with
  the loss's reduction and read in the same host read (:meth:`parallel.engine.StepEngine.step`'s
  ``gather``); :func:`stragglers` names the slowest rank and its lag behind the median;
* the memory forensics on an out-of-memory error (:mod:`recipes.training.forensics`).

A rank's time is its own work: its data time (reading and moving its batch) plus its step time
with the time it waited inside collectives taken out (``step_time_s × (1 − comm_frac)``, of the
previous logged step: this one's is known only after the read). Waiting for a slow peer therefore
does not make a rank look slow; the slow peer does.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from parallel.comm import flight

from . import drills, forensics
from .watchdog import Watchdog

TIMES = 2  # numbers per rank in the gather: (data time, own step time)


def stragglers(every: list[float]) -> dict[str, Any]:
    """From every rank's ``(data_s, step_s)`` (flat, rank by rank): the slowest rank by their sum,
    its lag behind the median rank (a fraction), and its two times."""
    pairs = [every[i : i + TIMES] for i in range(0, len(every), TIMES)]
    totals = [d + s for d, s in pairs]
    slow = max(range(len(totals)), key=totals.__getitem__)
    median = statistics.median(totals)
    lag = totals[slow] / median - 1 if median > 0 else 0.0
    return {
        "slowest_rank": slow,
        "slowest_lag": lag,
        "slowest_data_s": pairs[slow][0],
        "slowest_step_s": pairs[slow][1],
    }


class StepGuards:
    """One rank's guards over the loop (module docstring)."""

    def __init__(self, trainer, run_dir: str | Path):
        self.trainer, self.run_dir = trainer, Path(run_dir)
        rc = trainer.rc
        self.fault = rc.train.fault
        self.watchdog = Watchdog(rc.parallel.hang_s, run_dir, trainer.rank)
        self.snapshot = forensics.start(rc.logger.memory_snapshot, trainer.device)
        self.own_step_s = 0.0  # the previous logged step's own time (step time less collective waits)
        self.data_s = 0.0
        self.timed = False  # a logged step's own time is known (every rank reads the same steps)
        self._host = torch.zeros(TIMES, pin_memory=trainer.device.type == "cuda")

    def begin(self, step: int) -> None:
        """Step ``step`` (from 1) starts."""
        flight.set_phase(f"step {step}")  # what the flight recorder's next calls say they were for
        self.watchdog.begin(step)
        drills.arm(self.fault, self.trainer.rank, step)

    def read_data(self, step: int, fetch):
        """``fetch()`` (the step's batch to the device), timed as the data time."""
        t0 = time.perf_counter()
        drills.straggle(self.fault, self.trainer.rank, step, self.watchdog.median_step_s() or 0.0)
        out = fetch()
        self.data_s = time.perf_counter() - t0
        return out

    def gather(self) -> torch.Tensor:
        """This rank's ``(data_s, own step_s)`` on the device (a logged step's all-gather)."""
        self._host[0], self._host[1] = self.data_s, self.own_step_s
        return self._host.to(self.trainer.device, non_blocking=True)

    def after(self, step: int, rec: dict[str, Any]) -> None:
        """Step ``step``'s record: a read one gets the stragglers (the loop ends the watchdog's
        timing itself, after the step's last collective, the pre-emption poll)."""
        every = rec.pop("rank_times", None)
        if isinstance(every, list) and self.timed:  # (the first logged step has no step time to compare)
            rec.update(stragglers(every))
            mine = every[TIMES * self.trainer.rank : TIMES * (self.trainer.rank + 1)]
            flight.RECORDER.note_step(step, sum(mine))  # diagnose's slowest rank of the last steps
        if "step_time_s" in rec and "comm_frac" in rec:  # a read step: the next read compares it
            self.own_step_s, self.timed = rec["step_time_s"] * (1.0 - rec["comm_frac"]), True

    def out_of_memory(self, error: BaseException) -> None:
        """The forensics of an out-of-memory error (the caller re-raises it)."""
        forensics.report(self.trainer, self.run_dir, error, self.snapshot)

    def close(self) -> None:
        self.watchdog.close()
