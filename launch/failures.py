"""What a self-spawned job that lost a worker says: the failing rank's traceback, then one line.

torch's launcher ends such a job with its own log lines, the launcher's traceback and a
``ChildFailedError`` box (64 lines for one ``kill -9``), and no word on how to go on.
:func:`failure_report` turns the failure into

* the traceback of the rank that failed first (the root cause), if it raised — not the
  survivors', whose errors only say that a peer went away;
* one last line: ``error: rank R (pid P) <was killed by SIGKILL | raised <exception>>`` after the
  last logged step, the last published checkpoint, and the command that resumes the run.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any


def _how(failure: Any) -> str:
    """How the process ended: the signal, the exception (its recorded message) or the status."""
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"was killed by {name} (signal {-failure.exitcode})"
    message = (failure.error_file_data or {}).get("message")
    text = message.get("message") if isinstance(message, dict) else message
    if isinstance(text, str) and text:
        return f"raised {text.strip().splitlines()[-1]}"
    return f"exited with status {failure.exitcode}"


def _traceback(failure: Any) -> str | None:
    message = (failure.error_file_data or {}).get("message")
    if isinstance(message, dict):
        stack = (message.get("extraInfo") or {}).get("py_callstack")
        if isinstance(stack, str) and stack.strip():
            return stack.rstrip()
    return None


def last_logged_step(run_dir: str | Path) -> int | None:
    """The step of the last row of ``<run_dir>/metrics.jsonl`` (None: nothing logged)."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def published_checkpoint(run_dir: str | Path) -> str:
    """Words for the run's last published checkpoint (``checkpoints/latest``)."""
    from parallel.checkpoint import CheckpointError, latest_checkpoint

    try:
        latest = latest_checkpoint(Path(run_dir) / "checkpoints")
    except CheckpointError as e:
        return f"none readable ({str(e).split('; ')[0]})"
    return str(latest) if latest is not None else "none"


def failure_report(error: Any, run_dir: str | Path, resume_command: str) -> tuple[str | None, str]:
    """``(traceback or None, summary line)`` for a :class:`ChildFailedError` of a job in ``run_dir``."""
    rank, failure = error.get_first_failure()
    step = last_logged_step(run_dir)
    after = f"after step {step} (the last logged)" if step is not None else "before its first logged step"
    ckpt = published_checkpoint(run_dir)
    if ckpt == "none":
        go_on = f"no checkpoint was published (train.ckpt_every=N saves some), so rerun from step 1: {resume_command}"
    else:
        go_on = f"last published checkpoint: {ckpt}; resume with: {resume_command}"
    line = f"error: rank {rank} (pid {failure.pid}) {_how(failure)} {after}; the job stopped; {go_on}"
    return _traceback(failure), line
