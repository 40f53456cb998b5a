"""The tensor-parallel linears' GEMMs in fp8 (:mod:`.fp8`'s recipes), forward and backward.

Every scale is taken over the *full* tensor's extent along the dimensions it reduces, so each layout
casts each element with the same scale as one process does. The three GEMM dimensions are the tokens
``T``, the input features ``K`` and the output features ``N``; a column layer splits ``N`` over the TP
group, a row layer ``K``; the tokens are whole wherever a GEMM runs (sequence parallelism gathers them
first). An amax is MAX-all-reduced over the TP group exactly when the dimensions it reduces include the
split one:

===========  ==================  ======================  ======================
operand      reduced over        column (``N`` split)    row (``K`` split)
===========  ==================  ======================  ======================
tensorwise   all of it           ``W``, ``dY``           ``X``, ``W``
rowwise      ``X``, ``W`` by K   local                   all-reduced
rowwise      ``dY``, ``W`` by N  all-reduced (in ``dX``)  local
rowwise      ``dY``, ``X`` by T  local                   local
===========  ==================  ======================  ======================

Tensorwise with sequence parallelism: the column layers' input arrives as this rank's sequence chunk;
its amax is all-reduced over TP *before* the all-gather, the chunk cast to e4m3 and the fp8 bytes
gathered (half the bf16 all-gather), and that fp8 chunk is what backward keeps and gathers again.
A TP-local amax there (Megatron-LM PR #442's bug) casts each chunk with its own scale: every layout
would compute something else (``tests/parallel/layers/test_fp8_linear.py`` shows it).

At ZeRO-3 the weight's DP shards are gathered before the forward, so its amax is over the whole TP
shard already; nothing is reduced over DP. Each amax all-reduce moves 4 bytes per scale.
"""

from __future__ import annotations

import torch

from .. import comm
from ..comm import traceable
from ..comm.autograd import SEQ_DIM
from .fp8 import E4M3, Fp8Recipe, amax, cast, quantize, scale_of, scaled_mm

DIMS = {"x": "TK", "w": "NK", "dy": "TN"}  # each operand's axes, in order


def _q(t: torch.Tensor, operand: str, over: str | None, dtype, recipe: Fp8Recipe, split: str, group):
    """``quantize`` of ``operand`` (``"x"``, ``"w"``, ``"dy"``) reduced along axis ``over`` (None: all of
    it), its amax all-reduced over ``group`` iff the reduced axes include the ``split`` one."""
    axes = DIMS[operand]
    reduced = axes if over is None else over
    dim = None if over is None else axes.index(over)
    return quantize(t, dtype, dim, group if split in reduced else None, recipe.rowwise)


def forward_mm(x2, xq, w, recipe: Fp8Recipe, split: str, group, out_dtype: torch.dtype):
    """``x2 · wᵀ`` (``[T, N]``) in ``out_dtype``, the cast input and what backward needs of the weight
    (its tensorwise scale); ``xq`` the input already cast (``(fp8, inverse scale)``) or None."""
    qx, sx = xq if xq is not None else _q(x2, "x", "K" if recipe.rowwise else None, E4M3, recipe, split, group)
    if recipe.rowwise:
        qw, sw = _q(w, "w", "K", E4M3, recipe, split, group)
        return scaled_mm(qx, sx, qw.t(), sw.t().contiguous(), out_dtype, recipe.emulate), (qx, sx), None
    w_scale = scale_of(amax(w, None, group), E4M3)  # W is split either way: its amax is the full weight's
    qw, sw = cast(w, w_scale, E4M3), w_scale.reciprocal()
    return scaled_mm(qx, sx, qw.t(), sw, out_dtype, recipe.emulate), (qx, sx), w_scale


def grad_output_tensorwise(dy2, recipe: Fp8Recipe, split: str, group):
    """The tensorwise ``dY`` in e5m2, shared by ``dX`` and ``dW``."""
    return _q(dy2, "dy", None, recipe.grad_dtype, recipe, split, group)


