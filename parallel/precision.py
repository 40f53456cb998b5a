"""Precision names, their bytes and their torch dtypes: the one home.

Config keys ``train.precision`` (:data:`TRAIN_PRECISIONS`) and ``comm.dtype`` (:data:`PRECISIONS`)
choose among them; the ZeRO theory (:data:`parallel.zero.theory.DTYPE_BYTES`), the planner and the
trainer import these tables instead of spelling them again.

``fp8`` is a training precision, not a storage dtype: the run is a bf16 run (bf16 parameters and
activations, fp32 masters and gradient accumulation, the same checkpoints) whose tensor-parallel
linears cast their GEMMs to fp8 (:mod:`parallel.layers.fp8`); :func:`base_precision` names the dtype
everything else follows.
"""

from __future__ import annotations

import torch

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element
PRECISIONS = tuple(DTYPE_BYTES)  # ("fp32", "bf16", "fp16")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(TORCH_DTYPES) == PRECISIONS
FP8 = "fp8"
FP8_BYTES = 1  # bytes per element of an fp8 GEMM operand (e4m3 / e5m2)
TRAIN_PRECISIONS = (*PRECISIONS, FP8)
FP8_RECIPES = ("tensorwise", "rowwise")  # train.fp8_recipe (parallel.layers.fp8)


def base_precision(precision: str) -> str:
    """The precision parameters, activations and checkpoints are held in: ``bf16`` for ``fp8``."""
    return "bf16" if precision == FP8 else precision
