"""Column- and row-parallel linear layers (Megatron-LM's split of a matmul over TP ranks).

A transformer MLP or attention block is ``RowParallel(act(ColumnParallel(x)))``:
the column layer splits the output features (each rank computes a slice of the
hidden activations, no communication inside), the row layer splits the input
features (each rank holds a partial sum of the output) and reduces once. One
block therefore costs one all-reduce forward and one backward (or, with
sequence parallelism, an all-gather + a reduce-scatter each way: the same bytes,
plus one all-gather in backward, since the column layer keeps only its sequence
chunk of the input for backward and gathers it again).

Weights follow ``torch.nn.Linear``: ``[out_features, in_features]``, and so does the
initialisation at construction: ``U(-1/√in, 1/√in)`` with ``in`` the global input
features, the full tensor the same for every tp (:func:`~parallel.layers.init.reset_default_`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..comm import traceable
from ..comm.autograd import SEQ_DIM
from ..params import mark_no_weight_decay, mark_sequence_parallel, mark_tp_sharded
from .fp8 import Fp8Recipe
from .fp8_linear import Fp8Columns, Fp8Linear
from .init import reset_default_


class LayerConfigError(ValueError):
    """A layer's sizes do not fit the tensor-parallel layout."""


def divide(numerator: int, tp: int, what: str) -> int:
    """``numerator / tp``, refused with the numbers when it does not divide."""
    if numerator % tp:
        raise LayerConfigError(
            f"{what} = {numerator} is not divisible by tensor-parallel size {tp}; "
            f"choose {what} as a multiple of {tp} or a tp that divides {numerator}"
        )
    return numerator // tp


def _check_last_dim(x: torch.Tensor, expected: int, who: str) -> None:
    if x.shape[-1] != expected:
        raise LayerConfigError(f"{who}: input has last dim {x.shape[-1]} (shape {tuple(x.shape)}), expected {expected}")


class _SequenceParallelColumns(torch.autograd.Function):
    """``[F.linear(gather(x), w_i, b_i) for i]`` for column layers reading one sequence-parallel input.

    ``x`` is this rank's sequence chunk ``[b, s/N, in]``. Forward all-gathers it along the
    sequence and applies every layer to the whole; it saves only ``x`` (1/N of the gathered
    input, Megatron's choice) and the weights. Backward all-gathers ``x`` again, launched
    asynchronously and overlapped with the input-gradient matmuls ``Σ_i dy_i · w_i``; then the
    input gradient's reduce-scatter is launched asynchronously and overlapped with the weight
    gradients ``dy_iᵀ · gather(x)`` (:data:`parallel.overlap.TP_SP_BACKWARD`; every other TP
    collective blocks: ``TP_COLLECTIVES``). Collectives on ``group`` (``X`` = bytes of ``x``): forward
    one all-gather (N·X), backward one all-gather (N·X) and one reduce-scatter (N·X).
    """

    @staticmethod
    def forward(ctx, x, group, *params):
        ctx.group, ctx.has_bias = group, [b is not None for b in params[1::2]]
        total = comm.all_gather_along(x, SEQ_DIM, group)
        weights = params[0::2]
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(total, w, b) for w, b in zip(weights, params[1::2]))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        group, n = ctx.group, comm.tp_world_size(ctx.group)
        traced = traceable.tracing()  # compiled: blocking traceable collectives, the compiler orders them
        if not traced:
            gathered = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
            gather = comm.all_gather(gathered, x.contiguous().view(-1), group=group, async_op=True)
        used = [(g, w) for g, w in zip(grads, weights) if g is not None]
        grad_total = None
        if ctx.needs_input_grad[0] and used:
            grad_total = sum(g.matmul(w) for g, w in used)  # [b, s, in], while the gather runs
        if traced:
            total = comm.all_gather_along(x, SEQ_DIM, group, regather=True)
        else:
            gather.wait()
            total = torch.cat(gathered.view((n,) + tuple(x.shape)).unbind(0), dim=SEQ_DIM)
        grad_x, scatter = None, None
        if grad_total is not None and traced:
            grad_x = comm.reduce_scatter_along(grad_total, SEQ_DIM, group)
        elif grad_total is not None:
            stacked = torch.stack(grad_total.chunk(n, SEQ_DIM), 0).contiguous()
            grad_x = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
            scatter = comm.reduce_scatter(grad_x.view(-1), stacked.view(-1), group=group, async_op=True)
        flat_total = total.reshape(-1, total.shape[-1])
        out = []
        for g, w, has_bias in zip(grads, weights, ctx.has_bias):
            if g is None:
                out += [None, None]
                continue
            flat_g = g.reshape(-1, g.shape[-1])
            out += [flat_g.t().matmul(flat_total).to(w.dtype), flat_g.sum(0) if has_bias else None]
        if scatter is not None:
            scatter.wait()
        return (grad_x, None, *out)


