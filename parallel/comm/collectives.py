"""Counted collectives and point-to-point transfers.

Thin wrappers over ``torch.distributed`` that every part of gridtrain calls
instead of the raw API, so that each call is reported to the active
:class:`~parallel.comm.counter.CommCounter` under its group's label (the
``group_desc`` given when the group was made: "tp", "dp", "pp", ...).

Conventions:

* ``group=None`` means the default (world) group.
* On a group of one rank nothing is sent: the call reduces to the local copy
  it stands for (or to nothing), and counts zero bytes.
* ``async_op=True`` returns a handle with ``wait()``, as torch does (a finished
  one for size-1 groups).
* Peers (``src``, ``dst``) are *global* ranks, as in ``torch.distributed``.
* A blocking call returns, under NCCL, once the collective is *queued*: the
  host has not waited for the peers. Host code that relies on the peers having
  arrived calls :func:`barrier` (or reads the result); :func:`late_completion`
  makes gloo behave the same way in tests (see :mod:`.late`).
* Every call is a named range (``comm.<op>[<group>]``) for torch.profiler and,
  under ``nsys``, NVTX; free when no profiler runs (:func:`parallel.timing.named_range`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..timing import clock_for, named_range
from .counter import counting, record, record_time
from .flight import RECORDER
from .gloo import Posted, device_for, transport
from .late import complete_pending, defer, late_active
from .recorder import note

ReduceOp = dist.ReduceOp


class _Done:
    """The handle of a collective that needed no communication."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature
        return True

    def is_completed(self) -> bool:
        return True


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_label(group: dist.ProcessGroup | None) -> str:
    """The name byte counts are filed under: the group's ``group_desc``."""
    if group is None or group is dist.group.WORLD:
        return "world"
    desc = getattr(group, "group_desc", "") or ""
    return desc if desc and desc != "undefined" else f"group:{getattr(group, 'group_name', id(group))}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TimedWork:
    """An asynchronous handle whose ``wait()`` reports its blocked time to the counters.

    Timed on ``clock`` (:class:`parallel.timing.StepClock` of the tensors' device): on CUDA, events on
    the compute stream around ``wait()``, i.e. how long that stream stalls for the collective."""

    def __init__(self, work, label: str, op: str, clock):
        self._work, self._label, self._op, self._clock = work, label, op, clock

    def wait(self, *args, **kwargs):
        start = self._clock.mark()
        out = self._work.wait(*args, **kwargs)
        record_time(self._label, self._op, self._clock.interval(start, self._clock.mark()))
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _call(label: str, name: str, async_op: bool, tensors: tuple, fn, *args, **kwargs):
    """Run a torch.distributed call; time it (blocking) or wrap its handle (async) while counting.

    ``tensors``: what the call reads and writes (late-completion mode waits for it when they are touched)."""
    with named_range(lambda: f"comm.{name}[{label}]"):
        if not async_op and late_active():  # test mode: return once queued, as NCCL does
            defer(fn(*args, async_op=True, **kwargs), *tensors, what=f"{name}[{label}]")
            return None
        if not counting():
            work = fn(*args, async_op=async_op, **kwargs)
            if async_op:
                return work
            RECORDER.done()  # the flight recorder's entry for this call (recorder.note): it returned
            return None
        clock = clock_for(tensors[0].device)
        if async_op:
            return TimedWork(fn(*args, async_op=True, **kwargs), label, name, clock)
        start = clock.mark()
        fn(*args, async_op=False, **kwargs)
        RECORDER.done()
        record_time(label, name, clock.interval(start, clock.mark()))
        return None


