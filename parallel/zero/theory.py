"""What ZeRO should cost, from first principles: bytes held and bytes sent per rank.

Pure functions of the parameter count Ψ (pass the *padded* count, the sum of
the buckets' ``padded_numel``, to compare with a run exactly), the DP size N
and the byte sizes. The ZeRO paper's notation: ``param_bytes`` b (4 fp32, 2
bf16/fp16), ``K`` the optimizer's bytes per parameter: 4 per fp32 state
tensor (Adam: m and v, 8) plus 4 for an fp32 master copy when the parameters
are held in 16 bits; and ``g`` the gradient buffer's bytes per parameter.

=======  ============================================
stage    model-state bytes per rank
=======  ============================================
0        b·Ψ + g·Ψ + K·Ψ
1        b·Ψ + g·Ψ + K·Ψ/N
2        b·Ψ + g·Ψ/N + K·Ψ/N
3        (b·Ψ + g·Ψ + K·Ψ)/N
=======  ============================================

**Gradients accumulate in fp32 at every precision** (``g = GRAD_BYTES = 4``,
Megatron's "main_grad"): a 16-bit gradient is added into an fp32 buffer as soon
as autograd produces it, so accumulating many micro-batches does not round each
partial sum to 8 (bf16) or 11 (fp16) bits of mantissa. The ZeRO paper counts
``g = b`` (2 + 2 + 12 = 16 bytes per parameter for mixed-precision Adam at
stage 0); ours is 2 + 4 + 12 = 18, as Megatron's (its distributed optimizer:
6 + 12/N). At stages 2–3 the extra is 2·Ψ/N.

**The wire dtype** of the gradient collectives is ``comm_dtype``; by default
(``DEFAULT_COMM_DTYPE``) fp32, the accumulation dtype, as Megatron reduces bf16
gradients in fp32 unless asked otherwise. ``comm_dtype="bf16"`` halves the
gradient traffic at the price of one bf16 rounding of each reduced sum (the
accumulated gradient is cast for the collective and the result cast back into
the fp32 buffer).
"""

from __future__ import annotations

from ..comm.counter import SENT_FRACTION
from ..overlap import REDUCTIONS_IN_FLIGHT  # noqa: F401 - re-exported
from ..precision import DTYPE_BYTES
from .offload import host_state_bytes
from .policy import policy

GRAD_BYTES = 4  # the fp32 main gradient, at every precision
# REDUCTIONS_IN_FLIGHT (re-exported): its home is parallel.overlap, the table of what overlaps
DEFAULT_COMM_DTYPE = "fp32"  # gradients travel in the dtype they accumulate in unless comm_dtype says otherwise


def grad_comm_dtype(comm_dtype: str | None) -> str:
    """The name of the dtype gradient collectives use: ``comm_dtype``, or :data:`DEFAULT_COMM_DTYPE`."""
    return comm_dtype or DEFAULT_COMM_DTYPE


def optimizer_bytes_per_param(param_bytes: int, state_tensors: int = 2) -> int:
    """K: fp32 optimizer state (``state_tensors`` × 4) + a 4-byte fp32 master if params are 16-bit."""
    return 4 * state_tensors + (4 if param_bytes != 4 else 0)


