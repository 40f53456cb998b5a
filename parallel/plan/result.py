"""What the planner returns: a :class:`Plan` of one layout, one :class:`RankClass` per pipeline stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from .memory import StageParams

#: ``count(layers, has_embedding, has_head, tp)`` → the parameters of that chunk on one TP rank
ParamCounter = Callable[[range, bool, bool, int], StageParams]


@dataclass
class RankClass:
    """One pipeline stage's ranks (every DP and TP rank of a stage is alike)."""

    stage: int
    layers: list[tuple[int, int]]  # [start, stop) per chunk
    params: StageParams
    memory: dict[str, float]  # bytes: params, grads, optimizer, activations, buffers, total
    in_flight: int  # (micro-batch, chunk) activations held at the peak
    activation_per_microbatch: float
    forward_s: float  # one micro-batch through all its chunks, TP collectives included
    backward_s: float
    compute_s: float  # the step's matmuls, attention and elementwise work (plan.compute), recomputation included
    traffic: dict[str, dict]  # per axis: group_size, crosses_node, bytes, time_s, items
    fits: bool = True


@dataclass
class Plan:
    model: dict
    layout: dict
    training: dict
    hardware: dict
    grad_accum: int
    ranks: list[RankClass]
    step: dict[str, float] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def peak_memory(self) -> float:
        return max(r.memory["total"] for r in self.ranks)

    def to_dict(self) -> dict:
        """Plain JSON-able data (infinite ratios, e.g. compute/communication with no
        communication, become ``None``)."""
        d = asdict(self)
        d["fits"], d["peak_memory_bytes"] = self.fits, self.peak_memory
        return _finite(d)


def _finite(x):
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and x in (float("inf"), float("-inf")) else x
