"""What a run tells its user: a rank-0 progress bar, ``metrics.jsonl``, optional wandb.

Only rank 0 writes or prints; other ranks construct a :class:`RunLogger` with
``enabled=False`` and stay silent (they speak only through exceptions).
"""

from __future__ import annotations

import json
import math
import netrc
import os
import socket
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import torch

from parallel.timing import StepClock

LR_SCHEDULES = ("cosine", "linear", "constant")  # the one home of the names (config: optim.schedule)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str) -> float:
    """Learning rate of 0-based ``step``: linear warm-up, then cosine/linear decay or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant" or max_steps <= warmup_steps:
        return lr
    frac = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return lr + (min_lr - lr) * frac
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))


def measured_matmul_tflops(n: int = 1024, repeats: int = 5, dtype=torch.float32, device="cpu") -> float:
    """This machine's achieved dense-matmul TFLOP/s on ``device`` (the CPU MFU peak).

    Every CPU rank measures once, before its first step (a fixed cost of every run): ``n`` is
    sized in docs/performance.md ("Issue 27: the suite's time, fixed costs of a launched job").

    Best of ``repeats`` timings, so a machine busy with other work at that moment reads
    low and the MFU computed against it high: set ``logger.peak_tflops`` to pin it.
    Timed with :class:`parallel.timing.StepClock` (CUDA events on a GPU)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up
    clock = StepClock(torch.device(device))
    marks = []
    for _ in range(repeats):
        t0 = clock.mark()
        a @ b
        marks.append((t0, clock.mark()))
    best = min(clock.seconds(t0, t1) for t0, t1 in marks)
    return 2 * n**3 / best / 1e12


WANDB_CHECK_TIMEOUT_S = 3.0
#: columns the bar keeps for itself ("train:  45%|███▌    | 135/300 [00:12<00:15, 10.51step/s, ")
BAR_COLUMNS = 64
#: the metrics a progress line shows, most important first (the ones that do not fit are left out)
SHOWN = ("loss", "val_loss", "epoch", "lr", "grad_norm", "tokens_per_s", "mfu", "comm_frac", "mem_gb")
#: the line also names the slowest rank (recipes/training/guards.py) when it lags the median by more than this
STRAGGLER_SHOWN = 0.10


def terminal_columns(stream=None) -> int:
    """The width of the terminal ``stream`` (default stderr) writes to; 0 if it is not a terminal or
    its width is unknown. ``COLUMNS`` (as ``shutil.get_terminal_size`` reads it) takes precedence."""
    stream = sys.stderr if stream is None else stream
    try:
        if not stream.isatty():
            return 0
        columns = int(os.environ.get("COLUMNS", "0") or 0)
        return columns if columns > 0 else os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def fit_metrics(shown: dict[str, str], width: int) -> str:
    """``k=v, k=v, ...`` of ``shown`` in order, stopping before the first that would pass ``width`` chars."""
    out = ""
    for k, v in shown.items():
        item = f"{k}={v}"
        candidate = f"{out}, {item}" if out else item
        if len(candidate) > width:
            break
        out = candidate
    return out


def wandb_online_problem(
    env: dict[str, str] | None = None, *, timeout_s: float = WANDB_CHECK_TIMEOUT_S, connect=socket.create_connection
) -> str | None:
    """Why ``logger.wandb=online`` cannot work here, or None: checked in at most ``timeout_s`` seconds.

    A key: ``WANDB_API_KEY`` or a ``~/.netrc`` (``NETRC``) entry for the server. The server:
    ``WANDB_BASE_URL`` (default ``https://api.wandb.ai``) accepting a TCP connection. wandb itself
    would fail at once without a key, and retry for minutes without a network.
    """
    env = os.environ if env is None else env
    url = urllib.parse.urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    if not env.get("WANDB_API_KEY"):
        try:
            entry = netrc.netrc(env.get("NETRC")).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            entry = None
        if not entry or not entry[2]:
            return f"no API key (set WANDB_API_KEY or run `wandb login`) for {host}"
    try:
        connect((host, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{host}:{port} is not reachable within {timeout_s:g} s ({e.__class__.__name__}: {e})"
    return None


class RunLogger:
    """Progress bar + metrics file + wandb, all on rank 0 only."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        progress: bool = True,
        wandb_mode: str = "disabled",
        wandb_project: str = "gridtrain",
        config: dict | None = None,
        start_step: int = 0,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._bar = None
        self._wandb = None
        self._metrics = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if progress and terminal_columns():  # a bar only on a terminal of known width, else plain lines
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                ncols=terminal_columns(),
                file=sys.stderr,
            )
        if wandb_mode == "online" and (problem := wandb_online_problem()):
            wandb_mode = "offline"
            print(
                f"warning: logger.wandb=online: {problem}; logging offline instead "
                f"(upload later with `wandb sync {self.run_dir / 'wandb'}`)",
                file=sys.stderr,
                flush=True,
            )
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=wandb_project, mode=wandb_mode, dir=str(self.run_dir), config=config or {}, reinit=True
            )

    def info(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """``warning: <text>`` on stderr (beside the bar, if one is drawn); rank 0 only."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(f"warning: {text}", file=sys.stderr)
        else:
            print(f"warning: {text}", file=sys.stderr, flush=True)

    def drop_rows_after(self, step: int) -> int:
        """Remove the rows of ``metrics.jsonl`` logged after ``step`` (a resumed run logs those steps
        again: no step appears twice); returns how many were dropped. Rewritten atomically."""
        if not self.enabled:
            return 0
        path = self.run_dir / "metrics.jsonl"
        self._metrics.close()
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _row_step(line) <= step]
        if len(kept) < len(lines):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self._metrics = open(path, "a", buffering=1)
        return len(lines) - len(kept)

    def log(self, record: dict[str, Any], *, advance: int = 0) -> None:
        """Append one JSON line (and send it to wandb); move the bar by ``advance`` steps."""
        if not self.enabled:
            return
        self._metrics.write(json_line(record))
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))
        shown = {k: _fmt(record[k]) for k in SHOWN if k in record}
        if (record.get("slowest_lag") or 0.0) > STRAGGLER_SHOWN:
            shown["slowest"] = f"rank{record['slowest_rank']}{record['slowest_lag']:+.0%}"
        if self._bar is not None:  # the metrics that fit beside the bar in the terminal's current width
            width = terminal_columns() or self._bar.ncols
            self._bar.ncols = width
            self._bar.set_postfix_str(fit_metrics(shown, width - BAR_COLUMNS), refresh=False)
        else:  # no terminal, or one of unknown width (a log file, CI, Slurm): one line per logged step
            print(f"step {record.get('step')}: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Close the bar (and join tqdm's monitor thread once no bar is left), the metrics file, wandb."""
        if self._bar is not None:
            self._bar.close()
            cls = type(self._bar)
            if getattr(cls, "monitor", None) is not None and not cls._instances:
                cls.monitor.exit()  # sets its stop event and joins it
                cls.monitor = None
        if self._metrics is not None:
            self._metrics.close()
        if self._wandb is not None:
            self._wandb.finish()


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON: an inf/NaN number becomes ``null`` and its key is
    listed under ``"nonfinite"`` (JSON has no NaN; Python's ``json`` would write a bare ``NaN``)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        record = {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}
    return json.dumps(record, allow_nan=False) + "\n"


def _row_step(line: str) -> float:
    """The step of a ``metrics.jsonl`` line (a line that is not a row with a step: kept, as step 0)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return 0
    return step if isinstance(step, (int, float)) else 0


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)
