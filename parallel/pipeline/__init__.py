"""Pipeline parallelism: partitioning, schedules as data, a simulator, an executor.

* :mod:`.partition` (pure): which layers each (virtual) stage holds, balanced by cost.
* :mod:`.schedules` (pure): GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 as per-stage action lists.
* :mod:`.simulator` (pure): proves a schedule deadlock-free and complete; times it.
* :mod:`.timeline`: draws a simulated or recorded timeline as a PNG Gantt chart.
* :mod:`.executor`: runs one stage's list over the pipeline process group.
* :mod:`.split_backward`: a backward in two halves (zero bubble's B and W).
"""

from .executor import PipelineExecutor
from .partition import PartitionError, partition_layers, stage_chunks, stage_costs
from .schedules import (
    SCHEDULES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_schedule,
    check_schedule_args,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zb_h1_makespan,
)
from .simulator import SimResult, Span, simulate
from .timeline import bubble_fraction, draw_timeline

__all__ = [
    "SCHEDULES",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Forward",
    "PartitionError",
    "PipelineExecutor",
    "RecvActivation",
    "RecvGrad",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "SimResult",
    "Span",
    "bubble_fraction",
    "build_schedule",
    "check_schedule_args",
    "draw_timeline",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "partition_layers",
    "simulate",
    "stage_chunks",
    "stage_costs",
    "zb_h1",
    "zb_h1_makespan",
]
