"""Measuring what a rank holds: saved activations and the process's peak memory."""

from __future__ import annotations

import resource
import sys

import torch
from torch import nn


class SavedActivationMeter:
    """Counts the bytes autograd saves for backward while active (activations).

    Parameters (and tensors sharing a parameter's storage) are not activations
    and are left out; each storage is counted once however many views of it
    are saved. Use around a forward (or a whole pipeline step)::

        meter = SavedActivationMeter(model.parameters())
        with meter:
            loss = model(x).sum()
        meter.bytes
    """

    def __init__(self, params):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self._seen: dict[int, int] = {}
        self._ctx = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._param_ptrs:
                self._seen[ptr] = storage.nbytes()
        return t

    def __enter__(self) -> "SavedActivationMeter":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
