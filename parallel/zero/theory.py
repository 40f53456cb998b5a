"""What ZeRO should cost, from first principles: bytes held and bytes sent per rank.

Pure functions of the parameter count Ψ (pass the *padded* count, the sum of
the buckets' ``padded_numel``, to compare with a run exactly), the DP size N
and the byte sizes. The ZeRO paper's notation: ``param_bytes`` b (4 fp32, 2
bf16/fp16), ``K`` the optimizer's bytes per parameter: 4 per fp32 state
tensor (Adam: m and v, 8) plus 4 for an fp32 master copy when the parameters
are held in 16 bits.

=======  ============================================
stage    model-state bytes per rank
=======  ============================================
0        b·Ψ + b·Ψ + K·Ψ
1        b·Ψ + b·Ψ + K·Ψ/N
2        b·Ψ + b·Ψ/N + K·Ψ/N
3        (b·Ψ + b·Ψ + K·Ψ)/N
=======  ============================================

With bf16 and Adam at stage 0: 2 + 2 + 12 = 16 bytes per parameter.
"""

from __future__ import annotations


def optimizer_bytes_per_param(param_bytes: int, state_tensors: int = 2) -> int:
    """K: fp32 optimizer state (``state_tensors`` × 4) + a 4-byte fp32 master if params are 16-bit."""
    return 4 * state_tensors + (4 if param_bytes != 4 else 0)


def model_state_bytes(psi: int, stage: int, dp: int, param_bytes: int = 4, state_tensors: int = 2) -> dict:
    """Bytes of parameters, gradients and optimizer state one rank holds between steps."""
    k = optimizer_bytes_per_param(param_bytes, state_tensors)
    params = param_bytes * psi / (dp if stage >= 3 else 1)
    grads = param_bytes * psi / (dp if stage >= 2 else 1)
    optim = k * psi / (dp if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def step_sent_bytes(psi: int, stage: int, dp: int, param_bytes: int = 4, comm_bytes: int | None = None,
                    regathered_psi: int | None = None) -> float:
    """Bytes one rank sends on the DP group per step for gradients and parameters (ring algorithms).

    stage 0: all-reduce ``2(N-1)/N·Ψ·c``; stages 1–2: reduce-scatter ``(N-1)/N·Ψ·c`` + all-gather
    ``(N-1)/N·Ψ·b``; stage 3: reduce-scatter + all-gather for forward + all-gather again for
    backward of ``regathered_psi`` (the parameters inside units; default all Ψ): ≈ 1.5 × stage 0.
    Excludes the 4-byte norm all-reduce.
    """
    c = param_bytes if comm_bytes is None else comm_bytes
    f = (dp - 1) / dp
    if stage == 0:
        return 2 * f * psi * c
    sent = f * psi * c + f * psi * param_bytes
    if stage == 3:
        sent += f * (psi if regathered_psi is None else regathered_psi) * param_bytes
    return sent
