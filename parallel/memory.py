"""Measuring what a rank holds: saved activations and the process's peak memory."""

from __future__ import annotations

import resource
import sys
import weakref

import torch
from torch import nn

CHECKPOINTING = ("none", "selective", "full")  # activation checkpointing modes: the one home


class SavedActivationMeter:
    """Counts the bytes autograd saves for backward while active (activations).

    Parameters (and tensors sharing a parameter's storage) are not activations
    and are left out; each storage is counted once however many views of it
    are saved. Use around a forward (or a whole pipeline step)::

        meter = SavedActivationMeter(model.parameters())
        with meter:
            loss = model(x).sum()
        meter.bytes

    Storages are told apart by identity, not address: the meter keeps weak
    references to the storages it has seen (a storage saved twice while alive is
    counted once; one freed and a new one allocated at the same address — every
    micro-batch after the first — is counted again). It holds nothing alive, so
    measuring does not change what a step holds. ``meta`` tensors hold no bytes
    and are not counted.
    """

    def __init__(self, params):
        self._params: weakref.WeakSet = weakref.WeakSet(p.untyped_storage() for p in params if not p.is_meta)
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._bytes = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and not t.is_meta:
            storage = t.untyped_storage()
            if storage not in self._params and storage not in self._seen:
                self._seen.add(storage)
                self._bytes += storage.nbytes()
        return t

    def __enter__(self) -> SavedActivationMeter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return self._bytes


class PeakSavedMeter:
    """The most bytes autograd held for backward at any one time while active: each saved
    tensor is counted (once per storage) from its save until autograd releases it — at the
    end of its backward, or, for a zero-bubble B, when B drops what W does not read.

    Use around a whole pipeline step; :attr:`peak` is the measured peak, :attr:`live`
    what is still held (0 after a complete step). Parameters are not counted.
    """

    def __init__(self, params):
        self._params = {p.untyped_storage().data_ptr() for p in params if not p.is_meta}
        self._refs: dict[int, int] = {}
        self.live = self.peak = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if isinstance(t, nn.Parameter) or t.is_meta or key in self._params:
            return t
        if not self._refs.get(key):
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Counted(t.detach(), self, key, storage.nbytes())  # detached: no cycle through its graph

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Counted) else held

    def __enter__(self) -> PeakSavedMeter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class _Counted:
    __slots__ = ("tensor", "meter", "key", "nbytes")

    def __init__(self, tensor, meter: PeakSavedMeter, key: int, nbytes: int):
        self.tensor, self.meter, self.key, self.nbytes = tensor, meter, key, nbytes

    def __del__(self):
        refs = self.meter._refs
        refs[self.key] -= 1
        if not refs[self.key]:
            self.meter.live -= self.nbytes


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
