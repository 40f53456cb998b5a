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
import time
import urllib.parse
from pathlib import Path
from typing import Any

import torch


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


def measured_matmul_tflops(n: int = 2048, repeats: int = 5, dtype=torch.float32) -> float:
    """This machine's achieved dense-matmul TFLOP/s on the current device (the CPU MFU peak).

    Best of ``repeats`` timings, so a machine busy with other work at that moment reads
    low and the MFU computed against it high: set ``logger.peak_tflops`` to pin it."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


WANDB_CHECK_TIMEOUT_S = 3.0


def wandb_online_problem(env: dict[str, str] | None = None, *, timeout_s: float = WANDB_CHECK_TIMEOUT_S,
                         connect=socket.create_connection) -> str | None:
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

    def __init__(self, run_dir: str | Path, *, enabled: bool, total_steps: int, progress: bool = True,
                 wandb_mode: str = "disabled", wandb_project: str = "gridtrain",
                 config: dict | None = None, start_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._bar = None
        self._wandb = None
        self._metrics = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, disable=None)
        if wandb_mode == "online" and (problem := wandb_online_problem()):
            wandb_mode = "offline"
            print(f"warning: logger.wandb=online: {problem}; logging offline instead "
                  f"(upload later with `wandb sync {self.run_dir / 'wandb'}`)", file=sys.stderr, flush=True)
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=wandb_project, mode=wandb_mode, dir=str(self.run_dir),
                                     config=config or {}, reinit=True)

    def info(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def log(self, record: dict[str, Any], *, advance: int = 0) -> None:
        """Append one JSON line (and send it to wandb); move the bar by ``advance`` steps."""
        if not self.enabled:
            return
        self._metrics.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                            step=record.get("step"))
        keys = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "comm_frac", "mem_gb")
        shown = {k: _fmt(record[k]) for k in keys if k in record}
        if self._bar is not None and not self._bar.disable:
            self._bar.set_postfix(shown, refresh=False)
        else:  # no terminal (a log file, CI, Slurm): one line per logged step instead of a bar
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


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)
