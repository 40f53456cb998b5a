"""One flat bucket at run time: its buffers and its collectives.

A :class:`FlatBucket` owns, for the parameters of one
:class:`~parallel.zero.layout.BucketLayout` (``n`` = padded elements,
``s = n / N`` the shard, ``b`` the compute dtype's bytes, ``c`` ``comm_dtype``'s):

================  ==========================  ===============================
buffer            stages 0 / 1 / 2            stage 3
================  ==========================  ===============================
``flat_param``    n · b, the parameters are   n · b while gathered, storage
                  views into it               freed (size 0) otherwise
``param_shard``   –                           s · b, persistent
``flat_grad``     n · 4, fp32 (stages 0, 1)   –
``grad_shard``    – / – / s · 4, fp32         s · 4, fp32
``master``        the fp32 weights the optimizer steps: a view of
                  ``flat_param`` (stage 0: all of it, 1–2: the shard) or of
                  ``param_shard`` in fp32; a separate fp32 copy otherwise
================  ==========================  ===============================

Gradients accumulate in fp32 at every precision (Megatron's main gradient;
:data:`parallel.zero.theory.GRAD_BYTES`). No buffer is zeroed per step: a step's
first gradient of a slot is *written* (copied) into it and later micro-batches' are
added (``written``), and what no gradient reached (an unused
parameter) is zeroed just before the buffer is sent or read. In fp32 :meth:`take_grad`
(from the post-accumulate-grad hook) copies the first micro-batch's fresh ``.grad``
into ``flat_grad`` and makes ``.grad`` its view, so autograd adds the later
micro-batches there itself. In bf16/fp16 autograd produces a 16-bit ``.grad`` per
micro-batch; :meth:`take_grad` writes or adds it into ``flat_grad`` and drops it, so at
most one micro-batch's 16-bit gradient of a parameter exists at a time. Stages 2–3 send
each micro-batch's gradient and write (first) or add the reduced shard into the fp32
``grad_shard``.

Collectives, all on the DP group through :mod:`parallel.comm`, gradients in
``comm_dtype`` (cast from the fp32 accumulation for the collective when it is
16-bit, an n · c transient, and the result cast back into fp32):

* stage 0: ``all_reduce`` of the bucket's gradient (n · c bytes payload), or
  with top-k compression an ``all_gather`` of values + indices;
* stages 1–3: ``reduce_scatter`` of the gradient (n · c payload), in place into this rank's
  range of the buffer sent (stage 1 with an fp32 ``comm_dtype``: of ``flat_grad``, which holds
  the reduced shard from then until the step's :meth:`zero_grad`; otherwise of the transient
  n · c buffer, whose range stage 1 keeps until the step and stages 2–3 add into ``grad_shard``);
* stages 1–2 after the step, stage 3 before forward and backward:
  ``all_gather`` of the parameters (n · b payload; stages 1–2 in place, from this rank's range
  of ``flat_param``).
"""

from __future__ import annotations

import torch

from .. import comm
from ..comm.flight import RECORDER
from .compression import TopKCompressor
from .config import ZeroConfig
from .layout import BucketLayout
from .offload import host_copy, host_empty, to_device
from .policy import policy


def _zero_unwritten(flat: torch.Tensor, slots, written) -> None:
    """Zero the parts of ``flat`` no gradient was written into this step: the gaps and
    padding between and after ``slots``, and the slots whose ``written`` is false."""
    end = 0
    for slot, w in zip(slots, written):
        if not w:
            flat[end : slot.end].zero_()
        elif slot.offset > end:
            flat[end : slot.offset].zero_()
        end = slot.end
    if end < flat.numel():
        flat[end:].zero_()


