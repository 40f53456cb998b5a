"""Draw a pipeline timeline: one row per stage, one box per action.

A timeline is ``list[list[Span]]`` (one list per stage), as returned by
:func:`.simulator.simulate` (``SimResult.timeline``) or recorded by
:class:`.executor.PipelineExecutor` (``record_timeline=True``; gather each
stage's ``executor.timeline``). Forwards are blue, backwards green (darker
for later chunks; a zero-bubble W is orange), transfer batches thin grey bars; white space is the
bubble. Each box is labelled with its micro-batch::

    result = simulate(one_f_one_b(4, 8))
    draw_timeline(result.timeline, "1f1b.png", title="1F1B, pp=4, m=8")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .schedules import BackwardWeight, Compute, Forward
from .simulator import Span

FORWARD_COLORS = ("#4C72B0", "#2A4A7F", "#8FAADC", "#1B2F52")
BACKWARD_COLORS = ("#55A868", "#2F6B3D", "#9CD3A8", "#1D4426")
WEIGHT_COLORS = ("#DD8452", "#A0522D", "#F2B38B", "#6B3315")  # zero-bubble W (weight gradients)
TRANSFER_COLOR = "#B0B0B0"


@dataclass(frozen=True)
class Bar:
    stage: int
    start: float
    width: float
    color: str
    label: str
    compute: bool


def bars(timeline: Sequence[Sequence[Span]]) -> list[Bar]:
    """What :func:`draw_timeline` draws, as data (computations and transfer batches)."""
    out = []
    for stage, spans in enumerate(timeline):
        for sp in spans:
            a = sp.action
            if isinstance(a, Compute):
                palette = (
                    FORWARD_COLORS
                    if isinstance(a, Forward)
                    else WEIGHT_COLORS
                    if isinstance(a, BackwardWeight)
                    else BACKWARD_COLORS
                )
                out.append(Bar(stage, sp.start, sp.end - sp.start, palette[a.chunk % len(palette)], str(a.mb), True))
            else:
                out.append(Bar(stage, sp.start, sp.end - sp.start, TRANSFER_COLOR, "", False))
    return out


def bubble_fraction(timeline: Sequence[Sequence[Span]]) -> float:
    """1 − (time spent computing) / (stages × span from first start to last end)."""
    spans = [sp for stage in timeline for sp in stage]
    if not spans:
        return 0.0
    makespan = max(sp.end for sp in spans) - min(sp.start for sp in spans)
    busy = sum(sp.end - sp.start for sp in spans if isinstance(sp.action, Compute))
    return 1.0 - busy / (len(timeline) * makespan) if makespan > 0 else 0.0


def draw_timeline(
    timeline: Sequence[Sequence[Span]],
    path: str | Path,
    *,
    title: str | None = None,
    time_unit: str = "s",
    width_in: float = 12.0,
    dpi: int = 100,
) -> Path:
    """Write a PNG Gantt chart of ``timeline`` to ``path`` (matplotlib, Agg backend); return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp = len(timeline)
    fig, ax = plt.subplots(figsize=(width_in, 0.6 * pp + 1.2), dpi=dpi)
    for b in bars(timeline):
        y, h = (b.stage - 0.4, 0.8) if b.compute else (b.stage + 0.3, 0.15)
        ax.broken_barh([(b.start, b.width)], (y, h), facecolors=b.color, edgecolors="white", linewidth=0.5)
        if b.label:
            ax.text(b.start + b.width / 2, b.stage, b.label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(pp), [f"stage {s}" for s in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title((title + " — " if title else "") + f"bubble {bubble_fraction(timeline):.1%}", loc="left")
    ax.legend(
        handles=[
            Patch(color=FORWARD_COLORS[0], label="forward"),
            Patch(color=BACKWARD_COLORS[0], label="backward"),
            Patch(color=WEIGHT_COLORS[0], label="weight grad (zero bubble)"),
            Patch(color=TRANSFER_COLOR, label="transfer"),
        ],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncols=4,
        frameon=False,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
