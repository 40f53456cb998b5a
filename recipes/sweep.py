"""A Hydra callback that ends a multirun with one table of its jobs."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback


class SweepSummary(Callback):
    """Collects each job's overrides and return value; prints them as a table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any, str]] = []

    def on_job_end(self, config, job_return, **kwargs) -> None:
        overrides = " ".join(job_return.overrides or []) or "(defaults)"
        try:
            value = job_return.return_value
            status = "ok"
        except Exception as e:  # noqa: BLE001 - a failed job is a row, not a crash
            value, status = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        self.rows.append((overrides, value, status))

    def on_multirun_end(self, config, **kwargs) -> None:
        if not self.rows:
            return
        print(format_summary(self.rows), flush=True)


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
