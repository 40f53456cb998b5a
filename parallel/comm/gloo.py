"""The gloo seam: what gloo needs differently from NCCL, decided once per group, in one place.

:mod:`.collectives` and the pipeline executor ask :func:`transport` (per group and device type)
and never name a backend. :class:`Transport` is the plain ``torch.distributed`` call: NCCL's path,
the dry run's fake backend, and every backend but gloo. :class:`GlooTransport` serves CPU tensors
on a gloo group, or on the ``cpu:`` half of a mixed ``"cpu:gloo,cuda:nccl"`` one:

* a sum reduce-scatter is an all-to-all of the chunks and a local sum (:func:`_reduce_scatter_by_all_to_all`);
* an all-gather of at least :data:`GLOO_GATHER_BY_BROADCAST_BYTES`, in a group of at most
  :data:`GLOO_GATHER_BY_BROADCAST_MAX_RANKS` ranks, is one broadcast per rank (:func:`_all_gather_by_broadcasts`);
* otherwise gloo's own reduce-scatter and all-gather get a copy of an in-place input (they are
  not documented to run in place);
* point-to-point: one handle per op (an op completes alone, a send once its receive is posted), so
  a pipeline stage posts its receives early (``posts_receives_early``). A plain batch completes as a whole.

Both paths move and count the same bytes. :func:`tune_gloo` (or ``GRIDTRAIN_GLOO_TUNED=0`` in the
environment) turns the two collective rewrites off for groups made afterwards: gloo's own
reduce-scatter and all-gather then run, the algorithms NCCL runs, so that a CPU benchmark compares
like with like (p2p keeps one handle per op: that is gloo's semantics, not tuning). The decision is made when :func:`parallel.groups.build_groups`
makes a group, or on first use for any other group (WORLD, groups made by the user), and cached
per (group, device type). The measurements behind these choices: ``docs/performance.md``.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); torch ≥ 2.4 has the old
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# from this size of the output on (and in groups of at most this many ranks, where it was measured:
# gloo's broadcast is a tree), gloo's all-gather runs as broadcasts; read at each call
GLOO_GATHER_BY_BROADCAST_BYTES = 1 << 20
GLOO_GATHER_BY_BROADCAST_MAX_RANKS = 8

# receive buffers of completed all-to-all reduce-scatters, reused (fresh large host buffers cost page
# faults), per (numel, dtype, device) as many as were once in flight together; only the
# A2A_POOL_SIZES sizes used last are kept (ZeRO's buckets come in one or two sizes)
A2A_POOL_SIZES = 4
_A2A_BUFFERS: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()


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


def runs_on_gloo(group: dist.ProcessGroup | None, device: torch.device | str) -> bool:
    """Whether tensors on ``device`` travel through ``group`` by gloo: CPU tensors under a gloo
    backend or a mixed one (``"cpu:gloo,cuda:nccl"``)."""
    return dist.is_initialized() and torch.device(device).type == "cpu" and "gloo" in str(dist.get_backend(group))


class Posted(list):
    """The handles of one batch of sends and receives (wait on each), and which complete what.

    ``receives[i]``: the handles that complete receive ``i``; ``sends``: those that complete every
    send; ``sends_alone``: those that complete the sends without waiting for any receive (none
    where the batch completes as a whole)."""

    def __init__(self, works: list, n_sends: int, n_recvs: int, per_op: bool):
        super().__init__(works)
        if per_op:  # one handle per op, in posting order: the sends first
            self.sends = self.sends_alone = works[:n_sends]
            self.receives = [[w] for w in works[n_sends:]]
        else:
            self.sends, self.sends_alone, self.receives = works, [], [works] * n_recvs


class Transport:
    """The plain ``torch.distributed`` calls (NCCL's path); a batch of p2p completes as a whole."""

    posts_receives_early = False  # an early receive would tie this batch's completion to the next's
    one_handle_per_op = False

    def reduce_scatter(self, output, input, *, op, group, async_op: bool, in_place: bool):  # noqa: ARG002
        return _reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)

    def all_gather(self, output, input, *, group, async_op: bool, in_place: bool):  # noqa: ARG002
        return _all_gather_tensor(output, input, group=group, async_op=async_op)

    def exchange(self, ops: list, n_sends: int, wrap) -> Posted:
        """Post ``ops`` (the sends first) as one batch; ``wrap`` each handle (timing)."""
        works = [wrap(w) for w in dist.batch_isend_irecv(ops)]
        return Posted(works, n_sends, len(ops) - n_sends, per_op=self.one_handle_per_op)


class GlooTransport(Transport):
    """gloo on CPU tensors: see the module docstring."""

    posts_receives_early = True  # a peer's send lands without waiting for this rank to reach its batch
    one_handle_per_op = True

    def reduce_scatter(self, output, input, *, op, group, async_op: bool, in_place: bool):
        if op == dist.ReduceOp.SUM:
            return _reduce_scatter_by_all_to_all(output, input, group=group, async_op=async_op)
        input = input.clone() if in_place else input
        return super().reduce_scatter(output, input, op=op, group=group, async_op=async_op, in_place=False)

    def all_gather(self, output, input, *, group, async_op: bool, in_place: bool):
        if (
            output.numel() * output.element_size() >= GLOO_GATHER_BY_BROADCAST_BYTES
            and dist.get_world_size(group) <= GLOO_GATHER_BY_BROADCAST_MAX_RANKS
            and output.is_contiguous()
        ):
            return _all_gather_by_broadcasts(output, input, group=group, async_op=async_op, in_place=in_place)
        input = input.clone() if in_place else input
        return super().all_gather(output, input, group=group, async_op=async_op, in_place=False)


