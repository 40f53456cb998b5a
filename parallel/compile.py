"""``torch.compile`` of model regions, the way torchtitan compiles per transformer block.

The executor, the schedules and ZeRO's hooks stay eager Python; what is compiled is a
module's ``forward`` (or any method) on its own, so the module's hooks — ZeRO-3's gathers and
frees, the pipeline's saved-tensor stash, activation checkpointing around a block — run
around the compiled code exactly as around the eager one, and parameter names do not change
(no ``_orig_mod.`` prefix). Collectives inside a compiled region are registered custom ops
(:mod:`parallel.comm.traceable`, :mod:`parallel.layers.ring_traced`): counted, recorded,
and no graph break. Each region is compiled with ``fullgraph=True`` (a graph break is an
error, not a silent slow path) and ``dynamic=False``: one compile per distinct input shape
(the short last micro-batch, evaluation), cached after the first (:func:`compile_stats`) — except
the rows of a region whose row count follows the data (the experts of :func:`compile_moe`), which
are symbolic.

Backends: :data:`COMPILE_BACKENDS`; ``inductor`` generates kernels (the default), the
cheaper ``aot_eager`` traces forward and backward but runs ATen ops (tests), ``eager`` only
traces (graph-break counting).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

#: the ``torch.compile`` backends a run may ask for (``train.compile_backend``)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

#: the run directory's sub-folder holding inductor's generated kernels (``TORCHINDUCTOR_CACHE_DIR``)
INDUCTOR_CACHE = "cache/inductor"

#: the timing entries of ``torch._dynamo.utils.compilation_time_metrics`` that sum to the compile time
_COMPILE_METRICS = ("_compile.compile_inner", "backward._backward_impl")


def compile_method(obj: Any, name: str = "forward", *, backend: str = "inductor", dynamic_rows: bool = False) -> None:
    """Replace ``obj.<name>`` by its compiled version, in place (on the instance only).

    ``dynamic_rows``: the first argument's dim 0 is symbolic (``torch._dynamo.maybe_mark_dynamic`` before
    each call), for a row count that follows the data (the tokens an expert rank receives): one graph for
    every count instead of one per count. Dynamo still specialises a size of 0 or 1 (a graph each)."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend {backend!r} is not one of {', '.join(COMPILE_BACKENDS)}")
    compiled = torch.compile(getattr(obj, name), backend=backend, fullgraph=True, dynamic=False)
    if dynamic_rows:
        static = compiled

        def compiled(rows: torch.Tensor, *args, **kwargs):
            torch._dynamo.maybe_mark_dynamic(rows, 0)
            return static(rows, *args, **kwargs)

    setattr(obj, name, compiled)


def compile_moe(layer: Any, backend: str = "inductor") -> tuple[str, ...]:
    """Compile the traceable regions of a :class:`~parallel.layers.moe.MoELayer` in place, torchtitan's
    way: the router (:meth:`~parallel.layers.moe.MoELayer.route_tokens`), the routed experts' grouped
    computation (:meth:`~parallel.layers.experts.GroupedExperts.grouped`, its row count symbolic) and the
    shared experts' MLP. Dispatch and combine stay eager between them: the per-expert counts are read on
    the host to size the uneven all-to-alls. Returns the regions compiled."""
    compile_method(layer, "route_tokens", backend=backend)
    compile_method(layer.experts, "grouped", backend=backend, dynamic_rows=True)
    if layer.shared is None:
        return ("router", "experts")
    compile_method(layer.shared, "forward", backend=backend)
    return ("router", "experts", "shared")


def use_inductor_cache(run_dir: str | Path) -> Path:
    """Point inductor's kernel cache at ``<run_dir>/cache/inductor`` (before anything compiles);
    an explicit ``TORCHINDUCTOR_CACHE_DIR`` in the environment wins. Returns the folder used."""
    folder = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(run_dir) / INDUCTOR_CACHE)))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_stats() -> dict[str, float]:
    """This process's compile work so far: ``graphs`` compiled (each distinct shape or grad mode of a
    region is one), ``graph_breaks``, and ``seconds`` spent tracing and compiling (forward and backward)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "seconds": sum(sum(compilation_time_metrics.get(k, ())) for k in _COMPILE_METRICS),
    }


def compile_report(stats: dict[str, float], cache: str | Path | None = None) -> str:
    """The run's one line about compilation (after its first step): graphs, seconds, breaks, cache."""
    where = f"; inductor cache {cache}" if cache else ""
    return (
        f"torch.compile: {stats['graphs']} graph(s) in {stats['seconds']:.1f} s, "
        f"{stats['graph_breaks']} graph break(s){where}"
    )
