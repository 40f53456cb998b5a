"""What compute hides of the communication, as :mod:`parallel.overlap`'s table says and the
profile's host lets it (``HostCosts.overlap_fraction``; all of it on a GPU profile)."""

from __future__ import annotations

from ..overlap import DP_REDUCTION, PARAM_GATHER_AFTER_STEP, ZERO3_GATHER, exposed_sharing


def norm_every_step(grad_clip: float, precision: str, offload: str) -> bool:
    """Whether every step computes the gradient norm, read or not: the engine skips it on an unread
    step only without clipping, fp16's loss scaler and offload."""
    return grad_clip > 0 or precision == "fp16" or offload != "none"


def partly_hidden(comm_s: float, exposed_s: float, fraction: float) -> float:
    """Seconds exposed when compute hides only ``fraction`` of what the overlap table hides."""
    return exposed_s + (1.0 - fraction) * max(0.0, comm_s - exposed_s)


def unmeasured(fraction: float, measured_s: float, comm_s: float) -> float:
    """``fraction`` of the hideable seconds compute hides when ``measured_s`` of ``comm_s`` are
    already net of overlap (measured ``ahead_call_us``: none of them hides again)."""
    if comm_s <= 0.0 or measured_s <= 0.0:
        return fraction
    return fraction * max(0.0, 1.0 - measured_s / comm_s)


def exposed_dp_time(
    dp: dict, m: int, fwd: float, bwd: float, overlap: bool, reductions: int = 1, fraction: float = 1.0
) -> float:
    """DP seconds compute cannot hide, as :mod:`parallel.overlap`'s rows say (reductions under the
    backward, ZeRO-3's gathers under forward and backward, the gather after the step exposed); the last of
    ``reductions`` collectives starts when backward ends. Compute hides ``fraction`` of the rest, no measured second."""
    last = 1.0 / max(1, reductions)
    per_mb = max(
        exposed_sharing(
            bwd, (DP_REDUCTION, dp["grad_per_mb"]), (ZERO3_GATHER, dp["param_bwd_per_mb"]), overlap=overlap
        ),
        last * dp["grad_per_mb"],
    ) + ZERO3_GATHER.exposed(dp["param_fwd_per_mb"], fwd, overlap)
    comm = dp["grad_per_mb"] + dp["param_bwd_per_mb"] + dp["param_fwd_per_mb"]
    per_mb = partly_hidden(comm, per_mb, unmeasured(fraction, dp.get("measured_per_mb", 0.0), comm))
    once = max(DP_REDUCTION.exposed(dp["grad_per_step"], bwd, overlap), last * dp["grad_per_step"])
    step_fraction = unmeasured(fraction, dp.get("measured_per_step", 0.0), dp["grad_per_step"])
    once = partly_hidden(dp["grad_per_step"], once, step_fraction)
    return m * per_mb + once + PARAM_GATHER_AFTER_STEP.exposed(dp["param_after_step"], 0.0, overlap)
