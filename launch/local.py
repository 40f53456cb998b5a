"""Spawn the local workers of a job through PyTorch's elastic launcher API.

``python -m recipes.gpt_tiny parallel.tp=2 parallel.pp=2`` (no torchrun) lands
here: the recipe process becomes the launcher and starts ``nproc`` workers
exactly as ``torchrun --standalone --nproc-per-node nproc`` would (c10d
rendezvous on a free local port, the torchrun environment in every worker).
If a worker raises or dies, the launcher stops the others and raises
``ChildFailedError`` carrying the failing rank's traceback (workers wrap their
entry point in ``torch.distributed.elastic.multiprocessing.errors.record``);
torch's own log lines about it are silenced, the caller reports it once
(:func:`launch.failures.failure_report`).

SIGTERM or SIGINT to the launcher is *forwarded* to the workers as SIGTERM and
the launcher keeps waiting for them: they save a checkpoint at the end of their
step and return normally, so the job ends with status 0 within the workers'
grace period (``train.sigterm_grace_s``). torch's own launcher would instead
raise in the launcher, leaving workers that had already saved blocked until it
force-killed them 30 s later (status 1, a traceback). A second signal kills the
workers at once (the launcher then exits with 128 + the signal).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

#: the signals the launcher forwards to its workers as SIGTERM (their "checkpoint, then stop")
FORWARDED = (signal.SIGTERM, signal.SIGINT)
#: the signals torch's launcher still turns into "stop the workers now" (LaunchConfig.signals_to_handle)
TORCH_HANDLES = "SIGHUP,SIGQUIT"


#: on a machine without GPUs, local workers allowed per CPU core (ranks mostly wait on each other) ...
CPU_WORKERS_PER_CORE = 4
#: ... and at least this many, so the 8-rank examples run on a laptop
MIN_CPU_WORKERS = 8


class LocalWorldError(ValueError):
    """A self-spawned world larger than this machine holds (the message is one line)."""


def local_capacity(*, gpus: int | None = None, cores: int | None = None) -> tuple[int, str]:
    """How many workers one self-spawned job may start here, and the reason in words.

    With GPUs: one worker per GPU (NCCL cannot share a device between ranks). Without:
    ``max(cores × CPU_WORKERS_PER_CORE, MIN_CPU_WORKERS)``. Defaults: this machine.
    """
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return gpus, f"{gpus} GPU(s), one worker each"
    cores = cores or os.cpu_count() or 1
    limit = max(cores * CPU_WORKERS_PER_CORE, MIN_CPU_WORKERS)
    return limit, f"{cores} CPU core(s), no GPU: at most max({CPU_WORKERS_PER_CORE} × cores, {MIN_CPU_WORKERS})"


def check_local_world(
    world_size: int, *, oversubscribe: bool = False, gpus: int | None = None, cores: int | None = None
) -> None:
    """Refuse (:class:`LocalWorldError`) a self-spawned world larger than :func:`local_capacity`,
    unless ``oversubscribe``; the message points at the launchers and modes that fit."""
    limit, why = local_capacity(gpus=gpus, cores=cores)
    if world_size <= limit or oversubscribe:
        return
    raise LocalWorldError(
        f"world size {world_size} does not fit one machine's self-spawn ({why} = {limit} workers); "
        f"launch it with torchrun on every node (launch/slurm.sbatch on Slurm), size it without processes "
        f"with mode=plan or mode=dryrun, or set parallel.oversubscribe=true to spawn it here anyway"
    )


def under_torchrun() -> bool:
    """True inside a worker started by torchrun or by :func:`spawn_local`."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def spawn_local(
    entrypoint: Callable[..., Any],
    nproc: int,
    *args: Any,
    run_id: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout_s: int = 300,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local workers; return {rank: return value}.

    ``entrypoint`` must be a module-level function (workers are *spawned*, so
    it is imported by name) and ``args`` picklable.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be ≥ 1, got {nproc}")
    with forward_signals_to_workers():
        return _launch(entrypoint, nproc, args, run_id, max_restarts, rdzv_timeout_s)


@contextlib.contextmanager
def forward_signals_to_workers() -> Iterator[None]:
    """While inside: SIGTERM/SIGINT go to the live worker processes as SIGTERM (see module doc),
    instead of torch's launcher handlers (:data:`TORCH_HANDLES` keeps those off them).
    Outside the main thread (signals cannot be handled there) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        workers = multiprocessing.active_children()
        if len(received) == 1:
            for w in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGTERM)
            print(
                f"{signal.Signals(signum).name}: asked {len(workers)} worker(s) to checkpoint and stop "
                f"(another signal kills them)",
                file=sys.stderr,
                flush=True,
            )
            return
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


#: torch's loggers that report a failed worker (a log line per survivor stopped, the failure's
#: traceback); the caller reports the failure itself (``launch.failures``), once
FAILURE_LOGGERS = ("torch.multiprocessing.spawn", "torch.distributed.elastic.multiprocessing.api")


@contextlib.contextmanager
def _quiet_failure_logs() -> Iterator[None]:
    import logging

    loggers = [logging.getLogger(name) for name in FAILURE_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _launch(entrypoint, nproc, args, run_id, max_restarts, rdzv_timeout_s) -> dict[int, Any]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id or uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_timeout=rdzv_timeout_s,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle=TORCH_HANDLES,
    )
    with _quiet_failure_logs():
        return elastic_launch(config, entrypoint)(*args)
