"""Dry-run support: one rank of any world on tensors that hold no memory.

A dry run joins torch's ``fake`` process group at the real world size (group
creation and collectives cost microseconds and move nothing), computes on the
``meta`` device (:func:`parallel.groups.default_device` says so for the fake
backend: shapes and dtypes are exact, no byte is allocated), and measures:

* :class:`LiveMemory`: the bytes of every tensor storage this rank holds on its
  device, at each moment, and the peak, split into the storages that already
  existed when the measured window began (model state: parameters, gradient
  buffers, optimizer state, buffers), the activations autograd saved for
  backward, and the rest (temporaries). Live means reachable: a storage counts
  from the op that created it until Python drops its last reference, which is
  when the caching allocator could reuse it (it does not see the allocator's
  fragmentation or rounding). A storage resized in place (ZeRO-3 gathering a unit
  into its flat buffer and freeing it again, ``UntypedStorage.resize_``) counts at its
  new size from then on, in the category it had.
* :class:`parallel.comm.CommCounter` / :class:`parallel.comm.CallRecorder`: every
  collective and p2p, per group, and whether its tensors were on the rank's device.

Kernels: on ``meta`` tensors ``F.scaled_dot_product_attention`` always takes its
*math* path, which materialises fp32 ``[b, heads, s, s]`` scores and probabilities
(576 MiB per GPT-3 layer on one TP rank) that a GPU's flash / memory-efficient
kernel never holds. :class:`FlashAttentionOnMeta` asks for the flash kernel
instead (its meta implementation gives the exact output and log-sum-exp shapes),
so the measured memory is the GPU's, as the planner assumes.
"""

from __future__ import annotations

import weakref
from typing import Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def init_fake_world(rank: int, world_size: int) -> None:
    """Join torch's fake process group as ``rank`` of ``world_size`` (no process, no network)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; a dry run needs its own")
    # the fake backend serves CPU tensors and, named for it, meta ones (p2p looks the backend up by device)
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)


class LiveMemory(TorchDispatchMode):
    """Tracks the storages created on ``device`` while active, and their peak.

    ``with LiveMemory(device) as mem: ...``; then ``mem.peak`` (bytes) and
    ``mem.at_peak`` (``{"baseline", "activations", "temporaries"}`` at that moment).
    Call :meth:`new_window` to start measuring a fresh peak: what is alive then
    becomes the baseline. A storage resized in place (ZeRO-3's gathered units)
    counts at its new size, in its category (a re-gathered unit that existed when the window
    began is baseline: the planner's buffers).
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self._live: dict[int, tuple[int, str]] = {}  # id(storage) -> (bytes, category)
        self.current = {"baseline": 0, "activations": 0, "temporaries": 0}
        self.peak = 0
        self.at_peak = dict(self.current)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    # window ------------------------------------------------------------------
    def new_window(self) -> None:
        """Everything alive now is baseline; the peak restarts from it."""
        for key, (n, _) in self._live.items():
            self._live[key] = (n, "baseline")
        total = sum(self.current.values())
        self.current = {"baseline": total, "activations": 0, "temporaries": 0}
        self.peak, self.at_peak = total, dict(self.current)

    @property
    def live_bytes(self) -> int:
        return sum(self.current.values())

    # tracking ----------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        if t.device != self.device:
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._live:
            return
        n = st.nbytes()
        self._live[key] = (n, "temporaries")
        self.current["temporaries"] += n
        weakref.finalize(st, self._free, key)
        total = self.live_bytes
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.current)

    def _resized(self, st, nbytes: int) -> None:
        key = id(st)
        if key not in self._live:
            return
        n, cat = self._live[key]
        self._live[key] = (nbytes, cat)
        self.current[cat] += nbytes - n
        total = self.live_bytes
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.current)

    def _free(self, key: int) -> None:
        n, cat = self._live.pop(key, (0, None))
        if cat is not None:
            self.current[cat] -= n

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device == self.device:
            key = id(t.untyped_storage())
            n, cat = self._live.get(key, (0, None))
            if cat == "temporaries":  # saved for backward: an activation until backward drops it
                self._live[key] = (n, "activations")
                self.current["temporaries"] -= n
                self.current["activations"] += n
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self) -> Self:
        super().__enter__()
        self._saved_hooks.__enter__()
        # storage resizes bypass the dispatcher: see them by wrapping the method while active
        self._resize = resize = torch.UntypedStorage.resize_
        me = weakref.ref(self)

        def tracked_resize(st, nbytes):
            out = resize(st, nbytes)
            mem = me()
            if mem is not None and st.device == mem.device:
                mem._resized(st, st.nbytes())
            return out

        torch.UntypedStorage.resize_ = tracked_resize
        return self

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        self._saved_hooks.__exit__(*exc)
        super().__exit__(*exc)


class FlashAttentionOnMeta:
    """While active, ``F.scaled_dot_product_attention`` on meta tensors runs the flash kernel.

    Only where the GPU would run flash too: no mask, no dropout. Grouped-query
    attention repeats K/V first (flash-attention 2 does not need that copy on a GPU:
    the dry run then overstates temporaries by K and V's size). It swaps the
    function in ``torch.nn.functional`` (callers look it up at call time), not a
    torch-function mode: activation recomputation runs in autograd's thread, which
    does not see such modes.
    """

    def __enter__(self) -> Self:
        self._original = F.scaled_dot_product_attention
        original = self._original

        def sdpa(*args, **kwargs):
            if _flash_eligible(*args, **kwargs):
                return _flash(*args, **kwargs)
            return original(*args, **kwargs)

        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._original


def _flash_eligible(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return q.device.type == "meta" and attn_mask is None and dropout_p == 0.0 and q.dim() == 4


def _flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each K/V head serves q_heads / kv_heads heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[0]
