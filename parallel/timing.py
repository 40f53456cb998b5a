"""Timing that means the same on a GPU as on the CPU, and named ranges for profilers.

On a CUDA device the host runs ahead of the GPU: ``time.perf_counter()``
around a kernel launch or an NCCL call measures *enqueueing*, not the work.
:class:`StepClock` marks points on the device's own timeline instead
(``torch.cuda.Event(enable_timing=True)`` recorded on the current stream) and
resolves them to seconds only when asked, after the step: marking never
synchronises, so a clock can mark every micro-batch and every collective.
On the CPU a mark is ``time.perf_counter()`` (the work is done when the call
returns).

:func:`named_range` marks a region (a schedule action, a collective) for
``torch.profiler`` traces and, under ``nsys profile`` with
``torch.autograd.profiler.emit_nvtx()``, as an NVTX range. With no profiler
running it costs one flag lookup: no ``record_function`` object is made.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


def named_range(name: str | Callable[[], str]):
    """A context manager that names the enclosed region in any active profiler (else a no-op).

    ``name`` may be a function making the name, called only while a profiler runs."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name if isinstance(name, str) else name())
    return contextlib.nullcontext()


class StepClock:
    """Marks points in time of ``device``'s work; :meth:`seconds` resolves two marks lazily.

    ``event_class``: what a CUDA mark is made of (default ``torch.cuda.Event``; tests inject a fake).
    :attr:`syncs` counts the host synchronisations resolving took (one per resolved end mark on CUDA).
    """

    def __init__(self, device: torch.device | str, event_class: Any = None):
        self.device = torch.device(device)
        self.on_device = self.device.type == "cuda"
        self._event_class = event_class
        self.syncs = 0

    def mark(self) -> Any:
        """Now, on the device's timeline: an event recorded on the current stream, or a host time."""
        if not self.on_device:
            return time.perf_counter()
        event = (self._event_class or torch.cuda.Event)(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end``; on CUDA waits for ``end`` to have happened."""
        if not self.on_device:
            return end - start
        if not end.query():
            end.synchronize()
            self.syncs += 1
        return start.elapsed_time(end) / 1e3

    def interval(self, start: Any, end: Any) -> Interval:
        return Interval(self, start, end)


@dataclass(frozen=True)
class Interval:
    """Two marks of one clock, resolved to seconds on demand."""

    clock: StepClock
    start: Any
    end: Any

    def seconds(self) -> float:
        return self.clock.seconds(self.start, self.end)


_CLOCKS: dict[torch.device, StepClock] = {}


def clock_for(device: torch.device) -> StepClock:
    """The shared clock of ``device`` (the one :mod:`parallel.comm` times collectives with)."""
    device = torch.device(device)
    if device not in _CLOCKS:
        _CLOCKS[device] = StepClock(device)
    return _CLOCKS[device]
