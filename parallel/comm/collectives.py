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

from collections import OrderedDict
from typing import Sequence

import torch
import torch.distributed as dist

from ..timing import clock_for, named_range
from .counter import counting, record, record_time
from .late import complete_pending, defer, late_active
from .recorder import note

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); torch ≥ 2.4 has the old
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """The handle of a collective that needed no communication."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature
        return True

    def is_completed(self) -> bool:
        return True


def device_for(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live to travel through ``group``: this rank's GPU under NCCL, else the CPU.

    For the small control tensors (flags, barriers) code creates for a collective. Under
    torch's ``fake`` backend (a dry run) the ``meta`` device, where tensors hold no memory."""
    backend = str(dist.get_backend(group)) if dist.is_initialized() else "gloo"
    if "fake" in backend:
        return torch.device("meta")
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def runs_on_gloo(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether tensors on ``device`` travel through ``group`` by gloo: CPU tensors under a gloo
    backend or a mixed one (``"cpu:gloo,cuda:nccl"``). gloo completes each posted operation on
    its own; NCCL completes a batch of point-to-point operations as a whole."""
    return dist.is_initialized() and torch.device(device).type == "cpu" and "gloo" in str(dist.get_backend(group))


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
            return work if async_op else None
        clock = clock_for(tensors[0].device)
        if async_op:
            return TimedWork(fn(*args, async_op=True, **kwargs), label, name, clock)
        start = clock.mark()
        fn(*args, async_op=False, **kwargs)
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
    record(group_label(group), "all_reduce", _nbytes(tensor), n)
    note(group_label(group), group, "all_reduce", tensor)
    return _call(group_label(group), "all_reduce", async_op, (tensor,), dist.all_reduce, tensor, op=op, group=group)


class _SumOfReceived:
    """The handle of :func:`_reduce_scatter_by_all_to_all`: ``wait()`` completes the exchange,
    then sums the received chunks into the output."""

    def __init__(self, work, received: torch.Tensor, input: torch.Tensor, output: torch.Tensor, n: int):
        self._work, self._received, self._input, self._output, self._n = work, received, input, output, n

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature
        if self._work is not None:
            self._work.wait()
            _sum_chunks(self._received.view(self._n, -1), self._output.view(-1))
            _return_buffer(self._received)
            self._work = self._received = self._input = None
        return True

    def is_completed(self) -> bool:
        return self._work is None


def _sum_chunks(chunks: torch.Tensor, out: torch.Tensor) -> None:
    """``out = chunks[0] + chunks[1] + ...`` in rank order, written once: no zero fill first (torch.sum
    over dim 0 fills its output before adding: one more pass over it)."""
    torch.add(chunks[0], chunks[1], out=out)
    for i in range(2, chunks.shape[0]):
        out.add_(chunks[i])


# receive buffers of completed gloo reduce-scatters, reused (fresh large host buffers cost page faults),
# per (numel, dtype, device) as many as were once in flight together; only the A2A_POOL_SIZES sizes
# used last are kept (ZeRO's buckets come in one or two sizes), so a sweep over sizes does not grow it
A2A_POOL_SIZES = 4
_A2A_BUFFERS: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()


def _return_buffer(buffer: torch.Tensor) -> None:
    key = _buffer_key(buffer)
    _A2A_BUFFERS.setdefault(key, []).append(buffer)
    _A2A_BUFFERS.move_to_end(key)
    while len(_A2A_BUFFERS) > A2A_POOL_SIZES:
        _A2A_BUFFERS.popitem(last=False)


def _buffer_key(t: torch.Tensor) -> tuple:
    return (t.numel(), t.dtype, t.device)


def _reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, *, op, group, async_op: bool):
    """gloo's sum reduce-scatter as an all-to-all of the chunks, then a local sum: the same
    (N-1)/N of ``input`` sent, and 2.5× less CPU than gloo's own reduce-scatter (12.8 M fp32
    on 2 ranks: 23 vs 58–65 ms, 30 vs 75 ms wall; issue 17). Rank i receives every rank's
    chunk i and adds them, so each output element is still computed by one rank only.

    ``input`` is sent from where it lies, as NCCL's reduce-scatter reads it: the caller leaves it
    unchanged until the wait (the NCCL rule). ``output`` may be ``input``'s own chunk (in place, as
    NCCL allows): it is written only at the wait, after the exchange. Host memory: one receive
    buffer (``input``'s size) per call in flight, kept for reuse after the wait for the
    :data:`A2A_POOL_SIZES` sizes used last (ZeRO-0/1 with overlap: the gradient in the comm dtype,
    held between steps; not on GPUs)."""
    del op  # SUM (the caller checks)
    n = group_size(group)
    key = _buffer_key(input)
    free = _A2A_BUFFERS.get(key)
    if free:
        _A2A_BUFFERS.move_to_end(key)
    received = free.pop() if free else torch.empty(input.numel(), dtype=input.dtype, device=input.device)
    work = dist.all_to_all_single(received, input.reshape(-1), group=group, async_op=True)
    handle = _SumOfReceived(work, received, input, output, n)
    if async_op:
        return handle
    handle.wait()
    return None


def _gloo_sum(input: torch.Tensor, group, op) -> bool:
    return op == ReduceOp.SUM and runs_on_gloo(group, input.device)


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
    then. A sum on gloo runs as :func:`_reduce_scatter_by_all_to_all` (same bytes, counted the same)."""
    n = group_size(group)
    if input.numel() != output.numel() * n:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected output "
            f"{output.numel()} × group size {n} = {output.numel() * n}"
        )
    _check_in_place("reduce_scatter", output, input, group)
    if n == 1:
        if not _own_chunk(output, input, group):
            output.copy_(input.view_as(output))
        return _Done() if async_op else None
    record(group_label(group), "reduce_scatter", _nbytes(input), n)
    note(group_label(group), group, "reduce_scatter", input, also=(output,))
    by_all_to_all = _gloo_sum(input, group, op)
    if not by_all_to_all and runs_on_gloo(group, input.device) and _shares_memory(output, input):
        input = input.clone()  # gloo's own reduce-scatter is not documented to run in place
    return _call(
        group_label(group),
        "reduce_scatter",
        async_op,
        (output, input),
        _reduce_scatter_by_all_to_all if by_all_to_all else _reduce_scatter_tensor,
        output,
        input,
        op=op,
        group=group,
    )


