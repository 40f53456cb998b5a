"""The call sequence: every collective and p2p this rank issues, in order, with its tensor.

A :class:`CallRecorder` is the sibling of :class:`~parallel.comm.counter.CommCounter`:
while active, each counted collective of :mod:`parallel.comm.collectives` also
appends a :class:`Call` (group label and global ranks, op, elements, dtype, device,
peer for p2p). Two checks use it, both of which NCCL makes fatal and gloo does not:

* :meth:`CallRecorder.misplaced`: a tensor handed to a collective must live on
  the device this rank computes on (``device_for(group)``: its GPU under NCCL,
  ``meta`` in a dry run). A CPU tensor there is a crash on NCCL.
* :func:`compare_sequences`: every member of a group must issue the same
  collectives (op, size, dtype) in the same order, and each send must meet a
  receive of the same size and dtype, in order, on its peer. A mismatch is a
  would-be hang; it is reported with the first differing call.

Calls on a group of one rank move nothing and are not recorded (as in the counter).
"""

from __future__ import annotations

import contextvars
from dataclasses import asdict, dataclass
from typing import Self

import torch

from .flight import RECORDER

_ACTIVE: contextvars.ContextVar[tuple[CallRecorder, ...]] = contextvars.ContextVar(
    "gridtrain_comm_recorders", default=()
)

P2P_OPS = ("send", "recv")


@dataclass(frozen=True)
class Call:
    """One communication call as this rank issued it."""

    group: str  # the group's label (its group_desc)
    ranks: tuple[int, ...]  # the group's global ranks
    op: str
    numel: int
    dtype: str
    device: str
    peer: int | None = None  # p2p: the other side's global rank

    def key(self) -> tuple:
        """What the members of a group must agree on."""
        return (self.op, self.numel, self.dtype)

    def describe(self) -> str:
        peer = f" peer {self.peer}" if self.peer is not None else ""
        return f"{self.op}({self.numel} × {self.dtype}) on {self.group}{peer}"


class CallRecorder:
    """Records every communication call while active (``with recorder: ...``).

    ``device``: where tensors handed to collectives must live; None: each call's
    ``device_for(group)`` (see :func:`parallel.comm.device_for`).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.calls: list[Call] = []
        self._wrong: list[tuple[int, str]] = []  # (index in calls, expected device)
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> Self:
        self._tokens.append(_ACTIVE.set(_ACTIVE.get() + (self,)))
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._tokens.pop())

    def add(self, call: Call, expected: torch.device) -> None:
        want = self.device if self.device is not None else expected
        if not on_device(call.device, want):
            self._wrong.append((len(self.calls), str(want)))
        self.calls.append(call)

    def misplaced(self) -> list[str]:
        """One line per call whose tensor was not on the rank's device."""
        return [
            f"call {i}: {self.calls[i].describe()} got a tensor on {self.calls[i].device}, the rank computes on {want}"
            for i, want in self._wrong
        ]

    def to_list(self) -> list[dict]:
        return [asdict(c) for c in self.calls]


def on_device(tensor_device: str | torch.device, device: torch.device) -> bool:
    """Is a tensor on ``tensor_device`` on the rank's ``device``? (``cuda`` means the current GPU)."""
    have = torch.device(tensor_device)
    if have.type != device.type:
        return False
    return device.index is None or have.index is None or have.index == device.index


def recording() -> bool:
    return bool(_ACTIVE.get())


def note(
    group_label: str, group, op: str, tensor: torch.Tensor, peer: int | None = None, also: tuple[torch.Tensor, ...] = ()
) -> None:
    """Report one call to every active recorder (no-op when none is).

    ``tensor``: the payload (its size and dtype are recorded); ``also``: the call's
    other tensors (an output buffer), whose device is checked as well. Every call also goes into
    the flight recorder's ring (:mod:`.flight`)."""
    RECORDER.record(group_label, group, op, tensor.numel(), str(tensor.dtype).removeprefix("torch."), peer)
    if RECORDER.drill is not None:
        RECORDER.drill.inside(op, group_label)  # a fault drill: held, killed or slowed inside this call (flight.Drill)
    active = _ACTIVE.get()
    if not active:
        return
    import torch.distributed as dist

    from .collectives import device_for

    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    expected = device_for(group)
    device = next((t.device for t in (tensor, *also) if not on_device(t.device, expected)), tensor.device)
    call = Call(group_label, ranks, op, tensor.numel(), str(tensor.dtype).removeprefix("torch."), str(device), peer)
    for r in active:
        r.add(call, expected)


def compare_sequences(calls: dict[int, list[Call]]) -> list[str]:
    """Check that the recorded ranks (``{global rank: its calls}``) agree; return the problems.

    For every group holding two or more recorded ranks, their collective
    sequences on it must be equal (op, elements, dtype); for every pair of
    recorded ranks, the sends of one to the other must equal, in order, the
    other's receives from it. Each problem names the first differing call.
    """
    problems: list[str] = []
    groups: dict[tuple[str, tuple[int, ...]], dict[int, list[Call]]] = {}
    for rank, seq in calls.items():
        for c in seq:
            if c.op not in P2P_OPS:
                groups.setdefault((c.group, c.ranks), {}).setdefault(rank, []).append(c)
    for rank in calls:  # a recorded member of a group that issued nothing on it
        for (_, ranks), by_rank in groups.items():
            if rank in ranks:
                by_rank.setdefault(rank, [])
    for (label, ranks), by_rank in sorted(groups.items()):
        members = sorted(by_rank)
        first = members[0]
        for other in members[1:]:
            diff = first_difference(by_rank[first], by_rank[other])
            if diff is not None:
                i, a, b = diff
                problems.append(
                    f"group {label} {_short(ranks)}: ranks {first} and {other} differ at collective {i}: {a} vs {b}"
                )
    sends: dict[tuple[int, int], list[Call]] = {}
    recvs: dict[tuple[int, int], list[Call]] = {}
    for rank, seq in calls.items():  # one pass: each rank's sends to, and receives from, each peer
        for c in seq:
            if c.op == "send" and c.peer in calls:
                sends.setdefault((rank, c.peer), []).append(c)
            elif c.op == "recv" and c.peer in calls:
                recvs.setdefault((c.peer, rank), []).append(c)
    for src, dst in sorted(set(sends) | set(recvs)):
        diff = first_difference(sends.get((src, dst), []), recvs.get((src, dst), []), key=lambda c: (c.numel, c.dtype))
        if diff is not None:
            i, a, b = diff
            problems.append(f"p2p {src} → {dst}: send {i} is {a}, the matching receive is {b}")
    return problems


def first_difference(a: list[Call], b: list[Call], key=Call.key) -> tuple[int, str, str] | None:
    """The first index at which ``a`` and ``b`` differ by ``key`` (or one ends), with both calls
    described (``"nothing"`` past an end); None if they agree."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or key(a[i]) != key(b[i]):  # described only where they differ
            return i, a[i].describe() if i < len(a) else "nothing", b[i].describe() if i < len(b) else "nothing"
    return None


def _short(ranks: tuple[int, ...]) -> str:
    return (
        f"[{', '.join(map(str, ranks))}]"
        if len(ranks) <= 6
        else f"[{ranks[0]}, {ranks[1]}, … {ranks[-1]}] ({len(ranks)} ranks)"
    )