def _linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None, split: str) -> torch.Tensor:
    """``x Wᵀ (+ bias)`` of ``layer``: ``F.linear``, or with ``layer.fp8`` set its fp8 GEMMs (``split``
    the axis the layer shards: ``"N"`` column, ``"K"`` row; :mod:`.fp8_linear`)."""
    if layer.fp8 is None:
        return F.linear(x, layer.weight, bias)
    return Fp8Linear.apply(x, layer.weight, bias, layer.fp8, split, layer.tp_group)


def enable_fp8(modules, recipe: Fp8Recipe | None) -> int:
    """Set every column / row parallel linear inside ``modules`` to cast its GEMMs as ``recipe``
    (None: back to ``F.linear``); returns how many. The parameters, their dtype and the state dict
    are untouched, so a checkpoint moves between fp8 and bf16 runs as it is."""
    count = 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, _TPLinear):
                m.fp8, count = recipe, count + 1
    return count


class _TPLinear(nn.Module):
    """What the column and the row layer share: ``torch.nn.Linear``'s initialisation and a repr."""

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s distributions, layout-independent (module docstring); no-op on ``meta``."""
        bound = 1.0 / self.in_features**0.5 if self.in_features else 0.0
        reset_default_(self.weight, self.tp_group, bound=bound)
        if self.bias is not None:
            reset_default_(self.bias, self.tp_group, bound=bound)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_TPLinear):
    """``y = x Wᵀ + b`` with ``W``'s output rows split over the TP group.

    Rank ``r`` holds rows ``[r·out/N, (r+1)·out/N)`` of ``weight`` (``tp_shard_dim`` 0)
    and the same slice of ``bias``; its output is that slice of ``y``.

    Communication on ``tp_group`` (N ranks, ``X`` = bytes of the input ``x``):

    * plain: forward none; backward all-reduce of the input gradient (X bytes, "f").
    * ``sequence_parallel``: the input is this rank's sequence chunk ``[b, s/N, in]``;
      forward all-gathers it (N·X bytes); backward all-gathers it again (N·X bytes,
      overlapped with the input-gradient matmul) and reduce-scatters the input gradient
      (N·X bytes, overlapped with the weight gradient). Only the chunk is saved for
      backward, not the gathered input (Megatron's sequence parallelism, Korthikanti et
      al. 2022): N times less activation memory for one more all-gather.
    * ``gather_output``: forward also all-gathers the output's last dim (``[.., out]``
      bytes); backward keeps this rank's slice.

    Several column layers reading the same input (q/k/v, SwiGLU's gate/up) share those
    collectives: :meth:`shared_forward`.

    ``fp8`` (an :class:`~.fp8.Fp8Recipe`, None by default; :func:`enable_fp8`): the GEMMs in fp8 with
    the amax all-reduces of :mod:`.fp8_linear` on ``tp_group`` (4 bytes a scale); with sequence
    parallelism and the tensorwise recipe the all-gathers carry fp8 (half the bytes above).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group=None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size = tp_group, tp
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.fp8: Fp8Recipe | None = None
        local_out = divide(out_features, tp, f"{type(self).__name__} out_features")
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_tp_sharded(nn.Parameter(torch.empty(local_out, in_features, **kw)), 0)
        if bias:
            self.bias = mark_tp_sharded(nn.Parameter(torch.empty(local_out, **kw)), 0)
            mark_no_weight_decay(self.bias)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    @staticmethod
    def shared_forward(x: torch.Tensor, *layers: ColumnParallelLinear) -> tuple[torch.Tensor, ...]:
        """Every layer's output slice for one input ``x``, with one input collective for all:
        "f" (copy-to-region), or with sequence parallelism the all-gather forward and the
        all-gather + reduce-scatter backward described above (the layers' settings must agree)."""
        first = layers[0]
        for layer in layers:
            _check_last_dim(x, layer.in_features, type(layer).__name__)
            same = (layer.tp_group, layer.sequence_parallel, layer.fp8)
            if same != (first.tp_group, first.sequence_parallel, first.fp8):
                raise LayerConfigError("shared_forward: the layers must share tp_group, sequence_parallel and fp8")
        params = [t for layer in layers for t in (layer.weight, layer.bias)]
        sp = first.sequence_parallel and first.tp_size > 1
        if first.fp8 is not None and len(layers) > 1 or sp:  # one input collective / fp8 cast for all
            h = x if sp or first.tp_size == 1 else comm.copy_to_tp_region(x, first.tp_group)
            if first.fp8 is not None:
                return Fp8Columns.apply(h, first.fp8, first.tp_group, sp, *params)
            return _SequenceParallelColumns.apply(x, first.tp_group, *params)
        if first.tp_size == 1:  # nothing to copy or gather: one linear each (no per-call group lookups)
            return tuple(_linear(x, layer, layer.bias, "N") for layer in layers)
        h = comm.copy_to_tp_region(x, first.tp_group)
        return tuple(_linear(h, layer, layer.bias, "N") for layer in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # the hot path of one process: one check and the matmul
            _check_last_dim(x, self.in_features, type(self).__name__)
            return _linear(x, self, self.bias, "N")
        (y,) = self.shared_forward(x, self)
        return comm.gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(_TPLinear):
    """``y = x Wᵀ + b`` with ``W``'s input columns split over the TP group.

    Rank ``r`` holds columns ``[r·in/N, (r+1)·in/N)`` of ``weight`` (``tp_shard_dim`` 1);
    ``bias`` is replicated and added once, after the reduction.

    Communication on ``tp_group`` (``Y`` = bytes of the full output ``[.., out]``):

    * plain: forward all-reduce of the partial outputs (Y bytes, "g"); backward none.
    * ``sequence_parallel``: forward reduce-scatters the output along the sequence
      (Y bytes in, ``[b, s/N, out]`` out); backward all-gathers the gradient (Y bytes).
      ``bias`` then sees only this rank's tokens: it is marked ``sequence_parallel``
      and its gradient must be summed over TP (:func:`reduce_sequence_parallel_grads`).
    * ``input_is_parallel=False``: the input is full; forward first keeps this rank's
      slice of the last dim, backward all-gathers the input gradient.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group=None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise LayerConfigError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size = tp_group, tp
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.fp8: Fp8Recipe | None = None  # the GEMM in fp8 (ColumnParallelLinear's docstring)
        self.local_in = divide(in_features, tp, f"{type(self).__name__} in_features")
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_tp_sharded(nn.Parameter(torch.empty(out_features, self.local_in, **kw)), 1)
        if bias:
            self.bias = mark_no_weight_decay(nn.Parameter(torch.empty(out_features, **kw)))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            _check_last_dim(x, self.local_in, type(self).__name__ + " (parallel input)")
        else:
            _check_last_dim(x, self.in_features, type(self).__name__)
            x = comm.scatter_to_tp_region(x, self.tp_group)
        if self.tp_size == 1:  # nothing to reduce: the bias joins the matmul (one addmm, as nn.Linear)
            return _linear(x, self, self.bias, "K")
        partial = _linear(x, self, None, "K")
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = comm.reduce_from_tp_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias
