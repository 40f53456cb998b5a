"""The planner: per-rank memory, communication and time of any layout (a resolved
:class:`parallel.dims.ParallelDims`, filled in for the model by :func:`resolve`), without starting a
process; the layout search behind ``mode=recommend``. Pure: no process groups, no ``models`` import.
See ``docs/planner.md``.
"""

from .count import count_module
from .hardware import PROFILES, Hardware, PlanError, hardware_profile
from .inputs import Layout, Training, check, resolve
from .memory import StageParams, layer_activation_bytes, model_state_bytes, stage_activation_bytes
from .pipeline import pipeline_time
from .planner import plan_layout
from .report import predicted_vs_measured
from .result import Plan, RankClass
from .search import candidate_layouts, recommend
from .shape import ModelShape, layer_partition, model_flops_per_token

__all__ = [
    "PROFILES",
    "Hardware",
    "Layout",
    "ModelShape",
    "Plan",
    "PlanError",
    "RankClass",
    "StageParams",
    "Training",
    "candidate_layouts",
    "check",
    "count_module",
    "hardware_profile",
    "layer_activation_bytes",
    "layer_partition",
    "model_flops_per_token",
    "model_state_bytes",
    "pipeline_time",
    "plan_layout",
    "predicted_vs_measured",
    "recommend",
    "resolve",
    "stage_activation_bytes",
]
