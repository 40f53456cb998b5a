"""The transformer feed-forward block: column-parallel up, activation, row-parallel down."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, LayerConfigError, RowParallelLinear

ACTIVATIONS = ("gelu", "swiglu")


class ParallelMLP(nn.Module):
    """GELU MLP (GPT: ``fc_out(gelu(fc_in(x)))``) or SwiGLU (Llama: ``down(silu(gate(x))·up(x))``).

    The hidden width ``d_ff`` is split over the TP group; ``gelu`` is the tanh
    approximation GPT-2 uses. Input and output are ``[b, s, d]``, or ``[b, s/N, d]``
    with ``sequence_parallel``.

    Communication on ``tp_group`` (``A`` = bytes of the full activation ``[b, s, d]``),
    per forward + backward: plain: one all-reduce of A forward, one of A backward;
    sequence-parallel: forward an all-gather (A) and a reduce-scatter (A), backward
    the same two. SwiGLU's gate and up projections share the input collective.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "gelu",
        bias: bool = True,
        tp_group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise LayerConfigError(f"ParallelMLP: activation {activation!r} not in {ACTIVATIONS}")
        self.activation = activation
        col = dict(tp_group=tp_group, bias=bias, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        if activation == "gelu":
            self.fc_in = ColumnParallelLinear(d_model, d_ff, **col)
            self.fc_out = RowParallelLinear(d_ff, d_model, **col)
        else:
            self.gate_proj = ColumnParallelLinear(d_model, d_ff, **col)
            self.up_proj = ColumnParallelLinear(d_model, d_ff, **col)
            self.down_proj = RowParallelLinear(d_ff, d_model, **col)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))
        gate, up = ColumnParallelLinear.shared_forward(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)
