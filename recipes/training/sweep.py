"""A Hydra callback that ends a multirun with one table of its jobs.

A failed job is a row of the table, not the end of the sweep: Hydra's basic
sweeper re-raises the first failure after the batch (before any
``on_multirun_end``), so :meth:`SweepSummary.on_job_end` records the failure
and marks the job's return as handled; :meth:`SweepSummary.on_multirun_end`
prints the table and then exits with the largest failed job's code (2 for a
refused config, 1 otherwise).
"""

from __future__ import annotations

from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import OmegaConf


class JobFailed(RuntimeError):
    """A multirun job that failed with ``exit_code`` (its ``error:`` line is already printed)."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


class SweepSummary(Callback):
    """Collects each job's overrides and return value; prints them as a table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any, str]] = []
        self.exit_code = 0

    def on_job_end(self, config, job_return, **kwargs) -> None:
        overrides = " ".join(job_return.overrides or []) or "(defaults)"
        try:
            value = job_return.return_value
            status = "ok"
        except Exception as e:  # noqa: BLE001 - a failed job is a row, not a crash
            first = (str(e).splitlines() or [""])[0]
            value, status = None, f"failed: {type(e).__name__}: {first[:80]}"
            if OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN:  # a single run fails as before
                self.exit_code = max(self.exit_code, getattr(e, "exit_code", 1))
                job_return.status, job_return.return_value = JobStatus.COMPLETED, None  # the sweep goes on
        self.rows.append((overrides, value, status))

    def on_multirun_end(self, config, **kwargs) -> None:
        if self.rows:
            print(format_summary(self.rows), flush=True)
        if self.exit_code:
            raise SystemExit(self.exit_code)


def format_summary(rows: list[tuple[str, Any, str]]) -> str:
    header = ("job", "overrides", "result", "status")
    lines = []
    for i, (ov, value, status) in enumerate(rows):
        if isinstance(value, dict):
            result = "  ".join(f"{k}={_fmt(v)}" for k, v in value.items() if k != "run_dir")
        else:
            result = "" if value is None else str(value)
        lines.append((str(i), ov, result, status))
    widths = [max(len(r[c]) for r in lines + [header]) for c in range(4)]
    fmt = " | ".join(f"{{:{w}}}" for w in widths)
    out = ["sweep summary:", fmt.format(*header), "-+-".join("-" * w for w in widths)]
    out += [fmt.format(*r) for r in lines]
    return "\n".join(out)


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)
