"""``logger.profile=[first,last]``: a torch.profiler trace per rank of steps first..last.

Each rank writes ``<run dir>/profile/trace_rank<r>.json`` (Chrome trace
format: open it in https://ui.perfetto.dev or chrome://tracing). Besides
torch's operators (and CUDA kernels on a GPU) it holds gridtrain's named
ranges (:func:`parallel.timing.named_range`): ``train_step <n>`` around each
step, every schedule action of the pipeline executor (``Forward(mb=0, chunk=0)``,
``Backward(...)``, ``SendActivation(...)+RecvGrad(...)`` for a batch of
transfers) and every collective of :mod:`parallel.comm`
(``comm.all_reduce[dp]``, ``comm.p2p[pp]`` ...).

Under Nsight Systems, set ``GRIDTRAIN_PROFILE=nvtx``: the same steps then run
under ``torch.autograd.profiler.emit_nvtx()`` between
``torch.cuda.profiler.start()``/``stop()``, so the same ranges become NVTX
ranges and ``nsys profile --capture-range=cudaProfilerApi`` records only those
steps (no JSON is written then).

Steps are numbered from 1, as in the log. Profiling costs time: profile a
few steady steps (not the first, which warms up), never a whole run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from parallel.timing import named_range

PROFILE_DIR = "profile"


def profile_steps(profile, max_steps: int) -> tuple[int, int] | None:
    """``logger.profile`` as ``(first, last)`` (1-based, inclusive) or None; ConfigError if malformed."""
    from ..config import ConfigError

    if profile is None:
        return None
    steps = list(profile)
    if (
        len(steps) != 2
        or any(isinstance(s, bool) or not isinstance(s, int) for s in steps)
        or not 1 <= steps[0] <= steps[1] <= max_steps
    ):
        raise ConfigError(
            f"logger.profile={steps} must be [first_step, last_step] with 1 ≤ first ≤ last ≤ "
            f"train.max_steps {max_steps} (steps count from 1, as logged), e.g. logger.profile=[2,3]"
        )
    return steps[0], steps[1]


def trace_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / PROFILE_DIR / f"trace_rank{rank}.json"


class StepProfiler:
    """Profiles steps ``first..last`` of this rank; call :meth:`before` / :meth:`after` around each step.

    ``steps=None``: does nothing (the cost is two comparisons per step)."""

    def __init__(self, steps: tuple[int, int] | None, run_dir: str | Path, rank: int, device: torch.device):
        self.steps, self.path, self.device = steps, trace_path(run_dir, rank), device
        self.nvtx = os.environ.get("GRIDTRAIN_PROFILE", "") == "nvtx"
        self._session: contextlib.ExitStack | None = None
        self._range: contextlib.AbstractContextManager | None = None
        self._prof = None

    def before(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run."""
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return
        if self._session is None:  # the first profiled step (or the first after a resume inside the range)
            self._start()
        self._range = named_range(f"train_step {step}")
        self._range.__enter__()

    def after(self, step: int) -> None:
        """Step ``step`` has run (its record is complete)."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.steps is not None and step == self.steps[1]:
            self._stop()

    def close(self) -> None:
        """End a profile cut short (an exception, a pre-emption): write what was recorded."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._stop()

    def _start(self) -> None:
        session = contextlib.ExitStack()
        cuda = self.device.type == "cuda"
        if self.nvtx:
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.profiler.start()
                session.callback(torch.cuda.profiler.stop)
                session.callback(torch.cuda.synchronize, self.device)
            session.enter_context(torch.autograd.profiler.emit_nvtx())
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = session.enter_context(torch.profiler.profile(activities=activities))
        self._session = session

    def _stop(self) -> None:
        if self._session is None:
            return
        session, self._session = self._session, None
        session.close()
        if self._prof is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.path))
            self._prof = None
