"""Column- and row-parallel linear layers (Megatron-LM's split of a matmul over TP ranks).

A transformer MLP or attention block is ``RowParallel(act(ColumnParallel(x)))``:
the column layer splits the output features (each rank computes a slice of the
hidden activations, no communication inside), the row layer splits the input
features (each rank holds a partial sum of the output) and reduces once. One
block therefore costs one all-reduce forward and one backward (or, with
sequence parallelism, an all-gather + a reduce-scatter each way: the same bytes).

Weights follow ``torch.nn.Linear``: ``[out_features, in_features]``, and so does the
initialisation at construction: ``U(-1/√in, 1/√in)`` with ``in`` the global input
features, the full tensor the same for every tp (:func:`~parallel.layers.init.reset_default_`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..params import mark_no_weight_decay, mark_sequence_parallel, mark_tp_sharded
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
        raise LayerConfigError(
            f"{who}: input has last dim {x.shape[-1]} (shape {tuple(x.shape)}), expected {expected}"
        )


def _reset_linear(weight: nn.Parameter, bias: nn.Parameter | None, in_features: int, tp_group) -> None:
    bound = 1.0 / in_features**0.5 if in_features else 0.0
    reset_default_(weight, tp_group, bound=bound)
    if bias is not None:
        reset_default_(bias, tp_group, bound=bound)


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W``'s output rows split over the TP group.

    Rank ``r`` holds rows ``[r·out/N, (r+1)·out/N)`` of ``weight`` (``tp_shard_dim`` 0)
    and the same slice of ``bias``; its output is that slice of ``y``.

    Communication on ``tp_group`` (N ranks, ``X`` = bytes of the input ``x``):

    * plain: forward none; backward all-reduce of the input gradient (X bytes, "f").
    * ``sequence_parallel``: the input is this rank's sequence chunk ``[b, s/N, in]``;
      forward all-gathers it (N·X bytes), backward reduce-scatters the input gradient
      (N·X bytes).
    * ``gather_output``: forward also all-gathers the output's last dim (``[.., out]``
      bytes); backward keeps this rank's slice.

    Several column layers reading the same input (q/k/v, SwiGLU's gate/up) share one
    collective: call :meth:`enter` once, then :meth:`local_forward` on each.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group=None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size = tp_group, tp
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        local_out = divide(out_features, tp, f"{type(self).__name__} out_features")
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_tp_sharded(nn.Parameter(torch.empty(local_out, in_features, **kw)), 0)
        if bias:
            self.bias = mark_tp_sharded(nn.Parameter(torch.empty(local_out, **kw)), 0)
            mark_no_weight_decay(self.bias)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s distributions, layout-independent (module docstring); no-op on ``meta``."""
        _reset_linear(self.weight, self.bias, self.in_features, self.tp_group)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input collective: copy-to-region ("f"), or the sequence all-gather."""
        _check_last_dim(x, self.in_features, type(self).__name__)
        if self.sequence_parallel:
            return comm.gather_from_sequence_parallel_region(x, self.tp_group)
        return comm.copy_to_tp_region(x, self.tp_group)

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output slice for an input already through :meth:`enter`."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_forward(self.enter(x))
        return comm.gather_from_tp_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
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

    def __init__(self, in_features: int, out_features: int, *, tp_group=None, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        tp = comm.tp_world_size(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise LayerConfigError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size = tp_group, tp
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
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

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s distributions, layout-independent (module docstring); no-op on ``meta``."""
        _reset_linear(self.weight, self.bias, self.in_features, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            _check_last_dim(x, self.local_in, type(self).__name__ + " (parallel input)")
        else:
            _check_last_dim(x, self.in_features, type(self).__name__)
            x = comm.scatter_to_tp_region(x, self.tp_group)
        if self.tp_size == 1:  # nothing to reduce: the bias joins the matmul (one addmm, as nn.Linear)
            return F.linear(x, self.weight, self.bias)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = comm.reduce_from_tp_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")
