"""Byte accounting: every collective of gridtrain reports here.

A :class:`CommCounter` records, per process group and per operation, the number
of calls, the *payload* (the size of the buffer handed to the collective) and
the bytes each rank *sends* under the standard bandwidth-optimal algorithms
(ring all-reduce, ring reduce-scatter / all-gather, pipelined broadcast), which
is what NCCL and gloo move and what the planner predicts:

==================  =========================================
operation           bytes sent per rank (N = group size)
==================  =========================================
all_reduce          2 (N-1)/N · buffer
reduce_scatter      (N-1)/N · input (the full, unscattered buffer)
all_gather          (N-1)/N · output (the full, gathered buffer)
all_to_all          (N-1)/N · buffer
broadcast           (N-1)/N · buffer (pipelined ring, averaged over ranks)
send / recv         buffer on the sender / 0 on the receiver
==================  =========================================

Counting is off unless a counter is active::

    counter = CommCounter()
    with counter:
        loss.backward()
    counter.sent_bytes("dp")          # bytes this rank sent on its DP group

Each counter also adds up the time this rank spent *blocked* in
communication per group (a blocking call's duration, or an asynchronous
handle's ``wait()``): the "waiting on communication" share of a step. Times
are taken with :class:`parallel.timing.StepClock`: on the CPU host seconds,
on a GPU CUDA events on the compute stream around the call (a blocking NCCL
call, or ``wait()``, makes that stream wait for the collective), so the figure
is the time the *device* stalled, not the time the host took to enqueue. The
events are resolved when :meth:`CommCounter.wait_seconds` is asked, after the
step: timing never synchronises the host.

Active counters live in a :mod:`contextvars` variable (like a profiler), so two
counters can nest and nothing leaks between threads or tests. When none is
active, recording costs one variable lookup.
"""

from __future__ import annotations

import contextvars
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

_ACTIVE: contextvars.ContextVar[tuple[CommCounter, ...]] = contextvars.ContextVar("gridtrain_comm_counters", default=())

#: bytes sent per rank, as a fraction of the payload, for a group of size n
SENT_FRACTION = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0
    recv_bytes: float = 0.0
    wait_s: float = 0.0
    unresolved: list[Any] = field(default_factory=list, repr=False)  # Intervals (CUDA events) not yet read

    def resolve(self) -> float:
        """``wait_s`` with every unresolved interval added in (reads the events once)."""
        if self.unresolved:
            self.wait_s += sum(i.seconds() for i in self.unresolved)
            self.unresolved.clear()
        return self.wait_s


class CommCounter:
    """Counts calls and bytes per (group label, operation) while active.

    Use as a context manager (``with counter: ...``) or with
    :meth:`start` / :meth:`stop`. ``enabled = False`` pauses it.
    """

    def __init__(self) -> None:
        self.enabled = True
        self.stats: dict[tuple[str, str], OpStats] = defaultdict(OpStats)
        self._tokens: list[contextvars.Token] = []

    # activation -------------------------------------------------------------
    def start(self) -> CommCounter:
        self._tokens.append(_ACTIVE.set(_ACTIVE.get() + (self,)))
        return self

    def stop(self) -> None:
        _ACTIVE.reset(self._tokens.pop())

    def __enter__(self) -> CommCounter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def reset(self) -> None:
        self.stats.clear()

    # recording --------------------------------------------------------------
    def add(self, group: str, op: str, payload_bytes: int, group_size: int) -> None:
        if not self.enabled:
            return
        s = self.stats[(group, op)]
        s.calls += 1
        s.payload_bytes += payload_bytes
        if group_size > 1 or op in ("send", "recv"):
            frac = SENT_FRACTION[op](group_size)
            s.sent_bytes += frac * payload_bytes
            # collectives are symmetric; a recv receives its whole payload
            s.recv_bytes += payload_bytes if op == "recv" else (0 if op == "send" else frac * payload_bytes)

    def add_time(self, group: str, op: str, seconds) -> None:
        """Add blocked time: seconds, or an :class:`~parallel.timing.Interval` resolved on query."""
        if not self.enabled:
            return
        if isinstance(seconds, (int, float)):
            self.stats[(group, op)].wait_s += seconds
        else:
            self.stats[(group, op)].unresolved.append(seconds)

    # queries ----------------------------------------------------------------
    def _select(self, group: str | None, op: str | None):
        return [s for (g, o), s in self.stats.items() if (group is None or g == group) and (op is None or o == op)]

    def sent_bytes(self, group: str | None = None, op: str | None = None) -> float:
        """Bytes this rank sent, optionally restricted to one group label / op."""
        return sum(s.sent_bytes for s in self._select(group, op))

    def recv_bytes(self, group: str | None = None, op: str | None = None) -> float:
        return sum(s.recv_bytes for s in self._select(group, op))

    def payload_bytes(self, group: str | None = None, op: str | None = None) -> int:
        return sum(s.payload_bytes for s in self._select(group, op))

    def wait_seconds(self, group: str | None = None, op: str | None = None) -> float:
        """Time this rank spent blocked in communication (see module docstring); on CUDA this reads
        the recorded events, waiting for the last of them: call it after the step."""
        return sum(s.resolve() for s in self._select(group, op))

    def calls(self, group: str | None = None, op: str | None = None) -> int:
        return sum(s.calls for s in self._select(group, op))

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{group: {op: {calls, payload_bytes, sent_bytes, recv_bytes}}}`` (JSON-able)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (g, o), s in sorted(self.stats.items()):
            s.resolve()
            out.setdefault(g, {})[o] = {k: v for k, v in s.__dict__.items() if k != "unresolved"}
        return out


def record(group: str, op: str, payload_bytes: int, group_size: int) -> None:
    """Report one communication call to every active counter."""
    for c in _ACTIVE.get():
        c.add(group, op, payload_bytes, group_size)


def counting() -> bool:
    """True while at least one counter is active (callers skip timing otherwise)."""
    return bool(_ACTIVE.get())


def record_time(group: str, op: str, seconds) -> None:
    """Report time spent blocked in one communication call to every active counter."""
    for c in _ACTIVE.get():
        c.add_time(group, op, seconds)