def grad_input_mm(dy2, w, w_scale, qdy, recipe: Fp8Recipe, split: str, group):
    """``dY · W`` (``[T, K]``): tensorwise with the forward's weight scale (re-cast, no collective)."""
    if recipe.rowwise:
        qd, sd = _q(dy2, "dy", "N", E4M3, recipe, split, group)
        qw, sw = _q(w, "w", "N", E4M3, recipe, split, group)
        return scaled_mm(qd, sd, qw, sw, dy2.dtype, recipe.emulate)
    qd, sd = qdy
    return scaled_mm(qd, sd, cast(w, w_scale, E4M3), w_scale.reciprocal(), dy2.dtype, recipe.emulate)


def grad_weight_mm(dy2, x_saved, qdy, recipe: Fp8Recipe, split: str, group):
    """``dYᵀ · X`` (``[N, K]``): tensorwise from the forward's fp8 ``X``; rowwise ``X`` (high precision,
    ``x_saved``) and ``dY`` re-cast along the tokens."""
    if recipe.rowwise:
        qd, sd = _q(dy2, "dy", "T", E4M3, recipe, split, group)  # [1, N]
        qx, sx = _q(x_saved, "x", "T", E4M3, recipe, split, group)  # [1, K]
        return scaled_mm(qd.t(), sd.t().contiguous(), qx, sx, dy2.dtype, recipe.emulate)
    qd, sd = qdy
    qx, sx = x_saved
    return scaled_mm(qd.t(), sd, qx, sx, dy2.dtype, recipe.emulate)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class Fp8Linear(torch.autograd.Function):
    """``y = x Wᵀ (+ b)`` with the GEMMs in fp8, on ``group`` with ``split`` (``"N"``: a column layer's
    shard, ``"K"``: a row layer's). The communication around it (copy / all-reduce) is the caller's;
    inside, only the amax all-reduces of the module table. Backward computes only the gradients asked
    for (a zero-bubble schedule asks for ``dX`` and ``dW`` in two calls)."""

    @staticmethod
    def forward(ctx, x, w, b, recipe: Fp8Recipe, split: str, group):
        x2 = _flat(x)
        y, xq, w_scale = forward_mm(x2, None, w, recipe, split, group, x.dtype)
        ctx.recipe, ctx.split, ctx.group, ctx.shape, ctx.has_bias = recipe, split, group, x.shape, b is not None
        ctx.w_scale = w_scale
        saved = (x2,) if recipe.rowwise else xq
        ctx.save_for_backward(w, *saved)
        y = y.view(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, dy):
        w, *saved = ctx.saved_tensors
        recipe, split, group = ctx.recipe, ctx.split, ctx.group
        dy2 = _flat(dy)
        qdy = None if recipe.rowwise else grad_output_tensorwise(dy2, recipe, split, group)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = grad_input_mm(dy2, w, ctx.w_scale, qdy, recipe, split, group).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            x_saved = saved[0] if recipe.rowwise else tuple(saved)
            dw = grad_weight_mm(dy2, x_saved, qdy, recipe, split, group).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None


def _gather_seq(chunk: torch.Tensor, group, async_op: bool = False, regather: bool = False):
    """All-gather ``chunk`` (``[b, s/N, ...]``) along the sequence; fp8 travels as its bytes. Under
    ``torch.compile`` a blocking traceable gather (``regather``: backward's second one), ordered by
    the compiler."""
    if traceable.tracing():
        wire = chunk.view(torch.uint8) if chunk.element_size() == 1 else chunk
        full = comm.all_gather_along(wire, SEQ_DIM, group, regather=regather)
        return lambda: full.view(chunk.dtype) if wire is not chunk else full
    n = comm.tp_world_size(group)
    src = chunk.contiguous().view(-1)
    wire = src.view(torch.uint8) if src.element_size() == 1 else src
    out = torch.empty(n * wire.numel(), dtype=wire.dtype, device=wire.device)
    work = comm.all_gather(out, wire, group=group, async_op=async_op)

    def done() -> torch.Tensor:
        if work is not None and async_op:
            work.wait()
        full = out.view(chunk.dtype) if wire is not src else out
        return torch.cat(full.view((n,) + tuple(chunk.shape)).unbind(0), dim=SEQ_DIM)

    return done