class GlooNativeTransport(GlooTransport):
    """gloo on CPU tensors through gloo's own reduce-scatter and all-gather (:func:`tune_gloo` off)."""

    def reduce_scatter(self, output, input, *, op, group, async_op: bool, in_place: bool):
        input = input.clone() if in_place else input
        return Transport.reduce_scatter(self, output, input, op=op, group=group, async_op=async_op, in_place=False)

    def all_gather(self, output, input, *, group, async_op: bool, in_place: bool):
        input = input.clone() if in_place else input
        return Transport.all_gather(self, output, input, group=group, async_op=async_op, in_place=False)


PLAIN, GLOO, GLOO_NATIVE = Transport(), GlooTransport(), GlooNativeTransport()
TUNED_ENV = "GRIDTRAIN_GLOO_TUNED"
_TUNING = {"on": os.environ.get(TUNED_ENV, "1") != "0"}


def tune_gloo(enabled: bool) -> bool:
    """Whether gloo groups chosen from now on rewrite reduce-scatter and all-gather (the module
    docstring); groups already chosen keep theirs. Returns the previous setting."""
    previous, _TUNING["on"] = _TUNING["on"], bool(enabled)
    return previous


_CHOSEN: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, Transport]] = weakref.WeakKeyDictionary()


def transport(group: dist.ProcessGroup | None, device: torch.device | str) -> Transport:
    """The transport of tensors on ``device`` through ``group`` (None: the world), chosen once per
    (group, device type) and kept for the group's life."""
    if not dist.is_initialized():
        return PLAIN
    chosen = _CHOSEN.setdefault(group if group is not None else dist.group.WORLD, {})
    kind = torch.device(device).type
    if kind not in chosen:
        chosen[kind] = (GLOO if _TUNING["on"] else GLOO_NATIVE) if runs_on_gloo(group, kind) else PLAIN
    return chosen[kind]


class _SumOfReceived:
    """The handle of :func:`_reduce_scatter_by_all_to_all`: ``wait()`` completes the exchange,
    then sums the received chunks into the output."""

    def __init__(self, work, received: torch.Tensor, input: torch.Tensor, output: torch.Tensor, n: int):
        self._work, self._received, self._input, self._output, self._n = work, received, input, output, n

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature
        if self._work is not None:
            self._work.wait()
            chunks, out = self._received.view(self._n, -1), self._output.view(-1)
            torch.add(chunks[0], chunks[1], out=out)  # written once: no zero fill first, as torch.sum does
            for i in range(2, self._n):
                out.add_(chunks[i])
            _return_buffer(self._received)
            self._work = self._received = self._input = None
        return True

    def is_completed(self) -> bool:
        return self._work is None


def _buffer_key(t: torch.Tensor) -> tuple:
    return (t.numel(), t.dtype, t.device)


def _return_buffer(buffer: torch.Tensor) -> None:
    key = _buffer_key(buffer)
    _A2A_BUFFERS.setdefault(key, []).append(buffer)
    _A2A_BUFFERS.move_to_end(key)
    while len(_A2A_BUFFERS) > A2A_POOL_SIZES:
        _A2A_BUFFERS.popitem(last=False)


def _reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool):
    """A sum reduce-scatter as an all-to-all of the chunks, then a local sum: the same (N-1)/N of
    ``input`` sent. Rank i receives every rank's chunk i and adds them in rank order, so each output
    element is still computed by one rank only.

    ``input`` is sent from where it lies: the caller leaves it unchanged until the wait (the NCCL
    rule). ``output`` may be ``input``'s own chunk: it is written only at the wait, after the
    exchange. Host memory: one receive buffer (``input``'s size) per call in flight, kept for reuse
    after the wait for the :data:`A2A_POOL_SIZES` sizes used last."""
    key = _buffer_key(input)
    free = _A2A_BUFFERS.get(key)
    if free:
        _A2A_BUFFERS.move_to_end(key)
    received = free.pop() if free else torch.empty(input.numel(), dtype=input.dtype, device=input.device)
    work = dist.all_to_all_single(received, input.reshape(-1), group=group, async_op=True)
    handle = _SumOfReceived(work, received, input, output, dist.get_world_size(group))
    if async_op:
        return handle
    handle.wait()
    return None


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


def _all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool, in_place: bool):
    """An all-gather as one broadcast per rank of its chunk, straight into ``output``: each rank
    receives every other rank's chunk once, the same (N-1)/N of ``output`` per rank as a ring
    all-gather. ``input`` is copied into this rank's chunk at the call, unless it is that chunk."""
    n = dist.get_world_size(group)
    chunks = output.view(-1).chunk(n)
    if not in_place:
        chunks[dist.get_rank(group)].copy_(input.reshape(-1))
    handle = _AllOf([dist.broadcast(chunks[r], group=group, group_src=r, async_op=True) for r in range(n)])
    if async_op:
        return handle
    handle.wait()
    return None
