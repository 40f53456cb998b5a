"""Stage 3: gather a unit's parameters just before they are needed, free them right after.

A *unit* is a submodule (e.g. a transformer block) whose buckets are gathered
together; parameters outside every unit form one more, the *root* unit. Per
training step each unit's buckets are ``all_gather``-ed on the DP group
(payload: the full padded buckets in the compute dtype):

* before its forward (a forward pre-hook), launching the next unit's gather at
  the same time (prefetch), and freed when its forward returns;
* again when its backward begins — the first gradient with respect to any of
  its outputs (``register_multi_grad_hook``) — prefetching the previous unit;
  freed once its gradients have been reduce-scattered (by the engine).

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


class UnitGatherer:
    def __init__(self, module: nn.Module, units: Sequence[nn.Module], unit_buckets: list[list]):
        self.unit_buckets, self.n_units = unit_buckets, len(units)
        module.register_forward_pre_hook(lambda *_: self.gather(self.n_units, prefetch=0))
        for u, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda *_, u=u: self.gather(u, prefetch=u + 1))
            unit.register_forward_hook(lambda _m, _in, out, u=u: self.after_forward(u, out))

    def gather(self, u: int, prefetch: int) -> None:
        """Make unit ``u`` whole (waiting for its gather) and launch the gather of ``prefetch``."""
        for b in self.unit_buckets[u]:
            b.start_gather()
        if 0 <= prefetch < self.n_units:
            for b in self.unit_buckets[prefetch]:
                b.start_gather()
        for b in self.unit_buckets[u]:
            b.wait_gather()

    def after_forward(self, u: int, output) -> None:
        """Free unit ``u``; gather it again when its backward begins, prefetching unit ``u - 1``."""
        for b in self.unit_buckets[u]:
            b.free_params()
        outputs = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if outputs:
            register_multi_grad_hook(outputs, lambda _: self.gather(u, prefetch=u - 1), mode="any")
