"""The routed experts of :class:`~parallel.layers.moe.MoELayer`: ``L`` local experts as stacked weights.

Each weight multiplies all the experts' contiguous row segments at once (:mod:`.grouped_mm`: one
grouped kernel, one padded ``bmm`` or a loop over the experts, chosen once per device type). The
grouped way is :meth:`GroupedExperts.grouped`, which takes the segment sizes as a device tensor and
reads nothing on the host: ``train.compile`` compiles it as a region of its own, its row count
symbolic (docs/compile.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..params import mark_expert, mark_no_weight_decay
from .grouped_mm import Segments, expert_matmul_kind, grouped_fits, grouped_matmul
from .init import reset_default_


class GroupedExperts(nn.Module):
    """``num_local`` experts as stacked weights, run over sorted segments (one matmul per weight each).

    SwiGLU: ``gate_proj``, ``up_proj`` ``[L, d, f]`` and ``down_proj`` ``[L, f, d]``; GELU: ``fc_in``
    ``[L, d, f]`` and ``fc_out`` ``[L, f, d]`` (+ ``fc_in_bias`` ``[L, f]``, ``fc_out_bias`` ``[L, d]``).
    Each is rank ``ep_rank``'s slice along dim 0 of the global ``[E, …]`` tensor (marked
    :func:`~parallel.params.mark_expert`), initialised like ``nn.Linear`` (``U(-1/√in, 1/√in)``) with the
    layout-independent tiles of :mod:`parallel.layers.init`, so the experts are the same for every ep.
    """

    def __init__(self, num_local: int, d_model: int, d_ff: int, *, activation: str, bias: bool,
                 ep_rank: int = 0, ep_size: int = 1, device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.activation = activation
        kw = dict(device=device, dtype=dtype)
        up, down = ("fc_in",), "fc_out"
        if activation != "gelu":
            up, down = ("gate_proj", "up_proj"), "down_proj"
        shapes = {n: (num_local, d_model, d_ff) for n in up} | {down: (num_local, d_ff, d_model)}
        if bias:
            shapes |= {"fc_in_bias": (num_local, d_ff), "fc_out_bias": (num_local, d_model)}
        self.fan_in = {n: d_ff if n in (down, "fc_out_bias") else d_model for n in shapes}
        for name, shape in shapes.items():
            param = mark_expert(nn.Parameter(torch.empty(shape, **kw)), ep_rank, ep_size)
            self.register_parameter(name, mark_no_weight_decay(param) if name.endswith("bias") else param)
        self.bias = bias
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters(recurse=False):
            reset_default_(p, bound=1 / math.sqrt(self.fan_in[name]))

    def forward(
        self, x: torch.Tensor, segments: list[int], kind: str | None = None, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``x`` sorted by local expert, ``segments[i]`` rows each (host ints); each weight is one
        grouped matmul over the segments (:mod:`.grouped_mm`; ``kind`` defaults to the device's way).
        ``counts``: the same sizes on ``x``'s device (int64 ``[L]``), if the caller has them. The grouped
        way runs :meth:`grouped` (the region ``train.compile`` compiles); the others stay eager (their
        shapes are the host ints)."""
        kind = kind or expert_matmul_kind(x.device.type)
        first = self.fc_in if self.activation == "gelu" else self.gate_proj
        if kind == "grouped" and x.shape[0] and grouped_fits(x, first):
            if counts is None:
                counts = torch.tensor(segments, dtype=torch.int64).to(x.device, non_blocking=True)
            return self.grouped(x, counts, 0 in segments and torch.is_grad_enabled())
        seg = Segments.of(segments, x, kind)
        if self.activation == "gelu":
            h = seg.mm(x, self.fc_in)
            y = seg.mm(F.gelu(h + seg.per_row(self.fc_in_bias) if self.bias else h, approximate="tanh"), self.fc_out)
            return y + seg.per_row(self.fc_out_bias) if self.bias else y
        return seg.mm(F.silu(seg.mm(x, self.gate_proj)) * seg.mm(x, self.up_proj), self.down_proj)

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, any_empty: bool) -> torch.Tensor:
        """The experts over ``x`` ``[n, d]`` (``n > 0``, sorted by local expert, ``counts`` ``[L]`` int64 rows
        each, on the device) by the grouped kernel; ``any_empty``: whether some count is 0 and gradients are
        wanted (then the empty experts' weight gradients are zeroed, :func:`.grouped_mm.grouped_matmul`). No host read and no shape
        from the counts' values: traceable with ``n`` symbolic, one graph for every row count."""
        offs = counts.cumsum(0).to(torch.int32)
        empty = counts == 0 if any_empty else None
        if self.activation == "gelu":
            h = grouped_matmul(x, self.fc_in, offs, empty)
            if self.bias:
                group = torch.repeat_interleave(
                    torch.arange(counts.shape[0], device=x.device), counts, output_size=x.shape[0]
                )
                h = h + self.fc_in_bias.index_select(0, group)
            y = grouped_matmul(F.gelu(h, approximate="tanh"), self.fc_out, offs, empty)
            return y + self.fc_out_bias.index_select(0, group) if self.bias else y
        gate, up = grouped_matmul(x, self.gate_proj, offs, empty), grouped_matmul(x, self.up_proj, offs, empty)
        return grouped_matmul(F.silu(gate) * up, self.down_proj, offs, empty)