def model_state_bytes(
    psi: int,
    stage: int,
    dp: int,
    param_bytes: int = 4,
    state_tensors: int = 2,
    grad_bytes: int = GRAD_BYTES,
    offload: str = "none",
) -> dict:
    """Bytes of parameters, gradients and optimizer state one rank holds between steps
    (``grad_bytes``: the engine's fp32 main gradient; pass ``param_bytes`` for the ZeRO paper's count).

    ``total`` is on the device; ``host`` (a key only under offload) what ``offload`` keeps in host memory instead
    (:func:`parallel.zero.offload.host_state_bytes`): the optimizer's share leaves the
    device, and with ``"optimizer+params"`` stage 3's persistent parameter shard too."""
    k = optimizer_bytes_per_param(param_bytes, state_tensors)
    pol = policy(stage)
    params = param_bytes * psi / (dp if pol.shards_params else 1)
    grads = grad_bytes * psi / (dp if pol.shards_grads else 1)
    optim = k * psi / (dp if pol.shards_optimizer else 1)
    host = host_state_bytes(psi, param_bytes, offload, 4 * state_tensors) / (dp if pol.shards_optimizer else 1)
    if offload != "none":
        optim = 0
    if offload == "optimizer+params":
        params = 0
    out = {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
    return {**out, "host": host} if offload != "none" else out


def step_sent_bytes(
    psi: int,
    stage: int,
    dp: int,
    param_bytes: int = 4,
    comm_bytes: int | None = None,
    regathered_psi: int | None = None,
) -> float:
    """Bytes one rank sends on the DP group per step for gradients and parameters (ring algorithms).

    stage 0: all-reduce ``2(N-1)/N·Ψ·c``; stages 1–2: reduce-scatter ``(N-1)/N·Ψ·c`` + all-gather
    ``(N-1)/N·Ψ·b``; stage 3: reduce-scatter + all-gather for forward + all-gather again for
    backward of ``regathered_psi`` (the parameters inside units; default all Ψ): ≈ 1.5 × stage 0.
    ``comm_bytes`` c: the gradients' wire dtype, default :data:`DEFAULT_COMM_DTYPE`'s.
    Excludes the 4-byte norm all-reduce.
    """
    c = DTYPE_BYTES[DEFAULT_COMM_DTYPE] if comm_bytes is None else comm_bytes
    pol = policy(stage)
    sent = SENT_FRACTION[pol.reduce](dp) * psi * c
    if pol.gathers_after_step or pol.gathers_per_unit:
        sent += SENT_FRACTION["all_gather"](dp) * psi * param_bytes
    if pol.gathers_per_unit:  # gathered again for backward
        f = SENT_FRACTION["all_gather"](dp)
        sent += f * (psi if regathered_psi is None else regathered_psi) * param_bytes
    return sent


#: how ZeRO-2/3 accumulate gradients over the micro-batches of a step (``parallel.zero_accumulate``):
#: ``sharded`` reduce-scatters every micro-batch into the fp32 shard (Ψ·g/N held); ``unsharded`` keeps
#: the full fp32 gradient until the step's last micro-batch and reduce-scatters once (FSDP2's
#: accumulation: m× fewer gradient bytes on the wire for g·Ψ more bytes held while accumulating).
#: Stages 0-1 reduce once per step anyway (their gradients are never sharded): there it means nothing.
ZERO_ACCUMULATE = ("sharded", "unsharded")


def accumulate_applies(stage: int) -> bool:
    """Whether ``accumulate`` changes what ``stage`` does: only where the policy reduces every
    micro-batch (stages 2-3); stages 0-1 keep full gradients and reduce once per step anyway."""
    return policy(stage).reduce_every_microbatch


def _check_accumulate(accumulate: str) -> None:
    if accumulate not in ZERO_ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ZERO_ACCUMULATE}, got {accumulate!r}")


def grad_reductions_per_step(stage: int, microbatches: int, accumulate: str = "sharded") -> int:
    """How many times a step reduces each gradient over DP: once at stages 0–1 and at stages
    2–3 with ``accumulate="unsharded"``; every micro-batch at stages 2–3 with ``"sharded"``."""
    _check_accumulate(accumulate)
    once = not accumulate_applies(stage) or accumulate == "unsharded"
    return 1 if once else microbatches


def accumulation_grad_bytes(psi: int, stage: int, accumulate: str = "sharded", grad_bytes: int = GRAD_BYTES) -> int:
    """Bytes of full (unsharded) gradient a rank holds while accumulating, beyond
    :func:`model_state_bytes`: ``grad_bytes·Ψ`` at stages 2–3 with ``accumulate="unsharded"``
    (allocated at the first backward, freed by the step's reduce-scatter), else 0."""
    _check_accumulate(accumulate)
    return grad_bytes * psi if accumulate_applies(stage) and accumulate == "unsharded" else 0
