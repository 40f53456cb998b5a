"""FP8 matmul building blocks: dynamic scales, saturated casts, the scaled GEMM (real or emulated).

A recipe (:class:`Fp8Recipe`) names how a ``y = x·Wᵀ`` and its two backward GEMMs are cast:

* ``tensorwise``: one fp32 scale per tensor, ``scale = max(dtype) / amax``; the input and the weight
  in e4m3 (``float8_e4m3fn``, max 448), the output gradient in e5m2 (``float8_e5m2``, max 57344:
  range over precision). The forward's fp8 input is reused by ``dW`` (so it is what backward keeps).
* ``rowwise``: one scale per row of each GEMM operand along the dimension the GEMM does not contract
  (``[M, 1]`` for the left operand, ``[1, N]`` for the right), e4m3 everywhere, each scale rounded down
  to a power of two (so scaling is exact). ``dX = dY·W`` contracts over the output features, ``dW =
  dYᵀ·X`` over the tokens, so backward re-casts ``W``, ``dY`` and ``X`` along those axes from the
  high-precision tensors.

These are torchao's ``Float8LinearRecipeName.TENSORWISE`` / ``ROWWISE`` numerics (the same dtypes, the
``max / clamp(amax, 1e-12)`` scale computed in float64, the saturated cast). docs/precision.md says why
the casts are written here rather than imported.

The amax of an operand is MAX-all-reduced over ``group`` when the dimensions it is reduced over are
split across that group's ranks (:func:`amax`), through :mod:`parallel.comm`, so the bytes are counted;
the callers (:mod:`.fp8_linear`) decide which group that is.

:func:`scaled_mm` is ``torch._scaled_mm`` on a device with fp8 kernels; ``emulate=True`` casts the fp8
operands up and multiplies in fp32, then applies the inverse scales: the products of two fp8 values are
exact in fp32, so this differs from the kernel in the accumulation order only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm
from ..precision import FP8_RECIPES

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_EPS = 1e-12  # an all-zero tensor's amax, so its scale stays finite (torchao's EPS)
#: the lowest CUDA compute capability with fp8 tensor cores (Ada 8.9, Hopper 9.0 and later)
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Fp8Recipe:
    """How the tensor-parallel linears cast their GEMMs (module docstring): ``scaling`` one of
    :data:`FP8_RECIPES`; ``emulate`` multiplies the fp8 values in fp32 instead of ``torch._scaled_mm``."""

    scaling: str = "tensorwise"
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.scaling not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {self.scaling!r} is not one of {FP8_RECIPES}")

    @property
    def rowwise(self) -> bool:
        return self.scaling == "rowwise"

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's fp8 dtype: e5m2 tensorwise, e4m3 rowwise."""
        return E4M3 if self.rowwise else E5M2


def fp8_kernels(device: torch.device | str) -> bool:
    """Whether ``device`` has fp8 GEMM kernels (``torch._scaled_mm`` on a CUDA device of compute
    capability ≥ :data:`FP8_MIN_CAPABILITY`). A CPU is answered False: its ``_scaled_mm`` is a
    reference implementation, not faster than bf16, so the recipes ask for ``emulate`` there."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def fp8_device_problem(device: torch.device | str, emulate: bool) -> str | None:
    """Why fp8 cannot run on ``device`` (None if it can): no fp8 kernels and no emulation."""
    if emulate or fp8_kernels(device):
        return None
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(device)
        have = f"{torch.cuda.get_device_name(device)} has compute capability {cap[0]}.{cap[1]}"
    else:
        have = f"the device is {device.type}"
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    return f"{have}, without fp8 GEMM kernels (CUDA capability ≥ {need})"


def amax(t: torch.Tensor, dim: int | None, group=None) -> torch.Tensor:
    """``max |t|`` in fp32: over every element (``dim`` None, a 0-dim tensor) or along ``dim``
    (kept as size 1), MAX-all-reduced over ``group`` (None: this rank's tensor is the whole)."""
    a = t.detach().abs()
    a = (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()
    if group is not None and comm.group_size(group) > 1:
        a = comm.all_reduce_max(a, group)  # out of place: traceable under torch.compile, the same bytes
    return a


def scale_of(a: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """The fp32 scale that maps ``amax`` to ``dtype``'s largest value (float64 division, as torchao),
    rounded down to a power of two if asked (the rowwise recipe)."""
    s = (torch.finfo(dtype).max / a.double().clamp(min=AMAX_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if power_of_2 else s


def cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t · scale`` in fp32, saturated to ``dtype``'s range, rounded to ``dtype`` (nearest even)."""
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype)


def quantize(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None, group=None, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 tensor, inverse scale)`` of ``t`` scaled over all of it (``dim`` None) or along ``dim``
    (:func:`amax`); ``fp8.float() * inverse`` approximates ``t``."""
    s = scale_of(amax(t, dim, group), dtype, power_of_2)
    return cast(t, s, dtype), s.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def scaled_mm(
    a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype, emulate: bool
) -> torch.Tensor:
    """``(a · a_inv) @ (b · b_inv)`` for fp8 ``a [M, K]`` and ``b [K, N]``, with ``a_inv`` a scalar or
    ``[M, 1]`` and ``b_inv`` a scalar or ``[1, N]``: ``torch._scaled_mm`` (fp32 accumulation), or
    emulated in fp32 (module docstring)."""
    if emulate:
        return ((a.float() @ b.float()) * (a_inv * b_inv)).to(out_dtype)
    return torch._scaled_mm(a.contiguous(), _col_major(b), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
