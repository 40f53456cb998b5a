"""fp16 dynamic loss scaling: pure bookkeeping, no tensors, no processes.

The loss is multiplied by ``scale`` before backward so that small fp16
gradients do not flush to zero; the optimizer sees gradients divided by it
again. When a step finds an inf/NaN gradient (on any rank: the caller decides
that collectively) the step is skipped and the scale backs off, after
``hysteresis`` such steps in a row; after ``growth_interval`` clean steps in a
row it grows. This is the scheme of Megatron-LM's ``DynamicGradScaler`` and
DeepSpeed's ``DynamicLossScaler``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .layout import ZeroConfigError


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    # running state
    clean_steps: int = 0
    hysteresis_left: int = -1  # set from hysteresis on construction

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.min_scale <= 0 or self.scale < self.min_scale:
            raise ZeroConfigError(
                f"loss scale {self.scale} and min_scale {self.min_scale} must be positive with scale ≥ min_scale"
            )
        if not (0 < self.backoff_factor < 1 < self.growth_factor):
            raise ZeroConfigError(
                f"need 0 < backoff_factor ({self.backoff_factor}) < 1 < growth_factor ({self.growth_factor})"
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ZeroConfigError(
                f"growth_interval ({self.growth_interval}) and hysteresis ({self.hysteresis}) must be ≥ 1"
            )
        if self.hysteresis_left < 0:
            self.hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome (the same on every rank) and adjust the scale."""
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
