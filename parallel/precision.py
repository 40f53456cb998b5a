"""Precision names, their bytes and their torch dtypes: the one home.

Config keys ``train.precision`` and ``comm.dtype`` choose among :data:`PRECISIONS`; the
ZeRO theory (:data:`parallel.zero.theory.DTYPE_BYTES`), the planner and the trainer import
these tables instead of spelling them again.
"""

from __future__ import annotations

import torch

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element
PRECISIONS = tuple(DTYPE_BYTES)  # ("fp32", "bf16", "fp16")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(TORCH_DTYPES) == PRECISIONS
