"""The flight recorder: the last calls this rank issued through :mod:`parallel.comm`, kept for a dump.

Every collective and p2p call appends one entry to a bounded ring (:data:`CAPACITY` slots, the
oldest overwritten): a sequence number per group (the n-th collective this rank made on that group,
counted from 0, the same on every member that issued it; for p2p the n-th send to, or receive
from, that peer), the group's label and global ranks, the
op, elements and dtype, the peer of a p2p, the caller's phase (what :func:`set_phase` last said,
the step; with the pipeline executor's schedule action and micro-batch, :attr:`FlightRecorder.action`,
and the ZeRO bucket whose reduction it is, :attr:`FlightRecorder.bucket`: references kept in the
slot, formatted only by a dump), the enqueue time and, for a blocking call, the time it returned. An asynchronous handle's completion is not tracked (no wrapper per handle); on CUDA,
torch's own NCCL flight recorder (turned on by the training loop's environment) sees the device side.

Cost per call: one slot's fields set and one clock read; no device work, no host sync.
:class:`Drill` is the seam of the fault drills (``train.fault``): one call of one op on this rank
skipped, sent at another size, held, or the process killed inside it. A dump
(:func:`dump`) writes the ring oldest first with this rank's phase and step times to JSON;
``python -m recipes.diagnose`` reads every rank's.
"""

from __future__ import annotations

import json
import os
import signal
import time
import weakref
from pathlib import Path

import torch.distributed as dist

CAPACITY = 2048
STEP_TIMES = 32  # the last steps whose times a dump holds (stragglers)
FIELDS = ("seq", "group", "op", "numel", "dtype", "peer", "phase", "t_start", "t_end")


class FlightRecorder:
    """A ring of the last ``capacity`` calls (module docstring)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.slots: list[list | None] = [None] * capacity
        self.count = 0  # calls recorded since the start (slot = count % capacity)
        self.seq: dict[str, int] = {}
        self.ranks: dict[str, tuple[int, ...]] = {}
        self.phase = ""
        self.step_times: list[tuple[int, float]] = []  # (step, seconds) of the last steps, for stragglers
        self.enabled = True
        self.last = -1  # the slot of the call recorded last (the one a blocking call marks done)
        self.action = None  # the pipeline executor's current schedule item (an action, or a batch of transfers)
        self.bucket: int | None = None  # the ZeRO bucket whose gradient reduction is being launched
        self.drill: Drill | None = None  # a rehearsed fault, armed by the caller (train.fault)

    def record(self, label: str, group, op: str, numel: int, dtype: str, peer: int | None) -> int:
        """Add one call; returns its slot index (for :meth:`done`), -1 when disabled."""
        if not self.enabled:
            return -1
        if label not in self.ranks:
            self.ranks[label] = _ranks(group)
        key = label if peer is None else f"{label}:{op}:{peer}"  # p2p: the n-th send to (receive from) peer
        seq = self.seq.get(key, 0)
        self.seq[key] = seq + 1
        i = self.count % self.capacity
        slot = self.slots[i]
        if slot is None:
            slot = self.slots[i] = [None] * (len(FIELDS) + 2)
        slot[:] = (seq, label, op, numel, dtype, peer, self.phase, time.monotonic(), None, self.action, self.bucket)
        self.count += 1
        self.last = i
        return i

    def done(self, index: int | None = None) -> None:
        """The call in slot ``index`` (default: the last recorded) returned (a blocking call)."""
        index = self.last if index is None else index
        if index >= 0:
            self.slots[index][8] = time.monotonic()

    def entries(self) -> dict[str, list]:
        """The recorded calls, oldest first, by column (``{field: [value per call]}``)."""
        n = min(self.count, self.capacity)
        first = self.count - n
        rows = [self.slots[(first + k) % self.capacity] for k in range(n)]
        out = {f: [r[i] for r in rows] for i, f in enumerate(FIELDS)}
        out["phase"] = [_phase(r[6], r[9], r[10]) for r in rows]
        return out

    def note_step(self, step: int, seconds: float, keep: int = STEP_TIMES) -> None:
        """A finished step's time (the last ``keep`` are dumped)."""
        self.step_times = [*self.step_times[-(keep - 1) :], (step, seconds)]

    def snapshot(self, reason: str, rank: int, world: int) -> dict:
        return {
            "rank": rank,
            "world": world,
            "pid": os.getpid(),
            "reason": reason,
            "time": time.monotonic(),
            "phase": self.phase,
            "calls_recorded": self.count,
            "groups": {label: list(ranks) for label, ranks in self.ranks.items()},
            "issued": dict(self.seq),
            "step_times": self.step_times,
            "entries": self.entries(),
        }


