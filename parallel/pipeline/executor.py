"""Run one stage's action list over the pipeline group.

:class:`PipelineExecutor` does nothing on its own initiative: it walks the list a schedule
function produced for this stage (:mod:`.schedules`), computing and transferring exactly as the
list says, so the simulator's verdicts (deadlock-free, peak stored activations) hold for the run.

Communication (all through :mod:`parallel.comm`):

* each batch of consecutive transfers is one ``comm.exchange`` on ``pp_group``, posted where the
  list puts it and awaited where a computation reads it (:mod:`.transfers`, which says how).
  Shapes and dtype are fixed up front: no shape messages; ``prod(activation_shape) · itemsize``
  bytes per transfer, ``1/tp`` of that with a ``tp_group``.
* with ``tp_group`` (Megatron's scatter-gather): TP rank r sends only slice r of the flattened,
  TP-replicated tensor to TP rank r of the peer stage, which rebuilds it with one ``all_gather``
  on ``tp_group``. No byte crosses the pipeline twice.
* after the last backward: an ``all_reduce`` (sum) on ``embedding_group`` of the gradient of
  every parameter marked :func:`parallel.params.mark_shared_embedding`, and a 4-byte
  ``broadcast`` of the loss on ``pp_group`` from the last stage (:meth:`~PipelineExecutor.share_loss`;
  ``run(share_loss=False)`` leaves it to the caller, who issues it only when the loss is read).

Zero-bubble lists split a backward into ``BackwardInput`` (B: the input gradient, sent upstream
at once) and ``BackwardWeight`` (W: the weight gradients, later; the micro-batch stays stored
until then), run by :mod:`.split_backward`. On the first virtual stage B is the whole backward.

``final_backward(chunk)`` (optional) returns a context manager entered around the *last*
backward of each chunk in the step (its last ``Backward``, or the last one that accumulates weight
gradients: W, or B on the first virtual stage), e.g. ``ZeroDataParallel.sync_gradients``, so that
a chunk's data-parallel reduction launches during that backward, bucket by bucket, while other
work goes on (Megatron's ``overlap_grad_reduce``).

The loss is ``loss_fn(output, target)`` of the last virtual stage; each micro-batch's backward
starts from ``loss / m``, so the gradients accumulated into ``.grad`` (zero them before a step)
are those of the mean loss, which :meth:`~PipelineExecutor.run` returns on every stage. A
micro-batch's stored tensors are dropped the moment its backward has run.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm.flight import RECORDER
from ..params import is_shared_embedding
from ..timing import StepClock, named_range
from .schedules import (
    P2P,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Compute,
    Forward,
    RecvGrad,
    ScheduleError,
    SendGrad,
    batches,
    peer_of,
    points_next,
    virtual_stage,
)
from .simulator import Span
from .split_backward import SavedTensorStash, WeightGradWork, backward_input, backward_weight
from .transfers import StageTransfers, receives_ahead


def _range_name(item: Compute | list[P2P]) -> str:
    """The profiler range of one schedule item: ``Forward(mb=3, chunk=0)``, ``Send+Recv[...]`` for a batch."""
    if isinstance(item, Compute):
        return f"{type(item).__name__}(mb={item.mb}, chunk={item.chunk})"
    return "+".join(f"{type(a).__name__}(mb={a.mb}, chunk={a.chunk})" for a in item)


class PipelineExecutor(StageTransfers):
    """Runs ``actions`` (this stage's list) with ``chunks`` (this rank's model chunks).

    Args:
        chunks: the rank's modules, chunk ``c`` being virtual stage ``c·pp + stage``.
            Chunk 0 of stage 0 takes the micro-batch input; every other chunk takes
            and every chunk but the very last returns a tensor of ``activation_shape``.
        actions: this stage's list from a schedule function, or the whole schedule (one
            list per stage; every rank then also checks it was built for this many stages).
        pp_group: the pipeline group; its rank order is the stage order, peers named
            in actions are indices into it.
        activation_shape, dtype: of every tensor crossing a stage boundary.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last virtual stage.
        tp_group: optional; enables the scatter-gather transfer described above.
        embedding_group: optional; the first + last stage group for tied embeddings.
        record_timeline: keep a :class:`~.simulator.Span` per computation / transfer batch
            in ``timeline``, in seconds since the start of :meth:`run`, timed with
            :class:`parallel.timing.StepClock` (CUDA events on the compute stream on a GPU,
            resolved once after the step; host clock on the CPU). Stages align when they
            start together (a host-synchronising barrier before the step) or by adding
            ``timeline_origin``, the host ``time.perf_counter()`` at the start.
        final_backward: optional ``final_backward(chunk) -> context manager``, entered around
            the last backward of each chunk (see the module docstring).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        actions: Sequence[Action] | Sequence[Sequence[Action]],
        *,
        pp_group: dist.ProcessGroup,
        activation_shape: Sequence[int],
        dtype: torch.dtype,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tp_group: dist.ProcessGroup | None = None,
        embedding_group: dist.ProcessGroup | None = None,
        record_timeline: bool = False,
        final_backward: Callable[[int], contextlib.AbstractContextManager] | None = None,
    ):
        self.chunks = list(chunks)
        self.final_backward = final_backward
        self.pp_group = pp_group
        self.stage_ranks = dist.get_process_group_ranks(pp_group)
        self.pp = len(self.stage_ranks)
        self.stage = self.stage_ranks.index(dist.get_rank())
        if actions and not isinstance(actions[0], (Compute, P2P)):  # the whole schedule
            if len(actions) != self.pp:
                raise ScheduleError(
                    f"the schedule has {len(actions)} stages but the pipeline group has {self.pp} "
                    f"ranks; build it with pp={self.pp}"
                )
            actions = actions[self.stage]
        self.items = batches(actions)
        # evaluation runs the same order with every backward and gradient transfer left out:
        # removing waits from a deadlock-free list cannot create a deadlock
        backward_kinds = (Backward, BackwardInput, BackwardWeight, SendGrad, RecvGrad)
        self.forward_items = batches(a for a in actions if not isinstance(a, backward_kinds))
        # per batch, the next batch's receives (posted with it where the transport posts receives early)
        self._ahead, self._forward_ahead = receives_ahead(self.items), receives_ahead(self.forward_items)
        self.vpp = len(self.chunks)
        self.activation_shape = tuple(activation_shape)
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.tp_group = tp_group
        self.tp = comm.group_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_group_rank(tp_group, dist.get_rank()) if self.tp > 1 else 0
        self.embedding_group = embedding_group
        self.record_timeline = record_timeline
        self.event_class = None  # StepClock's CUDA event class (tests inject a fake)
        self.timeline: list[Span] = []
        self.peak_activations = 0
        self.num_microbatches = self._check(actions)
        # chunks whose backward B/W split (split_backward): their nodes run under autograd.grad, twice
        self.split_chunks: set[int] = {
            a.chunk for a in actions if isinstance(a, BackwardInput) and not self._is_first(a.chunk)
        }
        # the action that accumulates a chunk's weight gradients last (the last one wins): a split
        # backward's W, except on the first virtual stage, whose B runs the whole backward
        self._last_backward = {
            a.chunk: a
            for a in actions
            if isinstance(a, Backward)
            or isinstance(a, BackwardWeight if not self._is_first(a.chunk) else BackwardInput)
        }

    # ------------------------------------------------------------ validation
    def _check(self, actions: Sequence[Action]) -> int:
        """Refuse a list that does not fit these chunks or shapes (before any p2p)."""
        if not self.chunks:
            raise ScheduleError("a pipeline stage needs at least one model chunk")
        computes = [a for a in actions if isinstance(a, Compute)]
        if not computes:
            raise ScheduleError(f"stage {self.stage}: the action list has no computation")
        bad = sorted({a.chunk for a in actions if not 0 <= a.chunk < self.vpp})
        if bad:
            raise ScheduleError(
                f"stage {self.stage}: actions name chunks {bad} but this rank holds "
                f"{self.vpp} chunk(s); build the schedule with vpp={self.vpp}"
            )
        for a in actions:
            if isinstance(a, P2P):
                v = self._virtual(a.chunk)
                want = peer_of(v, self.pp, self.vpp, to_next=points_next(a))
                if a.peer != want:
                    raise ScheduleError(
                        f"stage {self.stage}: {a} names peer stage {a.peer}, but in a pipeline of "
                        f"{self.pp} ranks × {self.vpp} chunk(s) virtual stage {v}'s peer is {want}; "
                        f"was the schedule built for pp={self.pp}?"
                    )
        numel = math.prod(self.activation_shape)
        if numel % self.tp:
            raise ScheduleError(
                f"activation_shape {self.activation_shape} ({numel} elements) does not split "
                f"over tp={self.tp} ranks for the scatter-gather transfer"
            )
        return 1 + max(a.mb for a in computes)

    def _virtual(self, chunk: int) -> int:
        return virtual_stage(chunk, self.stage, self.pp)

    def _is_first(self, chunk: int) -> bool:
        return self._virtual(chunk) == 0

    def _is_last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.pp * self.vpp - 1

    # -------------------------------------------------------------- the step
    def run(
        self,
        microbatch_inputs: Sequence[torch.Tensor] | None = None,
        microbatch_targets: Sequence[torch.Tensor] | None = None,
        *,
        context: Sequence[dict] | None = None,
        forward_only: bool = False,
        share_loss: bool = True,
    ) -> torch.Tensor:
        """One step: every action of this stage, then the tied-embedding
        all-reduce and the loss broadcast. Returns the mean micro-batch loss
        (a 0-d tensor) on every stage. Inputs are read on the first stage only,
        targets on the last only; each must hold one tensor per micro-batch.
        ``context``: per micro-batch, keyword arguments every chunk's forward takes, on every
        stage (packed documents' ``positions``); None: chunks are called with the activation alone.

        ``share_loss=False``: no broadcast; the loss is meaningful on the last
        stage only, and :meth:`share_loss` (on every stage) completes it later.

        ``forward_only=True`` (evaluation): the forwards and activation
        transfers of the same list under ``torch.no_grad()``; nothing is
        stored for backward and no gradient moves."""
        m = self.num_microbatches
        for name, seq, needed in (
            ("microbatch_inputs", microbatch_inputs, self._is_first(0)),
            ("microbatch_targets", microbatch_targets, self._is_last(self.vpp - 1)),
        ):
            if needed and (seq is None or len(seq) != m):
                got = "none" if seq is None else len(seq)
                raise ScheduleError(f"stage {self.stage}: the schedule runs {m} micro-batches but {name} has {got}")
        self.device = next((p.device for c in self.chunks for p in c.parameters()), torch.device("cpu"))
        self._inputs = microbatch_inputs
        self._targets = microbatch_targets
        if context is not None and len(context) != m:
            raise ScheduleError(
                f"stage {self.stage}: the schedule runs {m} micro-batches but context has {len(context)}"
            )
        self._context = context
        self._start_transfers()
        self._stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._deferred: dict[tuple[int, int], WeightGradWork | None] = {}  # B done, W to come
        self._stashes: dict[tuple[int, int], SavedTensorStash | None] = {}
        self._outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self.peak_activations = 0
        self.timeline = []
        clock = StepClock(self.device, self.event_class) if self.record_timeline else None
        origin, marks = clock and clock.mark(), []
        # host time of the start (aligns the ranks of one machine); on the CPU the very origin of the spans
        self.timeline_origin = origin if isinstance(origin, float) else time.perf_counter()
        self._forward_only = forward_only
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            items, ahead = (self.forward_items, self._forward_ahead) if forward_only else (self.items, self._ahead)
            post_ahead = comm.transport(self.pp_group, self.device).posts_receives_early
            for item, next_recvs in zip(items, ahead):
                RECORDER.action = item  # the flight recorder's phase: this schedule item (a reference)
                if isinstance(item, Compute):
                    self._await_input(item)  # its received tensor, if any (idle time: outside its span)
                start = clock and clock.mark()
                with named_range(lambda: _range_name(item)):  # noqa: B023 - called within this iteration
                    if isinstance(item, Forward):
                        self._forward(item)
                    elif isinstance(item, Backward):
                        self._backward(item)
                    elif isinstance(item, BackwardInput):
                        self._backward_input(item)
                    elif isinstance(item, BackwardWeight):
                        self._backward_weight(item)
                    else:
                        self._transfer(item, next_recvs if post_ahead else ())
                if clock:
                    marks.append((item if isinstance(item, Compute) else tuple(item), start, clock.mark()))
        RECORDER.action = None
        self._complete_sends()
        if self._stored or self._outbox or self._deferred or self._received:
            raise ScheduleError(
                f"stage {self.stage}: step ended with unfinished micro-batches "
                f"{sorted(self._stored)} / unsent {sorted(self._outbox)} / unread {sorted(self._received)}"
            )
        if not forward_only:
            self._reduce_shared_embedding()
        loss = self._loss_sum / m  # meaningful on the last stage, which the broadcast copies
        if share_loss:
            self.share_loss(loss)
        if clock:  # resolved once, after the step (on CUDA: one wait for the last event)
            self.timeline = [Span(label, clock.seconds(origin, a), clock.seconds(origin, b)) for label, a, b in marks]
        return loss

    def share_loss(self, loss: torch.Tensor) -> None:
        """Copy the last stage's ``loss`` (a 0-d fp32 tensor, in place) to every stage: a 4-byte
        ``broadcast`` on ``pp_group``, nothing at pp=1. Collective: every stage calls it."""
        comm.broadcast(loss, src=self.stage_ranks[-1], group=self.pp_group)

    def _forward(self, a: Forward) -> None:
        if self._is_first(a.chunk):
            x, kept = self._inputs[a.mb].to(self.device), None
        else:
            x = self._received.pop(("act", a.mb, a.chunk))
            kept = None if self._forward_only else x.requires_grad_()
        split = kept is not None and a.chunk in self.split_chunks
        stash = SavedTensorStash() if split else None
        if stash:
            self._stashes[(a.mb, a.chunk)] = stash
        with stash.hooks() if stash else contextlib.nullcontext():  # lets B release what W does not read
            out = self.chunks[a.chunk](x, **(self._context[a.mb] if self._context else {}))
            if self._is_last(a.chunk):
                loss = self.loss_fn(out, self._targets[a.mb].to(self.device))
                self._loss_sum += loss.detach().float()
                out = loss / self.num_microbatches
        if not self._is_last(a.chunk):
            self._outbox[("act", a.mb, a.chunk)] = out.detach()
        if self._forward_only:
            return
        self._stored[(a.mb, a.chunk)] = (kept, out)
        self.peak_activations = max(self.peak_activations, len(self._stored))

    def _backward(self, a: Backward) -> None:
        x, out = self._stored.pop((a.mb, a.chunk))
        grad = None if self._is_last(a.chunk) else self._received.pop(("grad", a.mb, a.chunk))
        with self._final_context(a):
            out.backward(grad)
        if x is not None:
            self._outbox[("grad", a.mb, a.chunk)] = x.grad

    def _final_context(self, a: Compute) -> contextlib.AbstractContextManager:
        final = self.final_backward is not None and self._last_backward[a.chunk] == a
        return self.final_backward(a.chunk) if final else contextlib.nullcontext()

    def _backward_input(self, a: BackwardInput) -> None:
        """B: the input gradient only (sent upstream next); the weight gradients wait for W.
        The first virtual stage has no input gradient to send: its B is the whole backward."""
        x, out = self._stored[(a.mb, a.chunk)]
        grad = None if self._is_last(a.chunk) else self._received.pop(("grad", a.mb, a.chunk))
        if x is None:
            with self._final_context(a):
                out.backward(grad)
            self._deferred[(a.mb, a.chunk)] = None
            return
        stash = self._stashes.pop((a.mb, a.chunk), None)
        dx, work = backward_input(out, grad, x, self.chunks[a.chunk].parameters(), stash)
        self._deferred[(a.mb, a.chunk)] = work
        self._outbox[("grad", a.mb, a.chunk)] = dx if dx is not None else torch.zeros_like(x)

    def _backward_weight(self, a: BackwardWeight) -> None:
        """W: accumulate the weight gradients B deferred; the micro-batch's tensors are dropped."""
        work = self._deferred.pop((a.mb, a.chunk))
        self._stored.pop((a.mb, a.chunk))
        if work is not None:
            with self._final_context(a):
                backward_weight(work)

    def _reduce_shared_embedding(self) -> None:
        """Sum the tied-embedding gradients of the first and last stage (middle stages skip)."""
        if self.embedding_group is None or self.stage not in (0, self.pp - 1):
            return
        for chunk in self.chunks:
            for p in chunk.parameters():
                if is_shared_embedding(p):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    comm.all_reduce(p.grad, group=self.embedding_group)
