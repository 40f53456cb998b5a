"""The backward side of :class:`~parallel.zero.ZeroDataParallel`: the gradient hooks and the
reductions they launch.

Every parameter has a post-accumulate-grad hook for the engine's life
(:meth:`GradientSync._on_grad_ready`). It takes the gradient into the bucket's fp32 buffer
(16-bit precision, or an fp32 ``.grad`` that is no longer a view of ``flat_grad``), counts the
bucket's ready gradients, and in a backward that communicates launches the bucket's collective
once the last one is in (``overlap``). At the end of backward (an autograd callback) what is
left is launched and, at stages 2–3, waited for. :meth:`GradientSync._finish_gradients` (the
step) reduces what no backward did, waits, and returns the gradients averaged over DP with the
loss scale removed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import comm
from ..overlap import REDUCTIONS_IN_FLIGHT
from .bucket import FlatBucket


class GradientSync:
    """Mixin of :class:`~parallel.zero.ZeroDataParallel`: accumulation, hooks, reductions."""

    def _register_hooks(self) -> None:
        # each parameter's hook knows its bucket and slot: no lookups per gradient (it runs per
        # parameter per micro-batch, on the host, in the backward's critical path)
        self._hooks = [
            p.register_post_accumulate_grad_hook(_weak_hook(self, "_on_grad_ready", bucket, self._slot_index[p]))
            for p, bucket in self._param_bucket.items()
        ]
        # the parameters outlive an engine that is dropped (a model wrapped again): its hooks go with it
        weakref.finalize(self, _remove_hooks, self._hooks)

    @contextlib.contextmanager
    def _syncing(self, sync: bool) -> Iterator[None]:
        previous, self._sync = self._sync, sync
        try:
            yield
        finally:
            self._sync = previous

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients without communicating (stages 0–1; see the module docstring)."""
        return self._syncing(False)

    def sync_gradients(self) -> contextlib.AbstractContextManager:
        """Communicate during this backward even inside :meth:`no_sync` (stages 0–1).

        For the last backward of a micro-batch loop that runs under ``no_sync()``: each
        bucket's reduction launches (with ``overlap``) as soon as its last gradient is
        accumulated — a pipeline with several model chunks enters it around each chunk's
        last backward (``PipelineExecutor(final_backward=...)``); a bucket that spans chunks
        launches once the gradients of all of them are final."""
        return self._syncing(True)

    def _communicates_now(self) -> bool:
        return self._sync or (self.policy.reduce_every_microbatch and not self.keep_full)

    def _on_grad_ready(self, param: torch.Tensor, bucket: FlatBucket, slot: int) -> None:
        # nothing to do (fp32, stages 0-1): autograd added into the slot's view of flat_grad itself, and this
        # backward launches no reduction (it does not communicate, or one rank reduces at the step)
        if bucket.grad_views and (not self._sync or self.dp_size == 1) and bucket.holds_view(param.grad, slot):
            return
        once = not self.policy.reduce_every_microbatch and self._communicates_now()  # stages 0-1, this backward
        # before the gradient is taken in (a 16-bit gradient is then not added; an fp32 view of flat_grad
        # already was, by autograd: the step must not be taken after the refusal either way)
        if once and self.dp_size > 1:
            self._check_first_reduction(bucket, param, slot)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if bucket.flat_grad is not None:
            bucket.take_grad(param, slot)
        elif self.keep_full:
            bucket.accumulate_full(param, slot)
        if not self._communicates_now():
            if self.keep_full:  # all of a unit's gradients are in: its backward is over, free its parameters
                bucket.ready += 1
                if bucket.ready == len(bucket.params) and self._frees_after_backward(bucket):
                    bucket.free_params()
            return
        if once and self.dp_size == 1:
            return  # one rank: nothing to overlap, the step reduces the accumulated gradient once
        bucket.ready += 1
        if self.overlap and bucket.ready == len(bucket.params):
            self._reduce(bucket, wait=False)
            if self._frees_after_backward(bucket):
                bucket.free_params()  # this micro-batch's backward of its unit is over

    def _check_first_reduction(self, bucket: FlatBucket, param: torch.Tensor, slot: int) -> None:
        """Stages 0-1 reduce the accumulated gradient once per step: refuse (on every rank, as
        every rank runs the same backwards) a gradient that arrives in a communicating backward
        after its bucket's reduction started, or a second time in this step."""
        if bucket.reduced or bucket.arrived[slot]:
            name = next(n for n, q in self.module.named_parameters() if q is param)
            self._callback_queued = False  # an aborted backward runs no callback: the next one queues its own
            raise RuntimeError(
                f"ZeroDataParallel (stage {self.stage}): a second backward that communicates "
                f"before step(): the gradient of {name} arrived for a bucket "
                "already reduced over DP in this step (stages 0-1 reduce the accumulated gradient "
                "once per step; a gradient added after that reduction started would be lost or race "
                "with it). Run every backward but the last of an accumulation under "
                "`with zdp.no_sync():`, then step()"
            )
        bucket.arrived[slot] = 1

    def _reduce(self, bucket: FlatBucket, wait: bool) -> None:
        bucket.launch_reduction()
        if wait:
            bucket.finish_reduction()
        elif self.policy.reduce_every_microbatch:
            # the reduce-scatter's input is a temporary full gradient, alive until waited for: keep at
            # most REDUCTIONS_IN_FLIGHT (on NCCL the wait orders the stream; the host does not block)
            self._in_flight.append(bucket)
            while len(self._in_flight) > REDUCTIONS_IN_FLIGHT:
                self._in_flight.popleft().finish_reduction()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if not self._communicates_now():
            for b in self.buckets if self.keep_full else ():
                b.ready = 0
                if self._frees_after_backward(b):
                    b.free_params()
            return
        for b in self.buckets:
            if not self.overlap and b.ready == len(b.params) and b.has_unreduced_grads():
                self._reduce(b, wait=False)
        self._in_flight.clear()
        for b in self.buckets:
            if self.policy.reduce_every_microbatch:  # the shard takes this micro-batch's reduce-scatter before the next
                b.finish_reduction()
                b.ready = 0
            # stages 0-1 reduce once per step: step() waits, so with interleaving a chunk's reductions
            # overlap the other chunks' remaining backwards instead of blocking at this chunk's end
            if self._frees_after_backward(b) and not b.has_unreduced_grads():
                b.free_params()

    def _frees_after_backward(self, bucket: FlatBucket) -> bool:
        """Stage 3 frees a block unit once its backward has run (the unit's grad hook gathers
        it again for the next micro-batch's backward); the root unit has no such hook, so it
        stays gathered until the optimizer step publishes new parameters."""
        return self.policy.gathers_per_unit and bucket.layout.unit != len(self.units)

    # at the step -----------------------------------------------------------------
    def _finish_gradients(self) -> list[torch.Tensor]:
        """Reduce what backward left unreduced (unused parameters, no_sync); return fp32 grads, averaged."""
        for b in self.buckets:
            if b.has_unreduced_grads():
                self._reduce(b, wait=True)
            b.finish_reduction()
        self._in_flight.clear()
        divisor = self.dp_size * self.loss_scale  # the DP mean and the loss scale removed in one pass
        grads = [b.main_grad() for b in self.buckets]
        for b, g in zip(self.buckets, grads):
            if divisor != 1:  # one process without a loss scale: nothing to average (a pass saved)
                g.div_(divisor)
            if b.layout.extra_reduce:  # tied embedding: + the other stage's; sequence parallel: + other TP ranks'
                comm.all_reduce(g, group=self.extra_groups[b.layout.extra_reduce])
            if self._host_copier is not None:  # offload: device -> host now, while later buckets finish
                self._host_copier.copy(b.host_grad, g)
        return grads


def _remove_hooks(handles: list) -> None:
    """Remove every hook in ``handles`` and empty the list (it stays the same object)."""
    for h in handles:
        h.remove()
    handles.clear()


def _weak_hook(owner: Any, name: str, *args: Any) -> Callable[[torch.Tensor], None]:
    """A hook that calls ``owner.<name>(tensor, *args)`` while ``owner`` lives, holding it only weakly
    (``args`` strongly: they must not hold ``owner``).

    A tensor hook is kept by the tensor's C++ side, which Python's garbage collector cannot see
    through: a hook holding the engine (a bound method) would keep the engine, its model and its
    buffers alive after the last reference to them is gone (a GPU's memory never returned)."""
    ref = weakref.ref(owner)

    def hook(tensor: torch.Tensor) -> None:
        obj = ref()
        if obj is not None:
            getattr(obj, name)(tensor, *args)

    return hook