def barrier(group=None) -> None:
    """Return only once every rank of ``group`` has reached its own call: a host-synchronising barrier.

    A 4-byte all-reduce followed by a host read of its result (on NCCL the read
    waits for the device, so for every peer; torch's own NCCL barrier is the same
    all-reduce plus a device synchronisation, uncounted). Use it before host code
    that relies on other ranks' progress (files they wrote, directories they made).
    Also completes everything :func:`late_completion` left pending."""
    if group_size(group) > 1:
        flag = torch.zeros(1, device=device_for(group))
        all_reduce(flag, group=group)
        flag.item()  # the host read that makes this a barrier (see docstring)
    complete_pending()


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``."""
    n = group_size(group)
    if n == 1:
        return _Done() if async_op else None
    if (
        RECORDER.drill is not None
        and (tensor := RECORDER.drill.before("all_reduce", group_label(group), tensor)) is None
    ):
        return _Done() if async_op else None  # a fault drill: this rank skips it (flight.Drill)
    record(group_label(group), "all_reduce", _nbytes(tensor), n)
    note(group_label(group), group, "all_reduce", tensor)
    return _call(group_label(group), "all_reduce", async_op, (tensor,), dist.all_reduce, tensor, op=op, group=group)


def _own_chunk(part: torch.Tensor, whole: torch.Tensor, group) -> bool:
    """Whether ``part`` is this rank's chunk of ``whole`` itself (a collective in place), not a copy."""
    return (
        part.untyped_storage() is whole.untyped_storage()
        and part.is_contiguous()
        and whole.is_contiguous()
        and part.storage_offset() == whole.storage_offset() + dist.get_rank(group) * part.numel()
    )


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (contiguous) overlap in memory."""
    if a.untyped_storage() is not b.untyped_storage():
        return False
    a0, b0 = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_in_place(kind: str, part: torch.Tensor, whole: torch.Tensor, group) -> None:
    """Refuse ``part`` overlapping ``whole`` anywhere but as this rank's chunk of it: the one
    in-place form NCCL allows (elsewhere it would silently read what it already wrote); refused
    on every backend alike, so that a CPU run catches what would corrupt a GPU run."""
    if _shares_memory(part, whole) and not _own_chunk(part, whole, group):
        raise ValueError(
            f"{kind}: the per-rank buffer overlaps the full one at an element offset "
            f"{part.storage_offset() - whole.storage_offset()}, not this rank's chunk "
            f"(rank {dist.get_rank(group)} × {part.numel()}); pass separate buffers or this rank's chunk"
        )


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False):
    """Reduce ``input`` (N equal chunks along dim 0) over ``group``; rank i keeps chunk i.

    In place when ``output`` is this rank's chunk of ``input`` (NCCL's in-place form; no buffer
    for the output). ``input`` is read until the collective completes: leave it unchanged until
    then. Run by the group's transport (:mod:`.gloo`; the same bytes, counted the same)."""
    n = group_size(group)
    if input.numel() != output.numel() * n:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected output "
            f"{output.numel()} × group size {n} = {output.numel() * n}"
        )
    return _scatter_or_gather("reduce_scatter", output, input, input, output, group, async_op, op=op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's ``input`` along dim 0 into ``output``.

    In place when ``input`` is this rank's chunk of ``output`` (NCCL's in-place form: no copy of the
    input first). Run by the group's transport (:mod:`.gloo`; the same bytes, counted the same)."""
    n = group_size(group)
    if output.numel() != input.numel() * n:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected input "
            f"{input.numel()} × group size {n} = {input.numel() * n}"
        )
    if input.dtype != output.dtype:  # as torch's own all-gather refuses (a broadcast would convert)
        raise ValueError(f"all_gather: input {input.dtype} and output {output.dtype} differ; use one dtype")
    return _scatter_or_gather("all_gather", output, input, output, input, group, async_op)


