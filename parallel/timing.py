"""Named ranges for profilers.

:func:`named_range` marks a region (a schedule action, a collective) for
``torch.profiler`` traces and, under ``nsys profile`` with
``torch.autograd.profiler.emit_nvtx()``, as an NVTX range. With no profiler
running it costs one flag lookup: no ``record_function`` object is made.
"""

from __future__ import annotations

import contextlib

import torch


def named_range(name: str):
    """A context manager that names the enclosed region in any active profiler (else a no-op)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