class FlatBucket:
    def __init__(self, layout: BucketLayout, params, config: ZeroConfig, *, dp_rank: int, group):
        self.layout, self.params, self.stage, self.group = layout, list(params), config.stage, group
        self.policy = pol = policy(config.stage)  # what this stage shards, reduces and gathers
        self.param_dtype = param_dtype = config.param_dtype
        self.comm_dtype, offload = config.wire_dtype, config.offload
        self.lo, self.hi = layout.shard_range(dp_rank) if pol.shards_optimizer else (0, layout.padded_numel)
        device = self.params[0].device
        self.compressor = (  # error feedback over the whole bucket (stage 0)
            TopKCompressor(layout.padded_numel, config.topk_ratio, self.comm_dtype, device)
            if config.compression
            else None
        )
        self.flat_param = torch.zeros(layout.padded_numel, dtype=param_dtype, device=device)
        for p, slot in zip(self.params, layout.slots):
            self.flat_param[slot.offset : slot.end].copy_(p.detach().reshape(-1))
            p.data = self.flat_param[slot.offset : slot.end].view(slot.shape)
        owned = self.flat_param[self.lo : self.hi]
        self.offload = offload  # parallel/zero/offload.py: what lives in host memory
        self.params_on_host = offload == "optimizer+params"
        self.param_shard = (host_copy(owned) if self.params_on_host else owned.clone()) if pol.shards_params else None
        home = self.param_shard if pol.shards_params else owned
        if offload == "none" or (self.params_on_host and param_dtype == torch.float32):
            self.master = home if param_dtype == torch.float32 else home.float()
        else:  # the optimizer's fp32 master shard in host memory
            self.master = host_copy(home, torch.float32)
        self.master_is_separate = self.master is not home  # (not data_ptr: 0 for every meta tensor)
        # the host target of the reduced gradient shard's device -> host copy
        self.host_grad = host_empty(self.hi - self.lo, torch.float32, owned) if offload != "none" else None
        self.flat_grad = None
        self.grad_shard = None
        self.grad_views = not pol.shards_grads and param_dtype == torch.float32  # .grad are views of flat_grad
        # per slot: the view of flat_grad that take_grad made the parameter's .grad this step (fp32 stages 0-1),
        # and its address: the same object given other storage (``p.grad.data = ...``) is taken in afresh
        self.grad_objs: list[torch.Tensor | None] = [None] * len(self.params)
        self.grad_ptrs: list[int] = [0] * len(self.params)
        if not pol.shards_grads:
            self.flat_grad = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        else:
            self.grad_shard = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=device)
        # no memset per step: the step's first gradient of a slot is written (copied), later ones added;
        # what nothing wrote is zeroed just before it is read (:meth:`_settle`, :meth:`main_grad`)
        self.written = bytearray(len(self.params))  # stages 0-1, per slot: written into flat_grad this step
        self.shard_written = False  # stages 2-3: a reduced gradient was written into grad_shard this step
        self._stage1_shard = None
        self.keep_full = config.keep_full  # ZeRO-2/3, accumulate="unsharded": the full fp32 gradient until the step
        self.acc: torch.Tensor | None = None  # that full gradient, allocated at the first backward
        self._written: list[bool] = []  # per slot: a gradient was copied into acc this step
        self.ready = 0  # parameters whose gradient has been accumulated in this backward
        self.reduced = False  # stages 0-1: this step's reduction was launched
        self.arrived = bytearray(len(self.params))  # stages 0-1, per slot: reduced in a backward this step
        self._pending = None  # (handle, finish) of an in-flight collective
        self._gather = None  # stage 3: handle of an in-flight parameter all-gather
        self.gathered = not pol.shards_params
        if pol.shards_params:
            self.free_params()

    # gradients ---------------------------------------------------------------
    def _settle(self) -> None:
        """Stages 0-1: zero the slots of ``flat_grad`` no gradient reached this step (unused
        parameters, a step without backward), before the buffer is sent or read."""
        if not all(self.written):  # (the padding is zeroed at construction and stays 0: collectives sum zeros)
            _zero_unwritten(self.flat_grad, self.layout.slots, self.written)
            self.written = bytearray(b"\x01" * len(self.params))

    def launch_reduction(self) -> None:
        """Start this bucket's gradient collective (asynchronously)."""
        RECORDER.bucket = self.layout.index  # the flight recorder's phase for the call(s) below
        if self.flat_grad is not None:
            self._settle()
        if self.compressor is not None:
            handle, gathered = self.compressor.start(self.flat_grad, self.group)
            self._pending = (handle, lambda: self.compressor.finish(gathered, self.flat_grad))
        elif self.policy.reduce == "all_reduce":
            buf = self.flat_grad if self.comm_dtype == self.flat_grad.dtype else self.flat_grad.to(self.comm_dtype)
            handle = comm.all_reduce(buf, group=self.group, async_op=True)
            self._pending = (handle, (lambda: None) if buf is self.flat_grad else (lambda: self.flat_grad.copy_(buf)))
        else:
            full = self._full_grad_for_comm()
            # in place, into this rank's range of what is sent (flat_grad at stage 1 in fp32, else a
            # buffer alive until the wait anyway): no fresh output buffer (page faults on the host)
            out = full[self.lo : self.hi]
            handle = comm.reduce_scatter(out, full, group=self.group, async_op=True)
            self._pending = (handle, lambda: self._keep_shard(out))
        self.reduced = True
        RECORDER.bucket = None

    def accumulate_full(self, param, slot_index: int) -> None:
        """ZeRO-2/3 with unsharded accumulation: add ``param.grad`` into the fp32 full gradient
        ``acc`` (n · 4 bytes, held until the step's reduce-scatter) and drop it.

        ``acc`` is allocated uninitialised: a slot's first gradient of the step is copied in,
        later ones added (no memset and no add into zeros); :meth:`_full_grad_for_comm` zeroes
        what no gradient reached (padding, unused parameters) before it is sent."""
        grad = param.grad
        if grad is None:
            return
        if self.acc is None:
            self.acc = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=grad.device)
            self._written = [False] * len(self.params)
        slot = self.layout.slots[slot_index]
        if self._written[slot_index]:
            self.acc[slot.offset : slot.end].add_(grad.reshape(-1))
        else:
            self.acc[slot.offset : slot.end].copy_(grad.reshape(-1))
            self._written[slot_index] = True
        param.grad = None

    def _full_grad_for_comm(self) -> torch.Tensor:
        if self.acc is not None:  # unsharded accumulation: send the sum of all micro-batches, once
            for i, p in enumerate(self.params):
                self.accumulate_full(p, i)
            acc, self.acc = self.acc, None
            _zero_unwritten(acc, self.layout.slots, self._written)
            return acc if acc.dtype == self.comm_dtype else acc.to(self.comm_dtype)
        if self.flat_grad is not None:  # gradients not sharded (stage 1)
            g = self.flat_grad
            return g if g.dtype == self.comm_dtype else g.to(self.comm_dtype)
        full = torch.empty(self.layout.padded_numel, dtype=self.comm_dtype, device=self.flat_param.device)
        written = [p.grad is not None for p in self.params]
        for p, slot, w in zip(self.params, self.layout.slots, written):
            if w:
                full[slot.offset : slot.end].copy_(p.grad.reshape(-1))
                p.grad = None  # stages 2-3: the full gradient is freed as soon as it is sent
        _zero_unwritten(full, self.layout.slots, written)
        return full

    def _keep_shard(self, out: torch.Tensor) -> None:
        if self.grad_shard is None:  # stage 1: the shard lives only until the step
            # fp32: a view of flat_grad, no copy; a 16-bit wire: a copy of the shard, so that the
            # transient wire copy of the whole bucket (``out``'s base) is freed now, not at the step
            in_flat = self.flat_grad is not None and out.untyped_storage() is self.flat_grad.untyped_storage()
            self._stage1_shard = out if in_flat else out.clone()
        else:
            if self.shard_written:
                self.grad_shard.add_(out.to(self.grad_shard.dtype))
            else:  # the step's first micro-batch: written, not added into zeros
                self.grad_shard.copy_(out)
                self.shard_written = True

    def finish_reduction(self) -> None:
        if self._pending is not None:
            handle, finish = self._pending
            handle.wait()
            finish()
            self._pending = None

    def take_grad(self, param, slot_index: int) -> None:
        """Stages 0–1, after autograd accumulated ``param.grad``: make ``flat_grad`` hold it.

        The step's first gradient of the slot is copied into ``flat_grad`` (no memset of the buffer
        and no add into zeros: ``zero_grad`` left ``param.grad`` None, so autograd handed over its
        fresh gradient); later ones are added. 16-bit parameters: ``param.grad`` is then dropped.
        fp32: ``param.grad`` becomes the slot's view of ``flat_grad`` and autograd adds the later
        micro-batches there itself; a ``param.grad`` that is no longer that view (the user set it to
        None, e.g. ``model.zero_grad()``) is taken in afresh."""
        grad = param.grad
        if grad is None:
            return
        slot = self.layout.slots[slot_index]
        first = not self.written[slot_index]
        if not self.grad_views:
            view = self.flat_grad[slot.offset : slot.end]
            if first:
                view.copy_(grad.reshape(-1))
            else:
                view.add_(grad.reshape(-1))
            self.written[slot_index] = 1
            param.grad = None
            return
        if not first and self.holds_view(grad, slot_index):  # autograd added into the view itself
            return
        view = self.flat_grad[slot.offset : slot.end]
        view.copy_(grad.reshape(-1))
        self.written[slot_index] = 1
        param.grad = self.grad_objs[slot_index] = view.view(slot.shape)
        self.grad_ptrs[slot_index] = view.data_ptr()

    def holds_view(self, grad: torch.Tensor, slot_index: int) -> bool:
        """Whether ``grad`` is the view of ``flat_grad`` :meth:`take_grad` made the slot's ``.grad`` this
        step, on its storage still (0 on meta, the dry run's: no data to lose there)."""
        return grad is self.grad_objs[slot_index] and grad.data_ptr() == self.grad_ptrs[slot_index]

    def has_unreduced_grads(self) -> bool:
        if not self.policy.shards_grads:  # one reduction per step, of the accumulated flat_grad
            return not self.reduced
        return self.acc is not None or any(p.grad is not None for p in self.params)

    def main_grad(self) -> torch.Tensor:
        """This rank's reduced gradient (sum over DP) of the range it steps, in fp32."""
        if not self.policy.shards_optimizer:
            self._settle()  # a no-op after the reduction (it settled the buffer before sending)
            g = self.flat_grad
        elif not self.policy.shards_grads:  # the reduce-scatter's shard, kept until the step
            g = self._stage1_shard
        else:
            if not self.shard_written:  # no reduce-scatter reached the shard this step
                self.grad_shard.zero_()
                self.shard_written = True
            g = self.grad_shard
        return g if g.dtype == torch.float32 else g.float()

    def zero_grad(self) -> None:
        """Forget this step's gradients; a reduction still in flight (a step abandoned between a
        communicating backward and :meth:`step`) is waited for first, so that it cannot write into
        the zeroed buffer afterwards (on NCCL the in-place reduce-scatter writes ``flat_grad``'s
        range), and its result is dropped."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        # no memset: the next step writes each slot's first gradient (``written``, ``shard_written``);
        # an fp32 ``.grad`` view of flat_grad is dropped too, so that autograd hands over its fresh
        # gradient instead of adding it into this step's values
        self.written = bytearray(len(self.params))
        self.shard_written = False
        for p in self.params:
            p.grad = None
        self.grad_objs = [None] * len(self.params)
        self._stage1_shard = None
        self.acc = None  # unsharded accumulation: a step abandoned mid-accumulation leaves nothing behind
        self.ready, self.reduced = 0, False
        self.arrived = bytearray(len(self.params))

    # parameters --------------------------------------------------------------
    def publish_master(self) -> None:
        """After the optimizer step: make the compute parameters equal the updated master."""
        home = self.param_shard if self.policy.shards_params else self.flat_param[self.lo : self.hi]
        if self.master_is_separate:  # offload: host -> device, asynchronous from pinned memory
            home.copy_(self.master, non_blocking=self.master.is_pinned())
        if self.policy.gathers_after_step:  # in place: home is this rank's range of flat_param
            comm.all_gather(self.flat_param, home, group=self.group)
        elif self.policy.gathers_per_unit:
            self.free_params()

    def free_params(self) -> None:
        """Stage 3: release the gathered parameters' storage (the views stay, empty).

        A gather still in flight (a prefetch) is awaited first: its buffer must not be
        released under it, and the next :meth:`start_gather` must start afresh."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        self.flat_param.untyped_storage().resize_(0)
        self.gathered = False

    def start_gather(self) -> None:
        """Stage 3: launch the all-gather of the full parameters (no-op if done or under way)."""
        if self.gathered or self._gather is not None:
            return
        storage = self.flat_param.untyped_storage()
        storage.resize_(self.flat_param.numel() * self.flat_param.element_size())
        shard = to_device(self.param_shard, self.flat_param.device) if self.params_on_host else self.param_shard
        self._gather = comm.all_gather(self.flat_param, shard, group=self.group, async_op=True)

    def wait_gather(self) -> None:
        if self.gathered:
            return
        self.start_gather()
        self._gather.wait()
        self._gather, self.gathered = None, True
