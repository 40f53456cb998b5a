"""Predicted against measured: what the trainer's first-step memory report prints."""

from __future__ import annotations

#: default tolerances (relative): model states are exact, activations within 15 %
TOLERANCE = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "model_states": 0.0, "activations": 0.15, "total": 0.15}


def predicted_vs_measured(
    plan, stage: int, measured: dict[str, float], *, tolerance: dict[str, float] | None = None
) -> dict[str, dict]:
    """Compare pipeline stage ``stage``'s predicted bytes with ``measured`` ones (any of ``params grads
    optimizer model_states activations total``): ``{key: {"predicted", "measured", "error", "ok"}}``,
    ``error`` relative to the measurement, ``ok`` within ``tolerance`` (default :data:`TOLERANCE`)."""
    if not 0 <= stage < len(plan.ranks):
        raise ValueError(f"stage {stage} out of range: the plan has {len(plan.ranks)} pipeline stages")
    tol = {**TOLERANCE, **(tolerance or {})}
    predicted = plan.ranks[stage].memory
    out = {}
    for key, value in measured.items():
        if key not in predicted:
            raise ValueError(f"cannot compare {key!r}: the plan predicts {sorted(predicted)}")
        p = float(predicted[key])
        err = (p - value) / value if value else (0.0 if p == 0 else float("inf"))
        out[key] = {
            "predicted": p,
            "measured": float(value),
            "error": err,
            "ok": abs(err) <= tol.get(key, 0.15) + 1e-12,
        }
    return out


def format_comparison(result: dict[str, dict]) -> str:
    """One line per quantity: ``activations  predicted 1.23 MB  measured 1.20 MB  (+2.5 %)``."""
    lines = []
    for key, r in result.items():
        mark = "" if r["ok"] else "  <-- outside tolerance"
        lines.append(
            f"{key:<13} predicted {r['predicted'] / 1e6:12,.3f} MB  measured {r['measured'] / 1e6:12,.3f} MB"
            f"  ({100 * r['error']:+.1f} %){mark}"
        )
    return "\n".join(lines)