class _AllOf:
    """One handle for several: ``wait()`` waits for each."""

    def __init__(self, works: list):
        self._works = works

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature
        for w in self._works:
            w.wait()
        self._works = []
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


# from this size of ``output`` on, gloo's all-gather runs as broadcasts (below it the n calls' latency
# outweighs the gain: 2 ranks, 16 KiB: 0.6 vs 0.4 ms wall; 1 MiB: 0.8 vs 1.4 ms; 8 MiB: 2.8 vs 4.5 ms)
GLOO_GATHER_BY_BROADCAST_BYTES = 1 << 20
# and only in groups of at most this many ranks, where it was measured (gloo's broadcast is a tree, so
# n broadcasts may lose to its ring all-gather in larger groups). 8 ranks on 2 shared cores, slowest
# rank, median of 5-7 (issue 17, sixth round), gloo's all-gather vs the broadcasts, wall / CPU ms:
# 1 MiB 19.4 / 9.0 vs 12.3 / 6.4; 4 MiB 18.6 / 5.5 vs 14.1 / 4.3; 16 MiB 36.8 / 10.8 vs 27.4 / 7.9;
# 64 MiB 252 / 60 vs 102 / 25 (2 and 4 ranks: see _all_gather_by_broadcasts)
GLOO_GATHER_BY_BROADCAST_MAX_RANKS = 8


def _all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool):
    """gloo's all-gather as one broadcast per rank of its chunk, straight into ``output``: every
    rank receives each other rank's chunk once, the same (N-1)/N of ``output`` per rank summed
    over the N broadcasts as a ring all-gather, at a third of gloo's own all-gather's CPU time
    (12.8 M fp32: 2 ranks 13 vs 41–49 ms CPU, 18 vs 60 ms wall; 4 ranks 17 vs 56 ms CPU; issue 17).
    ``input`` is copied into this rank's chunk at the call, unless it is that chunk (in place)."""
    n = group_size(group)
    chunks = output.view(-1).chunk(n)
    me = dist.get_rank(group)
    if not _own_chunk(input, output, group):  # in place: this rank's chunk is there already
        chunks[me].copy_(input.reshape(-1))
    handle = _AllOf([dist.broadcast(chunks[r], group=group, group_src=r, async_op=True) for r in range(n)])
    if async_op:
        return handle
    handle.wait()
    return None


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's ``input`` along dim 0 into ``output``.

    In place when ``input`` is this rank's chunk of ``output`` (NCCL's in-place form: no copy of the
    input first). Large on gloo (``GLOO_GATHER_BY_BROADCAST_BYTES``, at most
    ``GLOO_GATHER_BY_BROADCAST_MAX_RANKS`` ranks): :func:`_all_gather_by_broadcasts` (counted the same)."""
    n = group_size(group)
    if output.numel() != input.numel() * n:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected input "
            f"{input.numel()} × group size {n} = {input.numel() * n}"
        )
    if input.dtype != output.dtype:  # as torch's own all-gather refuses (the broadcast path would convert)
        raise ValueError(f"all_gather: input {input.dtype} and output {output.dtype} differ; use one dtype")
    _check_in_place("all_gather", input, output, group)
    if n == 1:
        if not _own_chunk(input, output, group):
            output.copy_(input.view_as(output))
        return _Done() if async_op else None
    record(group_label(group), "all_gather", _nbytes(output), n)
    note(group_label(group), group, "all_gather", output, also=(input,))
    by_broadcasts = _gloo_broadcasts(output, group)
    if not by_broadcasts and runs_on_gloo(group, output.device) and _shares_memory(output, input):
        input = input.clone()  # gloo's own all-gather is not documented to run in place
    return _call(
        group_label(group),
        "all_gather",
        async_op,
        (output, input),
        _all_gather_by_broadcasts if by_broadcasts else _all_gather_tensor,
        output,
        input,
        group=group,
    )


def _gloo_broadcasts(output: torch.Tensor, group) -> bool:
    return (
        _nbytes(output) >= GLOO_GATHER_BY_BROADCAST_BYTES
        and group_size(group) <= GLOO_GATHER_BY_BROADCAST_MAX_RANKS
        and output.is_contiguous()
        and runs_on_gloo(group, output.device)
    )


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
    before reading a received tensor.
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
        return []
    with named_range(lambda: f"comm.p2p[{label}]"):
        works = dist.batch_isend_irecv(ops)
    if not counting():
        return works
    clock = clock_for(ops[0].tensor.device)
    return [TimedWork(w, label, "p2p", clock) for w in works]