class Fp8Columns(torch.autograd.Function):
    """Several column layers reading one input (q/k/v, SwiGLU's gate/up) with fp8 GEMMs: the input
    cast once for all of them (and kept once for backward). ``sp``: the input is this rank's sequence
    chunk, as :class:`~.linear._SequenceParallelColumns`: tensorwise, its amax all-reduced over TP, the
    chunk cast and the fp8 bytes all-gathered forward and again in backward (``X/2`` each for a bf16
    ``X``); rowwise, the bf16 chunk gathered (its scales are per token, local) and re-gathered in
    backward, as the bf16 path does; backward reduce-scatters the input gradient (``N·X``). Without
    ``sp`` the input is whole (the caller's copy-to-region all-reduces its gradient) and nothing moves
    here but the amax all-reduces."""

    @staticmethod
    def forward(ctx, x, recipe: Fp8Recipe, group, sp: bool, *params):
        ctx.recipe, ctx.group, ctx.sp, ctx.has_bias = recipe, group, sp, [b is not None for b in params[1::2]]
        weights = params[0::2]
        if recipe.rowwise:
            keep = x
            total = _gather_seq(x, group)() if sp else x
            xq = _q(_flat(total), "x", "K", E4M3, recipe, "N", group)  # per token: local, once for every layer
        else:  # sp: the amax over the whole sequence, reduced before the gather
            qx, ctx.sx = quantize(x, E4M3, None, group if sp else None)
            keep = qx
            total = _gather_seq(qx, group)() if sp else qx
            xq = (_flat(total), ctx.sx)
        outs, scales = [], []
        for w, b in zip(weights, params[1::2]):
            y, _, w_scale = forward_mm(None, xq, w, recipe, "N", group, x.dtype)
            y = y.view(*total.shape[:-1], w.shape[0])
            outs.append(y if b is None else y + b)
            scales.append(w_scale)
        ctx.w_scales, ctx.x_dtype = scales, x.dtype
        ctx.save_for_backward(keep, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        keep, *weights = ctx.saved_tensors
        recipe, group, sp = ctx.recipe, ctx.group, ctx.sp
        gathered = _gather_seq(keep, group, async_op=True, regather=True) if sp else (lambda: keep)
        used = [(i, g) for i, g in enumerate(grads) if g is not None]
        flat = {i: _flat(g) for i, g in used}
        qdys = {i: None if recipe.rowwise else grad_output_tensorwise(flat[i], recipe, "N", group) for i, _ in used}
        grad_total = None
        if ctx.needs_input_grad[0] and used:
            grad_total = sum(
                grad_input_mm(flat[i], weights[i], ctx.w_scales[i], qdys[i], recipe, "N", group) for i, _ in used
            )
            grad_total = grad_total.view(*grads[used[0][0]].shape[:-1], keep.shape[-1]).to(ctx.x_dtype)
        total = _flat(gathered())
        x_saved = total if recipe.rowwise else (total, ctx.sx)
        grad_x, scatter = grad_total, None
        if grad_total is not None and sp and traceable.tracing():
            grad_x = comm.reduce_scatter_along(grad_total, SEQ_DIM, group)
        elif grad_total is not None and sp:
            n = comm.tp_world_size(group)
            stacked = torch.stack(grad_total.chunk(n, SEQ_DIM), 0).contiguous()
            grad_x = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
            scatter = comm.reduce_scatter(grad_x.view(-1), stacked.view(-1), group=group, async_op=True)
        out = []
        for i, (g, w, has_bias) in enumerate(zip(grads, weights, ctx.has_bias)):
            if g is None:
                out += [None, None]
                continue
            dw = grad_weight_mm(flat[i], x_saved, qdys[i], recipe, "N", group).to(w.dtype)
            out += [dw, flat[i].sum(0) if has_bias else None]
        if scatter is not None:
            scatter.wait()
        return (grad_x, None, None, None, *out)
