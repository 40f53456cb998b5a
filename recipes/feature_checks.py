"""Config checks of single features (document packing, fp8): each refuses, in one line with the
fix, a combination the feature does not support; :func:`recipes.validation.validate` calls them."""

from __future__ import annotations

from typing import Any

from parallel.dims import ParallelDims
from parallel.layers.fp8 import fp8_device_problem
from parallel.precision import FP8

from .config import ConfigError, bad


def check_packing(cfg: Any) -> None:
    """``data.packing=documents`` reads a prepared corpus's document index (the embedded corpus has none)."""
    d = cfg.data
    if d.packing == "documents" and d.source == "embedded" and not d.blend:
        raise bad(
            "data.packing",
            d.packing,
            "the embedded corpus has no document index (its files are joined without boundaries)",
            "prepare a corpus with `python -m recipes.prepare` and set data.source=memmap data.path=DIR, "
            "or use data.packing=concat",
        )


def check_fp8(cfg: Any, dims: ParallelDims) -> None:
    """``train.precision=fp8``: what its scales are not reduced over (cp), and a device with fp8 kernels
    unless ``train.fp8_emulate`` (asked on the device this rank will train on; mode=train only)."""
    t, p = cfg.train, cfg.parallel
    if t.precision != FP8:
        return
    if dims.cp_enabled:
        raise ConfigError(
            f"train.precision=fp8 with parallel.cp={p.cp}: the fp8 scales are taken per rank's sequence chunk, "
            "not over the context-parallel group, so the layouts would not compute the same model; use parallel.cp=1"
        )
    if cfg.mode != "train":
        return
    from parallel.groups import default_device

    problem = fp8_device_problem(default_device(p.backend), t.fp8_emulate)
    if problem:
        raise bad(
            "train.precision",
            FP8,
            problem,
            "set train.fp8_emulate=true (fp8 casts, fp32 matmuls: the same numerics, slower than bf16) "
            "or train.precision=bf16",
        )
