"""Run a schedule on paper: deadlock-freedom, completeness, time and memory.

No processes: every stage is a program counter and a clock. Computations take
their cost; a batch of transfers is *posted* when its stage reaches it and
completes once every one of its sends and receives has met its counterpart
(rendezvous: a send waits for the matching receive to be posted, the
conservative model under which NCCL and gloo cannot hang), ``p2p_latency``
after the later of the two posts. A batch of sends alone (no receive) does not
hold its stage up: its sends must have met their receives by the time the
stage's *next* batch (or the end of its list) completes, as the executor awaits
them only then (a zero-bubble schedule sends B's input gradient upstream and
computes a W while the upstream stage is busy). Between two stages, messages in one
direction match in posting order (as in NCCL/gloo, which carry no per-message
tags here), so the simulator also proves the k-th send is the receive the peer
expects.

:func:`simulate` raises :class:`~.schedules.ScheduleError` when a schedule

* deadlocks (the message lists each stuck stage and the transfers it waits on),
* pairs a send with a different receive (wrong micro-batch, chunk or kind),
* computes before its input arrived / sends what it has not computed yet,
* misses or repeats a forward or backward of some (micro-batch, chunk) on a stage,

and otherwise returns the makespan, bubble fraction, per-stage busy time, the
peak number of (micro-batch, chunk) activations each stage stores, and a
timeline (:class:`Span` per action) for :mod:`.timeline`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .schedules import (
    FREES_ACTIVATIONS,
    GRAD_PRODUCERS,
    P2P,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Compute,
    Forward,
    RecvActivation,
    ScheduleError,
    SendActivation,
    SendGrad,
    batches,
    peer_of,
    points_next,
    virtual_stage,
)


@dataclass(frozen=True)
class Span:
    """One action (or batch of transfers, ``action`` a tuple) on one stage, from ``start`` to ``end``
    seconds: the unit of a simulated timeline (:class:`SimResult`) and of a recorded one (the executor's),
    which :func:`parallel.pipeline.timeline.draw_timeline` draws."""

    action: object
    start: float
    end: float


@dataclass
class SimResult:
    makespan: float
    bubble_fraction: float  # 1 − total busy time / (stages × makespan)
    busy: list[float]
    peak_activations: list[int]  # per stage: most (mb, chunk) activations stored at once
    timeline: list[list[Span]] = field(repr=False)


def _shape(schedule: list[list[Action]]) -> tuple[int, int, int]:
    pp = len(schedule)
    computes = [a for stage in schedule for a in stage if isinstance(a, Compute)]
    if pp == 0 or not computes:
        raise ScheduleError("empty schedule: no stages or no computations")
    m = 1 + max(a.mb for a in computes)
    vpp = 1 + max(a.chunk for a in computes)
    return pp, m, vpp


def check_complete(schedule: list[list[Action]]) -> None:
    """Each stage runs, for every (micro-batch, chunk), one Forward and then either one
    Backward or one BackwardInput followed by one BackwardWeight."""
    pp, m, vpp = _shape(schedule)
    want = {(mb, c) for mb in range(m) for c in range(vpp)}
    for s, actions in enumerate(schedule):
        counts = Counter((type(a), a.mb, a.chunk) for a in actions if isinstance(a, Compute))
        for mb, c in sorted(want):
            if counts[(Forward, mb, c)] != 1:
                raise ScheduleError(
                    f"stage {s}: (micro-batch {mb}, chunk {c}) needs exactly one Forward for "
                    f"m={m}, vpp={vpp}; got {counts[(Forward, mb, c)]}"
                )
        for mb, c in sorted(want):
            full, b, w = (counts[(kind, mb, c)] for kind in (Backward, BackwardInput, BackwardWeight))
            if (full, b, w) not in ((1, 0, 0), (0, 1, 1)):
                raise ScheduleError(
                    f"stage {s}: (micro-batch {mb}, chunk {c}) needs exactly one Backward or one "
                    f"BackwardInput and one BackwardWeight, got {full} / {b} / {w}"
                )


class _Stage:
    def __init__(self, index: int, actions: list[Action]):
        self.index = index
        self.items = batches(actions)
        self.pc = 0
        self.clock = 0.0
        self.posted: list[tuple[str, tuple, int]] | None = None  # (channel side, key, slot)
        self.deferred: list = []  # the sends of the last send-only batch, not yet awaited
        self.done: set = set()
        self.stored = 0
        self.peak = 0
        self.busy = 0.0
        self.spans: list[Span] = []


def _message_key(st: _Stage, a: P2P, pp: int) -> tuple:
    """What a send or receive of stage ``st`` carries: (kind, micro-batch, receiving virtual stage)."""
    v = virtual_stage(a.chunk, st.index, pp)
    if isinstance(a, SendActivation):
        return ("activation", a.mb, v + 1)
    if isinstance(a, RecvActivation):
        return ("activation", a.mb, v)
    if isinstance(a, SendGrad):
        return ("grad", a.mb, v - 1)
    return ("grad", a.mb, v)


def _check_p2p(st: _Stage, a: P2P, pp: int, vpp: int) -> None:
    """Refuse a transfer to the wrong peer, or a send before what it sends was computed."""
    v = virtual_stage(a.chunk, st.index, pp)
    want = peer_of(v, pp, vpp, to_next=points_next(a))
    if want is None:
        raise ScheduleError(f"stage {st.index}: {a} has no peer (virtual stage {v} of {pp * vpp})")
    if a.peer != want:
        raise ScheduleError(f"stage {st.index}: {a} names peer {a.peer}, virtual stage {v}'s is {want}")
    if isinstance(a, SendActivation) and ("fwd", a.mb, a.chunk) not in st.done:
        raise ScheduleError(f"stage {st.index}: {a} before its Forward")
    if isinstance(a, SendGrad) and ("bwd", a.mb, a.chunk) not in st.done:
        raise ScheduleError(f"stage {st.index}: {a} before its backward")


def _check_compute(st: _Stage, a: Compute, pp: int, last: int) -> None:
    """Refuse a computation before its inputs arrived or were computed."""
    v = a.chunk * pp + st.index
    if isinstance(a, Forward) and v > 0 and ("act", a.mb, a.chunk) not in st.done:
        raise ScheduleError(f"stage {st.index}: {a} before its RecvActivation")
    if isinstance(a, GRAD_PRODUCERS) and v < last and ("grad", a.mb, a.chunk) not in st.done:
        raise ScheduleError(f"stage {st.index}: {a} before its RecvGrad")
    if not isinstance(a, Forward) and ("fwd", a.mb, a.chunk) not in st.done:
        raise ScheduleError(f"stage {st.index}: {a} before its Forward")
    if isinstance(a, BackwardWeight) and ("bwd", a.mb, a.chunk) not in st.done:
        raise ScheduleError(f"stage {st.index}: {a} before its BackwardInput")


def simulate(
    schedule: list[list[Action]],
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    p2p_latency: float = 0.0,
    weight: float | None = None,
) -> SimResult:
    """Check ``schedule`` and time it with the given per-action costs.

    ``backward`` is a whole backward; split ones cost ``weight`` (W, default half of it)
    and ``backward − weight`` (B), so schedules with and without the split do equal work.

    Raises :class:`ScheduleError` as the module says.
    """
    check_complete(schedule)
    pp, _, vpp = _shape(schedule)
    last = pp * vpp - 1
    w_cost = backward / 2 if weight is None else weight
    if not 0 <= w_cost <= backward:
        raise ScheduleError(f"the weight-gradient cost {w_cost} must lie in [0, backward = {backward}]")
    cost = {Forward: forward, Backward: backward, BackwardInput: backward - w_cost, BackwardWeight: w_cost}
    stages = [_Stage(s, actions) for s, actions in enumerate(schedule)]
    # channel (src, dst) -> posted sends / receives: (key, post time), in posting order
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}

    def post(st: _Stage, batch: list[P2P]) -> None:
        st.posted = []
        for a in batch:
            _check_p2p(st, a, pp, vpp)
            sending = isinstance(a, (SendActivation, SendGrad))
            chan = (st.index, a.peer) if sending else (a.peer, st.index)
            side = sends if sending else recvs
            side.setdefault(chan, []).append((_message_key(st, a, pp), st.clock))
            st.posted.append(("send" if sending else "recv", chan, len(side[chan]) - 1, a))

    def try_complete(st: _Stage, batch: list[P2P] | None) -> bool:
        """Complete the posted batch (``None``: only await the deferred sends, at the end)."""
        own = st.posted or []
        receives = any(side == "recv" for side, *_ in own)
        waits = st.deferred + (own if receives else [])
        end = st.clock
        for side, chan, slot, _action in waits:
            other = (recvs if side == "send" else sends).get(chan, [])
            if slot >= len(other):
                return False
            mine = (sends if side == "send" else recvs)[chan][slot]
            if other[slot][0] != mine[0]:
                snd, rcv = (mine, other[slot]) if side == "send" else (other[slot], mine)
                raise ScheduleError(
                    f"channel stage {chan[0]} → stage {chan[1]}, message {slot}: sent {snd[0]} "
                    f"but the receiver expects {rcv[0]}"
                )
            end = max(end, other[slot][1])
        if waits:
            end += p2p_latency
        for side, _, _, a in own:
            if side == "recv":
                st.done.add(("act" if isinstance(a, RecvActivation) else "grad", a.mb, a.chunk))
        st.deferred = [] if receives else own
        if batch is not None:
            st.spans.append(Span(tuple(batch), st.clock, end))
            st.pc += 1
        st.clock, st.posted = end, None
        return True

    def compute(st: _Stage, a: Compute) -> None:
        _check_compute(st, a, pp, last)
        if isinstance(a, Forward):
            st.done.add(("fwd", a.mb, a.chunk))
            st.stored += 1
            st.peak = max(st.peak, st.stored)
        if isinstance(a, GRAD_PRODUCERS):
            st.done.add(("bwd", a.mb, a.chunk))
        if isinstance(a, FREES_ACTIVATIONS):  # a split backward keeps them until W
            st.stored -= 1
        c = cost[type(a)]
        st.spans.append(Span(a, st.clock, st.clock + c))
        st.clock += c
        st.busy += c
        st.pc += 1

    progress = True
    while progress:
        progress = False
        for st in stages:
            while st.pc < len(st.items):
                item = st.items[st.pc]
                if isinstance(item, Compute):
                    compute(st, item)
                else:
                    if st.posted is None:
                        post(st, item)
                    if not try_complete(st, item):
                        break
                progress = True
            if st.pc == len(st.items) and st.deferred and try_complete(st, None):
                progress = True
    stuck = [st for st in stages if st.pc < len(st.items) or st.deferred]
    if stuck:
        lines = [
            f"stage {st.index} at step {st.pc} waits on "
            + ", ".join(str(a) for *_, a in st.deferred + (st.posted or []))
            for st in stuck
        ]
        raise ScheduleError("schedule deadlocks:\n  " + "\n  ".join(lines))
    makespan = max(st.clock for st in stages)
    busy = [st.busy for st in stages]
    return SimResult(
        makespan=makespan,
        bubble_fraction=1.0 - sum(busy) / (pp * makespan) if makespan else 0.0,
        busy=busy,
        peak_activations=[st.peak for st in stages],
        timeline=[st.spans for st in stages],
    )
