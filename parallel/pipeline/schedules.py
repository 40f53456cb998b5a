"""Pipeline schedules as data: for every stage, the ordered list of actions.

A schedule is ``list[list[Action]]``: ``schedule[s]`` is what pipeline stage
``s`` does, in order. Pure functions build them; :mod:`.simulator` checks and
times them without processes; :mod:`.executor` merely runs one stage's list.

Actions name a micro-batch ``mb`` and a model ``chunk`` (the rank's virtual
stage, 0 unless interleaved). Virtual stage ``v = chunk · pp + stage`` (rank
``v % pp`` holds it); activations flow from ``v`` to ``v + 1``, gradients back.
Transfers name the ``peer`` *stage* (its index in the pipeline group).

Consecutive transfers form one **batch**, posted together (``batch_isend_irecv``)
and awaited together: the sends after one computation and the receives
before the next, e.g. Megatron's ``send_forward_recv_backward``. Batching is
what makes the steady state of 1F1B free of send/recv ordering deadlocks.

    >>> for a in one_f_one_b(pp=2, m=2)[1]: print(a)
    RecvActivation(mb=0, chunk=0, peer=0)
    Forward(mb=0, chunk=0)
    Backward(mb=0, chunk=0)
    SendGrad(mb=0, chunk=0, peer=0)
    RecvActivation(mb=1, chunk=0, peer=0)
    Forward(mb=1, chunk=0)
    Backward(mb=1, chunk=0)
    SendGrad(mb=1, chunk=0, peer=0)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterable


class ScheduleError(ValueError):
    """A schedule that cannot be built or run; the message names the numbers."""


# --------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Compute:
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class Forward(Compute):
    """Run ``chunk`` forward on micro-batch ``mb``; keep what backward needs."""


@dataclass(frozen=True)
class Backward(Compute):
    """Backward of ``chunk`` for ``mb`` (input and weight gradients); frees its activations."""


@dataclass(frozen=True)
class BackwardInput(Compute):
    """Zero-bubble "B": the gradient w.r.t. the input of ``chunk`` for ``mb`` only (what the
    previous stage waits for); the activations stay stored for the weight gradient."""


@dataclass(frozen=True)
class BackwardWeight(Compute):
    """Zero-bubble "W": the weight gradients of ``chunk`` for ``mb`` (after its
    :class:`BackwardInput`), accumulated into ``.grad``; frees its activations."""


GRAD_PRODUCERS = (Backward, BackwardInput)  # computations that produce the gradient sent upstream
FREES_ACTIVATIONS = (Backward, BackwardWeight)  # computations after which a micro-batch is no longer stored


@dataclass(frozen=True)
class P2P:
    mb: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class SendActivation(P2P):
    """Send the output of (``mb``, ``chunk``) to stage ``peer``."""


@dataclass(frozen=True)
class RecvActivation(P2P):
    """Receive the input of (``mb``, ``chunk``) from stage ``peer``."""


@dataclass(frozen=True)
class SendGrad(P2P):
    """Send the gradient w.r.t. the input of (``mb``, ``chunk``) to stage ``peer``."""


@dataclass(frozen=True)
class RecvGrad(P2P):
    """Receive the gradient w.r.t. the output of (``mb``, ``chunk``) from stage ``peer``."""


Action = Compute | P2P


# ------------------------------------------------------------------ validation
def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_schedule_args(pp: int, m: int, vpp: int = 1, *, name: str = "schedule") -> None:
    """Refuse sizes a schedule cannot use (pure: call it on every rank before any p2p)."""
    _positive("pp", pp)
    _positive("number of micro-batches m", m)
    _positive("vpp", vpp)
    if vpp > 1 and m % pp:
        lo = max(pp, m - m % pp)
        raise ScheduleError(
            f"{name}: interleaved 1F1B needs the number of micro-batches to be a multiple of "
            f"pp; got m={m}, pp={pp} (use m={lo} or {lo + pp}, or vpp=1)"
        )


# ------------------------------------------------------- virtual-stage arithmetic
def virtual_stage(chunk: int, stage: int, pp: int) -> int:
    """The virtual stage of chunk ``chunk`` on pipeline rank ``stage``: ``chunk·pp + stage``
    (Megatron's interleaving: virtual stage ``v`` lives on rank ``v mod pp``)."""
    return chunk * pp + stage


def peer_of(v: int, pp: int, vpp: int, *, to_next: bool) -> int | None:
    """The rank holding the virtual stage after (``to_next``) or before ``v`` in a pipeline
    of ``pp`` ranks × ``vpp`` chunks; ``None`` past either end."""
    if v == (pp * vpp - 1 if to_next else 0):
        return None
    return (v + (1 if to_next else -1)) % pp


def points_next(action: P2P) -> bool:
    """Whether a transfer talks to the next virtual stage (activation sends, gradient receives)."""
    return isinstance(action, (SendActivation, RecvGrad))


# ------------------------------------------------------------------- builders
def _with_p2p(order: list[Compute], stage: int, pp: int, vpp: int, segments: list[int] | None = None) -> list[Action]:
    """Insert the transfers each computation needs.

    ``segments`` cuts ``order`` into consecutive runs (lengths; default: one
    computation each). Before each run comes one batch: the sends of the
    previous run, then the receives the run needs. Runs of two (a forward and
    a backward, Megatron's interleaved steady state) prefetch the backward's
    gradient together with the forward's input.
    """
    segments = segments or [1] * len(order)
    if sum(segments) != len(order):
        raise ScheduleError(f"segments {segments} do not cover {len(order)} computations")
    out: list[Action] = []
    pending_sends: list[P2P] = []
    start = 0
    for length in segments:
        run = order[start : start + length]
        start += length
        recvs: list[P2P] = []
        sends: list[P2P] = []
        for a in run:
            v = virtual_stage(a.chunk, stage, pp)
            prev, nxt = peer_of(v, pp, vpp, to_next=False), peer_of(v, pp, vpp, to_next=True)
            if isinstance(a, Forward) and prev is not None:
                recvs.append(RecvActivation(a.mb, a.chunk, prev))
            if isinstance(a, GRAD_PRODUCERS) and nxt is not None:
                recvs.append(RecvGrad(a.mb, a.chunk, nxt))
            if isinstance(a, Forward) and nxt is not None:
                sends.append(SendActivation(a.mb, a.chunk, nxt))
            if isinstance(a, GRAD_PRODUCERS) and prev is not None:
                sends.append(SendGrad(a.mb, a.chunk, prev))
        out += pending_sends + recvs + run
        pending_sends = sends
    return out + pending_sends


def gpipe(pp: int, m: int) -> list[list[Action]]:
    """GPipe: every forward, then every backward. Stage memory: all m micro-batches."""
    check_schedule_args(pp, m, name="gpipe")
    order = [Forward(i) for i in range(m)] + [Backward(i) for i in range(m)]
    return [_with_p2p(order, s, pp, 1) for s in range(pp)]


def one_f_one_b_order(pp: int, m: int, stage: int) -> list[Compute]:
    """1F1B computation order of one stage: ``min(pp − stage − 1, m)`` warm-up
    forwards, then one forward / one backward, then the cool-down backwards."""
    warmup = min(pp - stage - 1, m)
    order: list[Compute] = [Forward(i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Forward(warmup + i), Backward(i)]
    order += [Backward(i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): stage s holds at most min(pp − s, m) micro-batches."""
    check_schedule_args(pp, m, name="1f1b")
    return [_with_p2p(one_f_one_b_order(pp, m, s), s, pp, 1) for s in range(pp)]


def _interleaved_unit(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of the k-th forward (or backward) of a stage (Megatron's order):
    groups of pp micro-batches sweep chunk 0, 1, ... (backward: the last chunk first)."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    return group * pp + within % pp, chunk if forward else vpp - 1 - chunk


def interleaved_1f1b(pp: int, m: int, vpp: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: each rank holds ``vpp`` model chunks, the
    bubble shrinks ``vpp``-fold. Needs m a multiple of pp. Warm-up of stage s:
    ``2·(pp − s − 1) + (vpp − 1)·pp`` forwards (all, when that exceeds m·vpp)."""
    check_schedule_args(pp, m, vpp, name="interleaved_1f1b")
    total = m * vpp
    schedule = []
    for s in range(pp):
        warmup = min(2 * (pp - s - 1) + (vpp - 1) * pp, total)
        fwd = [Forward(*_interleaved_unit(k, pp, vpp, True)) for k in range(total)]
        bwd = [Backward(*_interleaved_unit(k, pp, vpp, False)) for k in range(total)]
        steady = total - warmup
        order: list[Compute] = fwd[:warmup]
        for i in range(steady):
            order += [fwd[warmup + i], bwd[i]]
        order += bwd[steady:]
        # one batch per forward/backward pair in the steady state (see _with_p2p)
        segments = [1] * warmup + [2] * steady + [1] * warmup
        schedule.append(_with_p2p(order, s, pp, vpp, segments))
    return schedule


def zb_h1_order(pp: int, m: int, stage: int) -> list[Compute]:
    """ZB-H1 computation order of one stage (Qi et al. 2023, "Zero Bubble Pipeline
    Parallelism", §2.1): 1F1B's warm-up of ``w = min(pp − stage − 1, m)`` forwards and
    its forward/backward alternation, with each backward split into B (input gradient,
    sent upstream at once) and W (weight gradient). Stage ``s`` postpones its W passes
    by ``pp − 1 − w`` (= s) micro-batches, so every stage holds at most ``min(pp, m)``
    micro-batches — 1F1B's peak, the one of its first stage — and the postponed W passes
    fill the cool-down, where 1F1B idles."""
    warmup = min(pp - stage - 1, m)
    delay = pp - 1 - warmup
    order: list[Compute] = [Forward(i) for i in range(warmup)]
    pending: list[int] = []

    def backward(i: int) -> None:
        order.append(BackwardInput(i))
        pending.append(i)
        if len(pending) > delay:
            order.append(BackwardWeight(pending.pop(0)))

    for i in range(m - warmup):
        order.append(Forward(warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    order += [BackwardWeight(i) for i in pending]
    return order


def zb_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 (:func:`zb_h1_order`): with B and W each half a backward, its bubble is a third
    of 1F1B's at the same peak activation memory (:func:`zb_h1_makespan`)."""
    check_schedule_args(pp, m, name="zb-h1")
    return [_with_p2p(zb_h1_order(pp, m, s), s, pp, 1) for s in range(pp)]


def zb_h1_makespan(pp: int, m: int, forward: float, backward_input: float, backward_weight: float) -> float:
    """The step time of ZB-H1 with no p2p latency (the paper's closed form, m ≥ pp):
    ``m·(F + B + W) + (pp − 1)·(F + B − W)`` — 1F1B's bubble is ``(pp − 1)·(F + B + W)``."""
    f, b, w = forward, backward_input, backward_weight
    return m * (f + b + w) + (pp - 1) * max(f + b - w, 0.0)


SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved",
    "zb-h1",
)  # the one home of the schedule names (config: parallel.pp_schedule)


def schedule_problem(name: str, pp: int, vpp: int, *, prefix: str = "") -> str | None:
    """Why schedule ``name`` cannot run ``pp`` ranks × ``vpp`` chunks, or ``None`` if it can.

    The one rule the library and the config share: ``interleaved`` needs ``vpp ≥ 2`` and
    ``pp ≥ 2``; ``vpp > 1`` needs ``interleaved`` (``zb-h1`` is not interleaved). ``prefix`` qualifies the key names in the
    message (the config passes ``"parallel."``).
    """
    if name not in SCHEDULES:
        return f"{prefix}pp_schedule={name!r} is not one of {SCHEDULES}"
    if name == "interleaved" and vpp < 2:
        return f"{prefix}pp_schedule=interleaved needs {prefix}vpp ≥ 2 virtual stages per rank"
    if name == "interleaved" and pp < 2:
        return f"{prefix}pp_schedule=interleaved needs {prefix}pp ≥ 2 (with pp=1 use 1f1b)"
    if vpp > 1 and name == "zb-h1":
        return (
            f"{prefix}pp_schedule=zb-h1 runs one model chunk per rank, not {prefix}vpp={vpp}: use "
            f"{prefix}vpp=1, or {prefix}pp_schedule=interleaved for virtual stages"
        )
    if vpp > 1 and name != "interleaved":
        return f"{prefix}vpp={vpp} needs {prefix}pp_schedule=interleaved"
    return None


def zero_bubble_problem(name: str, checkpointing: str, zero: int) -> str | None:
    """Why the executor cannot run schedule ``name`` with this recomputation and ZeRO stage (only ``zb-h1``
    has such limits), or ``None``: the one rule the recipe's validation and ``mode=recommend`` share."""
    if name != "zb-h1":
        return None
    if checkpointing != "none":
        return (
            f"parallel.pp_schedule=zb-h1 with model.activation_checkpointing={checkpointing}: "
            "zero bubble runs each micro-batch's backward in two autograd passes (input gradient, then weight "
            "gradient), and recomputed blocks would be recomputed again in each (with their collectives); "
            "set model.activation_checkpointing=none, or parallel.pp_schedule=1f1b to keep recomputation"
        )
    if zero == 3:
        return (
            "parallel.pp_schedule=zb-h1 with parallel.zero=3: the weight-gradient pass (W) runs after ZeRO-3 "
            "has freed the block's gathered parameters, and some of its kernels (norms) read them; use "
            "parallel.zero ≤ 2 with zb-h1, or parallel.pp_schedule=1f1b with zero=3"
        )
    return None


def build_schedule(name: str, pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    """The schedule called ``name`` (one of :data:`SCHEDULES`; config key ``parallel.pp_schedule``).

    Raises :class:`ScheduleError` with :func:`schedule_problem`'s message on a combination the
    config refuses too (``interleaved`` with ``vpp=1``, ``vpp > 1`` without it).
    """
    problem = schedule_problem(name, pp, vpp)
    if problem:
        raise ScheduleError(problem)
    if name == "interleaved":
        return interleaved_1f1b(pp, m, vpp)
    if name == "zb-h1":
        return zb_h1(pp, m)
    return gpipe(pp, m) if name == "gpipe" else one_f_one_b(pp, m)


def batches(actions: Iterable[Action]) -> list[Compute | list[P2P]]:
    """Group one stage's list into computations and batches of consecutive transfers."""
    out: list[Compute | list[P2P]] = []
    for a in actions:
        if isinstance(a, P2P):
            if out and isinstance(out[-1], list):
                out[-1].append(a)
            else:
                out.append([a])
        else:
            out.append(a)
    return out