def _scatter_or_gather(name: str, output, input, whole, part, group, async_op: bool, **kwargs):
    """The rest of :func:`reduce_scatter` / :func:`all_gather`: ``part`` is the per-rank buffer,
    ``whole`` the full one (counted)."""
    _check_in_place(name, part, whole, group)
    in_place = _own_chunk(part, whole, group)
    if group_size(group) == 1:
        if not in_place:
            output.copy_(input.view_as(output))
        return _Done() if async_op else None
    label = group_label(group)
    record(label, name, _nbytes(whole), group_size(group))
    note(label, group, name, whole, also=(part,))
    fn = getattr(transport(group, whole.device), name)
    return _call(label, name, async_op, (output, input), fn, output, input, group=group, in_place=in_place, **kwargs)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    *,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
):
    """Chunk i of ``input`` (dim 0) goes to rank i; ``output`` holds what each sent here.

    Equal chunks by default; ``input_split_sizes`` / ``output_split_sizes`` (rows per rank, host
    integers) give uneven ones (the receiver must know its sizes beforehand: exchange counts first).
    Counted as a payload of ``input``'s bytes (sent: (N-1)/N of it, exact for equal chunks)."""
    n = group_size(group)
    if n == 1:
        output.copy_(input)
        return _Done() if async_op else None
    record(group_label(group), "all_to_all", _nbytes(input), n)
    note(group_label(group), group, "all_to_all", input, also=(output,))
    return _call(
        group_label(group),
        "all_to_all",
        async_op,
        (output, input),
        dist.all_to_all_single,
        output,
        input,
        output_split_sizes,
        input_split_sizes,
        group=group,
    )


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``."""
    n = group_size(group)
    if n == 1:
        return _Done() if async_op else None
    record(group_label(group), "broadcast", _nbytes(tensor), n)
    note(group_label(group), group, "broadcast", tensor)
    return _call(group_label(group), "broadcast", async_op, (tensor,), dist.broadcast, tensor, src=src, group=group)


def _p2p(name: str, tensor: torch.Tensor, peer: int, group) -> None:
    label = group_label(group)
    record(label, name, _nbytes(tensor), 2)
    note(label, group, name, tensor, peer=peer)
    with named_range(lambda: f"comm.{name}[{label}]"):
        if late_active():
            start = dist.isend if name == "send" else dist.irecv
            defer(start(tensor, peer, group=group), tensor, what=f"{name}[{label}]")
            return
        clock = clock_for(tensor.device)
        start = clock.mark() if counting() else None
        (dist.send if name == "send" else dist.recv)(tensor, peer, group=group)
        RECORDER.done()
        if counting():
            record_time(label, name, clock.interval(start, clock.mark()))


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Blocking send to global rank ``dst``."""
    _p2p("send", tensor, dst, group)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Blocking receive from global rank ``src`` into ``tensor``."""
    _p2p("recv", tensor, src, group)


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
    group=None,
) -> list:
    """Post a batch of non-blocking sends and receives at once; return their handles.

    ``sends`` and ``recvs`` are ``(tensor, global_peer_rank)`` pairs. Batching
    lets NCCL fuse the transfers and avoids the send/recv ordering deadlocks of
    blocking p2p between pipeline neighbours. Call ``wait()`` on every handle
    before reading a received tensor. The result (a :class:`~.gloo.Posted`, a list of the
    handles) also says which handles complete each receive and the sends.
    """
    ops = []
    label = group_label(group)
    for t, peer in sends:
        record(label, "send", _nbytes(t), 2)
        note(label, group, "send", t, peer=peer)
        ops.append(dist.P2POp(dist.isend, t, peer, group))
    for t, peer in recvs:
        record(label, "recv", _nbytes(t), 2)
        note(label, group, "recv", t, peer=peer)
        ops.append(dist.P2POp(dist.irecv, t, peer, group))
    if not ops:
        return Posted([], 0, 0, per_op=True)
    device = ops[0].tensor.device
    clock = clock_for(device) if counting() else None
    with named_range(lambda: f"comm.p2p[{label}]"):
        return transport(group, device).exchange(
            ops, len(sends), lambda w: TimedWork(w, label, "p2p", clock) if clock else w
        )
