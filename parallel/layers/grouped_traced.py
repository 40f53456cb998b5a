"""The experts' grouped matmul that ``torch.compile`` can trace at any dtype, the row count symbolic.

Torch's ``aten._grouped_mm`` runs on the CPU in fp32, but its meta function (what a trace runs to
learn output shapes) accepts bf16 operands only (the CUDA kernel's rule, torch 2.13: "Expected inputs
of BF16 type"): an fp32 expert matmul fails to trace. So under compilation an operand pair the meta
function refuses goes through ``gridtrain::grouped_mm``, a registered op whose eager body *is*
``torch._grouped_mm`` and whose fake implementation gives the output shape from the operands' shapes
alone (the row count ``n`` may be symbolic: one graph for every ``n``). Its gradient
(``register_autograd``) is the same op twice, as aten's own backward computes it (``dX = dY·Wᵀ``
per group, ``dW_g = X_gᵀ·dY_g``): bit for bit eager's numbers. bf16 operands trace through the aten
op itself (inductor's own grouped kernel on a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@torch.library.custom_op("gridtrain::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: ``a`` ``[n, in]`` @ ``b`` ``[L, in, out]`` per row group
    (``[n, out]``), or ``a`` ``[in, n]`` @ ``b`` ``[n, out]`` per column group (``[L, in, out]``);
    ``offs`` ``[L]`` int32 end offsets."""
    return _grouped_mm(a, b, offs=offs)


@grouped_mm_op.register_fake
def _(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    da = db = None
    if ctx.needs_input_grad[0]:
        da = grouped_mm_op(grad, b.transpose(-2, -1), offs)
    if ctx.needs_input_grad[1]:
        db = grouped_mm_op(a.t(), grad, offs)
    return da, db, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup)


def traced_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` ``[n, in]`` @ ``b`` ``[L, in, out]`` per row group, traceable: aten's op where its meta
    function takes the operands (bf16), else the registered op (module docstring)."""
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return _grouped_mm(a, b, offs=offs)
    return grouped_mm_op(a, b, offs)
