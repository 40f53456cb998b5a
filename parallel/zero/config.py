"""``ZeroConfig``: what a :class:`~parallel.zero.ZeroDataParallel` does, checked once.

The settings, not the pieces: the module, its units, the optimizer factory, the loss
scaler and the process groups are :class:`~parallel.zero.ZeroDataParallel`'s own arguments.
A config that exists is valid: :meth:`ZeroConfig.__post_init__` refuses every impossible
combination, the same on every rank, before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dims import accumulate_problem, compression_problem
from ..precision import TORCH_DTYPES
from .compression import COMPRESSIONS, topk_count
from .layout import ZeroConfigError
from .offload import check_offload
from .policy import ZERO_STAGES
from .theory import ZERO_ACCUMULATE, accumulate_applies, grad_comm_dtype  # noqa: F401 (re-exported)

DTYPES = TORCH_DTYPES  # one home: parallel.precision


def _dtype(name, what: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ZeroConfigError(f"{what} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO's settings (``parallel.zero.engine``'s module docstring says what each does).

    ``stage`` 0–3; ``precision`` the parameters' compute dtype (``"fp32"``, ``"bf16"``, ``"fp16"``
    or a ``torch.dtype``); ``comm_dtype`` the gradients' wire dtype (None: fp32,
    :data:`~parallel.zero.theory.DEFAULT_COMM_DTYPE`); ``bucket_mb`` the most bytes per flat
    bucket (one collective each); ``overlap`` launch each bucket's collective from backward;
    ``grad_clip`` the global norm to clip to (None: no clipping); ``compression`` None or
    ``"topk"`` (stage 0) with ``topk_ratio``; ``offload`` one of
    :data:`~parallel.zero.offload.OFFLOAD_MODES`; ``accumulate`` ``"sharded"`` or (stages 2–3)
    ``"unsharded"``. ``"none"`` for ``compression`` and None/False for ``offload`` are normalised.
    """

    stage: int
    precision: str | torch.dtype = "fp32"
    comm_dtype: str | torch.dtype | None = None
    bucket_mb: float = 25
    overlap: bool = True
    grad_clip: float | None = None
    compression: str | None = None
    topk_ratio: float = 0.01
    offload: str = "none"
    accumulate: str = "sharded"

    def __post_init__(self) -> None:
        stage, accumulate, compression = self.stage, self.accumulate, self.compression
        if stage not in ZERO_STAGES:
            stages = ", ".join(map(str, ZERO_STAGES[:-1])) + f" or {ZERO_STAGES[-1]}"
            raise ZeroConfigError(f"ZeRO stage must be {stages}, got {stage}")
        if accumulate not in ZERO_ACCUMULATE:
            raise ZeroConfigError(f"accumulate must be one of {ZERO_ACCUMULATE}, got {accumulate!r}")
        if accumulate_problem(accumulate, stage):  # the rule's one home: parallel.dims
            raise ZeroConfigError(accumulate_problem(accumulate, stage))
        if compression not in (None, *COMPRESSIONS):
            raise ZeroConfigError(f"compression must be None or one of {COMPRESSIONS}, got {compression!r}")
        compression = None if compression == "none" else compression
        if compression_problem(compression, stage):  # the rule's one home: parallel.dims
            raise ZeroConfigError(compression_problem(compression, stage))
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ZeroConfigError(f"grad_clip must be positive or None, got {self.grad_clip}")
        if self.bucket_mb <= 0:
            raise ZeroConfigError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if compression:
            topk_count(1, self.topk_ratio)  # refuses a ratio outside (0, 1]
        offload = check_offload(self.offload, stage)
        if accumulate == "unsharded" and offload != "none":
            raise ZeroConfigError(
                f"accumulate='unsharded' keeps the full fp32 gradients on the device across micro-batches, "
                f"which undoes offload={offload!r} (it exists to free device memory); use one of them"
            )
        _dtype(self.precision, "precision")
        _dtype(grad_comm_dtype(self.comm_dtype), "comm_dtype")
        object.__setattr__(self, "compression", compression)
        object.__setattr__(self, "offload", offload)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the module's parameters are held and computed in."""
        return _dtype(self.precision, "precision")

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype gradient collectives send."""
        return _dtype(grad_comm_dtype(self.comm_dtype), "comm_dtype")

    @property
    def keep_full(self) -> bool:
        """Stages 2–3 keep the full fp32 gradient until the step's one reduce-scatter."""
        return self.accumulate == "unsharded"