def _phase(phase: str, action, bucket: int | None) -> str:
    """``"step 3 F mb1"``, ``"step 3 B mb0 bucket 2"``: the step, the schedule item, the bucket."""
    parts = [phase] if phase else []
    if action is not None:
        items = action if isinstance(action, (list, tuple)) else [action]
        parts.append("+".join(_action(a) for a in items))
    if bucket is not None:
        parts.append(f"bucket {bucket}")
    return " ".join(parts)


_SHORT = {"Forward": "F", "Backward": "B", "BackwardInput": "BI", "BackwardWeight": "BW"}


def _action(a) -> str:
    name = type(a).__name__
    chunk = getattr(a, "chunk", 0)
    return f"{_SHORT.get(name, name)} mb{getattr(a, 'mb', '?')}" + (f" chunk {chunk}" if chunk else "")


class Drill:
    """A rehearsed fault on this rank: the ``nth`` call (from 0, counted from arming) of ``op``
    (``"*"``: of any op) on group ``group`` (its label; None: any group) is

    * ``"skip"``: not issued at all (an all-reduce only; its peers wait for it);
    * ``"size"``: issued with one element fewer (an all-reduce only; its peers see another size);
    * ``"hang"``: issued (recorded), then the rank blocks inside it for good;
    * ``"die"``: issued (recorded), then the process is killed inside it (SIGKILL: no dump);
    * ``"sleep"``: issued after ``seconds`` asleep inside it (a straggler).

    Fires once, then disarms itself (:attr:`FlightRecorder.drill` back to None)."""

    BEFORE = ("skip", "size")

    def __init__(
        self, op: str, action: str, nth: int = 0, seconds: float = 0.0, group: str | None = None, recorder=None
    ):
        self.op, self.action, self.nth, self.seconds, self.group = op, action, nth, seconds, group
        self.recorder = recorder
        self.seen = 0

    def _due(self, op: str, label: str, before: bool) -> bool:
        if self.op not in (op, "*") or self.group not in (None, label) or (self.action in self.BEFORE) != before:
            return False
        self.seen += 1
        if self.seen <= self.nth:
            return False
        (self.recorder or RECORDER).drill = None
        return True

    def before(self, op: str, label: str, tensor):
        """The tensor to issue ``op`` on group ``label`` with (``None``: skip the call)."""
        if not self._due(op, label, before=True):
            return tensor
        return None if self.action == "skip" else tensor.view(-1)[:-1]

    def inside(self, op: str, label: str) -> None:
        """Called once the call is recorded, before it is issued."""
        if not self._due(op, label, before=False):
            return
        if self.action == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.seconds if self.action == "sleep" else 10**6)


_GROUP_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ranks(group) -> tuple[int, ...]:
    if not dist.is_initialized():
        return (0,)
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    if group not in _GROUP_RANKS:
        _GROUP_RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return _GROUP_RANKS[group]


RECORDER = FlightRecorder()


def set_phase(phase: str) -> None:
    """What this rank is doing now (``"step 12 F3"``); each call recorded after it carries it."""
    RECORDER.phase = phase


def dump(folder: str | os.PathLike, reason: str, recorder: FlightRecorder | None = None) -> Path:
    """Write this rank's ring to ``<folder>/rank<r>.json`` (atomically); returns the path."""
    rec = recorder or RECORDER
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec.snapshot(reason, rank, world)))
    os.replace(tmp, path)
    return path
