"""Spawn the local workers of a job through PyTorch's elastic launcher API.

``python -m recipes.gpt_tiny parallel.tp=2 parallel.pp=2`` (no torchrun) lands
here: the recipe process becomes the launcher and starts ``nproc`` workers
exactly as ``torchrun --standalone --nproc-per-node nproc`` would (c10d
rendezvous on a free local port, the torchrun environment in every worker).
If a worker raises, the launcher stops the others and raises
``ChildFailedError`` carrying the failing rank's traceback (workers wrap their
entry point in ``torch.distributed.elastic.multiprocessing.errors.record``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


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
    )
    return elastic_launch(config, entrypoint)(*args)
