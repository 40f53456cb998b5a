"""Ring attention that ``torch.compile`` can trace: its forward and backward as custom ops.

The ring's transfers are host-driven (posted ``isend``/``irecv`` pairs through
:func:`parallel.comm.exchange`, waited for between the blocks' kernels), which dynamo cannot
trace. So under compilation the whole ring is two opaque, registered ops in the ``gridtrain``
namespace, ``ring_attention`` and ``ring_attention_backward``, joined by
``torch.library.register_autograd``: their eager bodies are :func:`.ring_attention.ring_forward`
and :func:`.ring_attention.ring_backward` themselves (the same transfers, counted and recorded as
in eager mode); the fake implementations give the shapes. The group travels by name, as in
:mod:`parallel.comm.traceable`. Everything around the ring (projections, rotary embedding,
norms, the MLP) stays in the compiled graph.
"""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from .ring_attention import ring_backward, ring_forward


@torch.library.custom_op("gridtrain::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, fp32 lse)`` of :func:`.ring_attention.ring_forward` on the group named ``group_name``
    (``ids``: packed documents' ids of the whole window, or None)."""
    return ring_forward(q, k, v, _resolve_process_group(group_name), causal, scale, ids)


@ring_attention_op.register_fake
def _(q, k, v, group_name, causal, scale, ids=None):
    b, h, s, _ = q.shape
    return q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("gridtrain::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` of :func:`.ring_attention.ring_backward` (dk and dv in their own buffers)."""
    group = _resolve_process_group(group_name)
    dq, dk, dv = ring_backward(grad_out, q, k, v, out, lse, group, causal, scale, ids)
    return dq, dk.clone(), dv.clone()  # a custom op's outputs may not share a buffer (dk, dv: halves of one)


@ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, group_name, causal, scale, ids=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as ring_backward's


def _setup(ctx, inputs, output) -> None:
    q, k, v, group_name, causal, scale, ids = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, ids)
    ctx.group_name, ctx.causal, ctx.scale = group_name, causal, scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, ids = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(grad_out, q, k, v, out, lse, ctx.group_name, ctx.causal, ctx.scale, ids)
    return dq, dk, dv, None, None, None, None


ring_attention_op.register_autograd(_backward, setup_context=_setup)


def traced_ring_attention(q, k, v, group, causal: bool, scale: float, ids=None) -> torch.Tensor:
    """:func:`.ring_attention.ring_attention`'s ring (cp > 1) as one traceable op; returns ``out``."""
    return ring_attention_op(q, k, v, group.group_name, causal, scale, ids)[0]
