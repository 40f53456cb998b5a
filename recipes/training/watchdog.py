"""The hang watchdog (``parallel.hang_s``): a step that makes no progress ends the job, naming the rank.

A thread per rank, woken every :data:`POLL_S` (or a tenth of the limit): if the step the loop
began (:meth:`Watchdog.begin`) has not ended (:meth:`Watchdog.end`) ``hang_s`` seconds later, it

1. dumps the flight recorder to ``<run>/flight/rank<r>.json`` (reason ``watchdog: …``),
2. prints one line on stderr: ``watchdog: rank R made no progress for N s in step S; pending:
   <the call it is inside, or the last one it made>``,
3. writes the same line as this rank's exception to torchelastic's error file, so the launcher's
   failure summary (:mod:`launch.failures`) says ``rank R … raised Hang: …``, and leaves with
   status 1 :data:`LINGER_S` later (``os._exit``: the main thread is stuck in C++, nothing else
   would stop it; meanwhile the other stuck ranks' watchdogs dump too).

The launcher then stops the other ranks (SIGTERM: each dumps too, :mod:`recipes.training.flight`).
``hang_s`` None: :data:`HANG_FACTOR` × the median of the last steps' times, at least
:data:`HANG_MIN_S`; 0: no watchdog. Either way it is armed once the run's first step is done: that
step warms up (allocations, the memory report, NCCL's communicators made at their first use,
minutes at scale), and torch's timeout guards it. torch's own
collective timeout (``parallel.timeout_s``) stays the backstop, and the only guard of what runs
between steps (evaluation, a checkpoint's save). It reads only host clocks and the
recorder's Python fields: no device work, no host sync on the step's path.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

from parallel.comm import flight

from .flight import dump_now

HANG_FACTOR, HANG_MIN_S = 5.0, 60.0
POLL_S = 1.0
LINGER_S = 2.0  # between the line and the exit: the other stuck ranks' watchdogs dump meanwhile


class Hang(RuntimeError):
    """What a rank's watchdog reports (the launcher's summary names it)."""


def pending_call(recorder: flight.FlightRecorder) -> str:
    """The call the rank is inside (``inside all_reduce #12 on tp (step 5 F mb1)``), else its last one."""
    if recorder.count == 0:
        return "no collective issued yet"
    e = recorder.slots[recorder.last]
    seq, group, op, peer, t_end = e[0], e[1], e[2], e[5], e[8]
    peer_s = f" with rank {peer}" if peer is not None else ""
    phase = flight._phase(e[6], e[9], e[10])
    state = "inside" if t_end is None else "after"
    return f"{state} {op} #{seq}{peer_s} on {group}" + (f" ({phase})" if phase else "")


class Watchdog:
    """Watches one rank's loop (module docstring). ``clock``/``start``: injectable for tests."""

    def __init__(
        self,
        hang_s: float | None,
        run_dir: str | Path,
        rank: int,
        *,
        clock=time.monotonic,
        start: bool = True,
        recorder: flight.FlightRecorder | None = None,
    ):
        self.hang_s, self.run_dir, self.rank, self.clock = hang_s, Path(run_dir), rank, clock
        self.recorder = recorder or flight.RECORDER
        self.step = 0  # the step being run
        self.last: float | None = None  # when it started; None between steps
        self.times: list[float] = []  # the last steps' wall times
        self._stop = threading.Event()
        self._thread = None
        if start and hang_s != 0:
            self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
            self._thread.start()

    def begin(self, step: int) -> None:
        """Step ``step`` starts: the clock runs (host clocks only)."""
        self.step, self.last = step, self.clock()

    def end(self) -> None:
        """The step is done: its time joins the median; between steps (logging, saves) nothing is timed."""
        if self.last is not None:
            self.times = [*self.times[-31:], self.clock() - self.last]
        self.last = None

    def median_step_s(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def limit(self) -> float | None:
        """The seconds a step may run; None: not armed."""
        if self.hang_s == 0 or not self.times:  # the first step (warm-up, NCCL's lazy setup) is not timed
            return None
        if self.hang_s is not None:
            return float(self.hang_s)
        return max(HANG_MIN_S, HANG_FACTOR * self.median_step_s())

    def expired(self) -> float | None:
        """The seconds the current step has run, if they exceed :meth:`limit`; else None."""
        limit, last = self.limit(), self.last
        if limit is None or last is None:
            return None
        idle = self.clock() - last
        return idle if idle > limit else None

    def message(self, idle: float) -> str:
        return (
            f"watchdog: rank {self.rank} made no progress for {idle:.0f} s in step {self.step} "
            f"(parallel.hang_s={self.limit():g}); {pending_call(self.recorder)}"
        )

    def _run(self) -> None:
        while not self._stop.wait(min(POLL_S, (self.limit() or 10 * POLL_S) / 10)):
            idle = self.expired()
            if idle is not None:
                self.fire(idle)

    def fire(self, idle: float) -> None:
        """Dump, say so, write the error file, leave with status 1 (module docstring)."""
        line = self.message(idle)
        dump_now(self.run_dir, line)
        sys.stderr.write(line + "\n")  # one write: the other ranks' lines do not cut into it
        sys.stderr.flush()
        _record(Hang(line))
        sys.stdout.flush()
        time.sleep(LINGER_S)
        os._exit(1)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _record(error: BaseException) -> None:
    """``error`` into torchelastic's error file (what the launcher reports), if there is one."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        raise error
    except type(error) as e:
        ErrorHandler().record_exception(e)
