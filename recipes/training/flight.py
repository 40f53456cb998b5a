"""When the flight recorder's ring is written to ``<run>/flight/rank<r>.json`` during a run.

* ``kill -USR1 <pid>``: on demand, the job goes on (:func:`install`);
* an exception on this rank, a collective timeout among them (:func:`dump_on_error`);
* SIGTERM: the run's own pre-emption path calls :func:`dump_now` before it saves.

On CUDA torch's NCCL flight recorder is turned on too (:data:`TORCH_NCCL_ENV`, set before the
process group exists) and writes ``nccl_trace_rank_<r>`` beside ours. ``python -m recipes.diagnose
<run>`` reads them all.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from parallel.comm import flight

#: what turns on torch's own NCCL flight recorder, and where its dumps go (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``);
#: its dump on timeout without stack traces (``TORCH_INCLUDE_STACK_TRACE``: diagnose reads none of them, and
#: they make a dump larger and slower to read, docs/debugging.md)
TORCH_NCCL_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_INCLUDE_STACK_TRACE": "0"}
#: the name of torch's dump of rank r in ``<run>/flight``: this prefix, then r
TORCH_DUMP_PREFIX = "nccl_trace_rank_"


def folder(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "flight"


def torch_recorder_env(run_dir: str | os.PathLike) -> dict[str, str]:
    """The environment torch's NCCL flight recorder reads (the user's own settings win); nothing
    without CUDA (no NCCL groups to record)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    env = dict(TORCH_NCCL_ENV, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(folder(run_dir) / TORCH_DUMP_PREFIX))
    return {k: v for k, v in env.items() if k not in os.environ}


_WATCHDOG_DUMPED: set[str] = set()  # run dirs where this process's watchdog wrote its dump


def dump_now(run_dir: str | os.PathLike, reason: str) -> Path | None:
    """Write this rank's dump; None (and no exception) if the disk refuses it. A signal after this
    rank's watchdog dumped (the launcher stopping the job it ended) keeps the watchdog's reason."""
    if reason in ("SIGTERM", "SIGINT") and str(run_dir) in _WATCHDOG_DUMPED:
        return None
    if reason.startswith("watchdog"):
        _WATCHDOG_DUMPED.add(str(run_dir))
    try:
        return flight.dump(folder(run_dir), reason)
    except OSError:
        return None


def install(run_dir: str | os.PathLike) -> None:
    """Dump on ``SIGUSR1`` (main thread only: Python runs handlers there); the job goes on."""
    if hasattr(signal, "SIGUSR1"):
        try:
            signal.signal(signal.SIGUSR1, lambda *_: dump_now(run_dir, "SIGUSR1"))
        except ValueError:  # not the main thread (a test harness): no handler
            pass


def dump_on_error(run_dir: str | os.PathLike, error: BaseException) -> Path | None:
    """The dump of a rank that raised: ``reason`` names the exception (a timeout says so)."""
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return dump_now(run_dir, "timeout " + text if "timed out" in text.lower() or "timeout" in text.lower() else text)
