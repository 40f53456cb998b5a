"""Stage 3: gather a unit's parameters just before they are needed, free them right after.

A *unit* is a submodule (e.g. a transformer block) whose buckets are gathered
together; parameters outside every unit form one more, the *root* unit. Per
training step each unit's buckets are ``all_gather``-ed on the DP group
(payload: the full padded buckets in the compute dtype):

* before its forward (a forward pre-hook), launching the gathers of the next
  :data:`~parallel.overlap.ZERO3_PREFETCH_UNITS` units at the same time (prefetch),
  and freed when its forward returns;
* again when its backward begins — the first gradient with respect to any of
  its outputs (``register_multi_grad_hook``) — prefetching as many previous units;
  freed once its gradients have been reduce-scattered (by the engine).

Under activation recomputation (``torch.utils.checkpoint``) a unit's forward
runs again *during backward*, after its backward hook gathered it. That run is
told apart by the autograd engine having a graph task under way: its pre-hook
only makes sure the unit is whole and prefetches nothing (the backward hook
already launched unit ``u - 1``; prefetching ``u + 1``, whose backward is over,
would gather it again and keep it to the end of backward), and its forward hook
frees nothing. So backward gathers each unit once and holds at most ``1 +
ZERO3_PREFETCH_UNITS``: the one whose backward runs and the prefetched ones.

The root unit is gathered when the wrapped module's forward starts and freed
after the optimizer step (it has no backward hook to gather it again for a later
micro-batch's backward), so it is gathered once per step: stage 3 sends
``(N-1)/N · (Ψ + Ψ_units)`` bytes of parameters per rank and step.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from ..overlap import ZERO3_PREFETCH_UNITS


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (hooks run on it)."""
    return torch._C._current_graph_task_id() != -1


class UnitGatherer:
    def __init__(self, module: nn.Module, units: Sequence[nn.Module], unit_buckets: list[list]):
        self.unit_buckets, self.n_units = unit_buckets, len(units)
        module.register_forward_pre_hook(lambda *_: self.gather(self.n_units, ahead=range(ZERO3_PREFETCH_UNITS)))
        for u, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda *_, u=u: self.before_forward(u))
            unit.register_forward_hook(lambda _m, _in, out, u=u: self.after_forward(u, out))

    def before_forward(self, u: int) -> None:
        """Gather unit ``u``, prefetching ``u + 1 …`` unless this is a recomputation inside backward."""
        self.gather(u, ahead=() if _in_backward() else range(u + 1, u + 1 + ZERO3_PREFETCH_UNITS))

    def gather(self, u: int, ahead) -> None:
        """Make unit ``u`` whole (waiting for its gather) and launch the gathers of the units ``ahead``
        (those that exist), after ``u``'s own."""
        for b in self.unit_buckets[u]:
            b.start_gather()
        for p in ahead:
            if 0 <= p < self.n_units:
                for b in self.unit_buckets[p]:
                    b.start_gather()
        for b in self.unit_buckets[u]:
            b.wait_gather()

    def after_forward(self, u: int, output) -> None:
        """Free unit ``u``; gather it again when its backward begins, prefetching units ``u - 1 …``.

        A recomputation inside backward (if it runs to the end) keeps the unit: its backward
        needs it, and the engine frees it once its gradients are reduced."""
        if _in_backward():
            return
        for b in self.unit_buckets[u]:
            b.free_params()
        outputs = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if outputs:
            ahead = range(u - 1, u - 1 - ZERO3_PREFETCH_UNITS, -1)
            register_multi_grad_hook(outputs, lambda _: self.gather(u, ahead=ahead), mode="any")
