"""Grouped matmuls over sorted row segments: the experts' GEMMs of :class:`~parallel.layers.moe.GroupedExperts`.

Rows ``x`` ``[n, in]`` come sorted by group, ``sizes[i]`` rows for group ``i`` (host ints, some may be
0), each multiplied by its own weight ``w[i]`` ``[in, out]``. Three ways, the same numbers (fp32: the
same products and sums per row, so forward and gradients equal the loop's to rounding):

* ``"grouped"``: one ``torch.nn.functional.grouped_mm`` call (``torch._grouped_mm`` before it was public)
  with ``int32`` end offsets on the device;
* ``"padded"``: every segment padded to the longest into ``[L, max, in]``, one ``torch.bmm``, rows gathered back;
* ``"loop"``: one ``x_i @ w[i]`` per group, concatenated.

:func:`expert_matmul_kind` picks the way once per device type (cached): on CUDA ``"grouped"`` where the GPU
has the kernel (compute capability ≥ 8.0), on CPU the fastest measured by ``python -m benchmarks.moe
--grouped`` (docs/performance.md), on meta (the dry run) the GPU's. A call whose operands the grouped kernel
does not take (CUDA and meta: other than bf16; any device: a row stride not a multiple of 16 bytes) falls
back to the loop, decided on the host from shapes and dtype alone. Importing this module gives torch's
``FlopCounterMode`` a formula for the grouped kernel. The CUDA path is not run by this project's CPU tests.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import flop_registry, register_flop_formula

from .grouped_traced import traced_grouped_mm

KINDS = ("grouped", "padded", "loop")
#: the CPU's choice, measured by ``python -m benchmarks.moe --grouped`` (docs/performance.md, issue 33)
CPU_KIND = "grouped"
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one grouped matmul (torch's ``FlopCounterMode`` has no formula for it: expert matmuls
    counted 0): ``[n, k] @ [L, k, m]`` 2·n·k·m; the weights' gradient ``[k, n] @ [n, m]``, its
    contraction split into the groups, 2·k·n·m; batched ``[L, n, k] @ [L, k, m]`` 2·L·n·k·m."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[-1] * functools.reduce(lambda x, y: x * y, out_shape, 1)


if torch.ops.aten._grouped_mm not in flop_registry:  # registered once per process (torch's registry is global)
    register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


@functools.cache
def expert_matmul_kind(device_type: str) -> str:
    """How experts multiply on ``device_type`` (``"cuda"``, ``"cpu"``, ...): one of :data:`KINDS`, decided once.
    ``"meta"`` is the dry run's stand-in for a GPU (:mod:`parallel.dryrun`): the GPU's kernel, under its
    rule (bf16), with torch's meta shapes; not a Python loop over the rank's experts."""
    if _grouped_mm is None:
        return "loop"
    if device_type == "meta":
        return "grouped"
    if device_type == "cuda":
        return "grouped" if torch.cuda.get_device_capability() >= (8, 0) else "loop"
    return CPU_KIND if device_type == "cpu" else "loop"


def grouped_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the grouped kernel takes ``x`` ``[n, in]`` @ ``w`` ``[L, in, out]`` (host facts only)."""
    if x.device.type in ("cuda", "meta") and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return x.dtype == w.dtype and (w.shape[1] * size) % 16 == 0 and (w.shape[2] * size) % 16 == 0


class _ZeroEmptyGroups(torch.autograd.Function):
    """Identity on the weights ``[L, in, out]``; backward zeroes the gradient of the groups that had no rows.

    That gradient is zero mathematically, and torch's grouped kernel gives zeros on Hopper, but on Blackwell
    (SM 100) it returns non-zero values there (pytorch/pytorch#172439, open): an expert that received no
    tokens would be updated with garbage. One ``index_fill_`` (``empty``: int64 group indices) or
    ``masked_fill`` (``empty``: bool ``[L]``, the compiled experts' form, no host read) of the fresh weight
    gradient, on every device (the CPU tests hold it), and only in calls where a group is empty."""

    @staticmethod
    def forward(ctx, w, empty):
        ctx.save_for_backward(empty)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        (empty,) = ctx.saved_tensors
        if empty.dtype == torch.bool:
            return grad.masked_fill_(empty.view(-1, 1, 1), 0), None
        return grad.index_fill_(0, empty, 0), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity; backward makes the gradient contiguous (the grouped kernel's backward refuses zero strides)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@dataclass
class Segments:
    """Row segments of one expert call: ``sizes`` (host ints); the device indices a ``kind`` needs are made
    on first use (host ints copied to ``device``: no synchronisation)."""

    sizes: list[int]
    kind: str
    device: torch.device

    @classmethod
    def of(cls, sizes: list[int], x: torch.Tensor, kind: str | None = None) -> Segments:
        """Segments of ``x``'s rows; ``kind`` defaults to :func:`expert_matmul_kind` of its device."""
        return cls(list(sizes), kind or expert_matmul_kind(x.device.type), x.device)

    def _on_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    @functools.cached_property
    def group_of_row(self) -> torch.Tensor:
        """``[n]`` int64: each row's group."""
        groups = torch.arange(len(self.sizes), device=self.device)
        counts = self._on_device(self.sizes, torch.int64)
        return torch.repeat_interleave(groups, counts, output_size=sum(self.sizes))

    @functools.cached_property
    def _offsets(self) -> torch.Tensor:
        return self._on_device(list(itertools.accumulate(self.sizes)), torch.int32)

    @functools.cached_property
    def _empty(self) -> torch.Tensor:
        return self._on_device([i for i, n in enumerate(self.sizes) if n == 0], torch.int64)

    @functools.cached_property
    def _padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._on_device([0, *itertools.accumulate(self.sizes)][:-1], torch.int64)
        pos = torch.arange(sum(self.sizes), device=self.device) - starts[self.group_of_row]
        return self.group_of_row, pos

    def per_row(self, b: torch.Tensor) -> torch.Tensor:
        """``b`` ``[L, out]`` (one row per group) expanded to the rows ``[n, out]``."""
        return b.index_select(0, self.group_of_row)

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, in]`` (these segments) times ``w`` ``[L, in, out]`` per group: ``[n, out]``."""
        kind = self.kind
        if kind == "grouped" and not grouped_fits(x, w):
            kind = "loop"
        if kind == "grouped" and x.shape[0]:
            return grouped_matmul(x, w, self._offsets, self._empty if 0 in self.sizes else None)
        if kind == "padded" and x.shape[0]:
            group, pos = self._padded_index
            padded = x.new_zeros(len(self.sizes), max(self.sizes), x.shape[1]).index_put((group, pos), x)
            return torch.bmm(padded, w)[group, pos]
        return torch.cat([part @ w[i] for i, part in enumerate(torch.split(x, self.sizes))], dim=0)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, empty: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[n, in]`` (``n > 0``) @ ``w`` ``[L, in, out]`` per row group by one grouped kernel; ``offs``
    ``[L]`` int32 end offsets on the device, ``empty`` the groups without rows whose weight gradient is zeroed
    (:class:`_ZeroEmptyGroups`; None: no group is empty). Traceable with ``n`` symbolic: under
    ``torch.compile`` the kernel is :func:`.grouped_traced.traced_grouped_mm`."""
    if empty is not None and w.requires_grad:
        w = _ZeroEmptyGroups.apply(w, empty)
    y = traced_grouped_mm(x, w, offs) if torch.compiler.is_compiling() else _grouped_mm(x, w, offs=offs)
    return _ContiguousGrad.apply(y)
