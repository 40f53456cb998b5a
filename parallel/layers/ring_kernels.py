"""The kernel one ring-attention block runs, forward and backward, on every device.

:mod:`.ring_attention` computes each (query rows × key block) pair of its ring with a kernel that
returns the block's fp32 log-sum-exp ``[b, h, sq]`` (so that the blocks merge exactly) and whose
backward takes the *merged* output and log-sum-exp of all blocks (so that ``exp(S − lse)`` is this
block's share of the whole row's softmax and ``rowsum(dO·O)`` the whole row's). Torch's fused SDPA
kernels have that contract; each kind here is one of them or the fallback:

* ``cpu_flash`` — torch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward): every floating dtype, any head dim; it takes one head dim for q, k and v, so a v of another
  width (multi-head latent attention) runs zero-padded to the wider (:func:`_one_width`; exact: the
  scale is explicit, zero columns add nothing to ``q·kᵀ`` and give zero output columns, which are cut);
* ``flash`` — torch's CUDA flash kernel (``_scaled_dot_product_flash_attention``): fp16/bf16, head
  dim a multiple of 8 up to :data:`FLASH_MAX_HEAD_DIM`, v as wide as q and k;
* ``efficient`` — torch's CUDA memory-efficient kernel (``_scaled_dot_product_efficient_attention``):
  fp32 too, head dims (q/k's and v's, which may differ) a multiple of 4 (fp32) or 8; its log-sum-exp comes padded to a multiple of
  :data:`EFFICIENT_LSE_ALIGN` rows (cut here, padded back for its backward);
* ``math`` — exact fp32 math in query-row tiles (``O(rows·sk)`` memory, :data:`MATH_SCORE_ELEMENTS`):
  what the others refuse (other devices, the dry run's ``meta`` tensors, odd head dims on a GPU).

:func:`block_kernel` is the rule, pure (device type, dtype, head dims, mask), tested on the CPU;
:func:`choose` applies it to a block's tensors and, on a GPU, asks torch whether this device and its
SDPA backend switches take the fused kernel (``torch.backends.cuda.can_use_flash_attention`` /
``can_use_efficient_attention``: architecture, head-dim limits per architecture), stepping down
flash → efficient → math. :func:`attend` / :func:`attend_backward` are the one dispatch all go through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten

KERNELS = ("cpu_flash", "flash", "efficient", "math")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
EFFICIENT_LSE_ALIGN = 32  # the memory-efficient kernel's log-sum-exp rows (CUDA; ROCm returns them unpadded)
MATH_SCORE_ELEMENTS = 1 << 24  # the math kernel's fp32 score tiles hold at most this many elements (64 MiB)


def block_kernel(
    device_type: str, dtype: torch.dtype, head_dim: int, causal: bool, square: bool = True, v_head_dim=None
) -> str:
    """The kernel (one of :data:`KERNELS`) a block of ``dtype`` with ``head_dim`` runs on ``device_type``.

    ``causal``: the block is masked (the ring's own block); ``square``: as many keys as queries;
    ``v_head_dim``: v's width when it is not q's and k's (CUDA's flash kernel then steps aside). A
    causal mask over a non-square block goes to ``math``: the fused kernels disagree on where such a
    mask sits (top-left or bottom-right), and the ring never asks for one.

    >>> block_kernel("cuda", torch.bfloat16, 128, True), block_kernel("cuda", torch.float32, 64, False)
    ('flash', 'efficient')
    >>> block_kernel("cuda", torch.bfloat16, 192, True, v_head_dim=128)  # DeepSeek-V3's MLA
    'efficient'
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if causal and not square:
        return "math"
    if device_type == "cpu":
        return "cpu_flash" if dtype in CPU_FLASH_DTYPES else "math"
    if device_type == "cuda":
        if dtype in FLASH_DTYPES and head_dim == v_head_dim and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM:
            return "flash"
        align = 4 if dtype == torch.float32 else 8
        if dtype in EFFICIENT_DTYPES and head_dim % align == 0 and v_head_dim % align == 0:
            return "efficient"
    return "math"


def _sdpa_params(q, k, v, causal: bool):
    try:
        return torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, False)
    except TypeError:  # torch < 2.5: no enable_gqa argument
        return torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal)


def _device_takes(kind: str, q, k, v, causal: bool) -> bool:
    """Whether torch runs fused ``kind`` on these tensors here (switched on, and this GPU takes them)."""
    cuda = torch.backends.cuda
    if kind == "flash":
        return cuda.flash_sdp_enabled() and cuda.can_use_flash_attention(_sdpa_params(q, k, v, causal), False)
    return cuda.mem_efficient_sdp_enabled() and cuda.can_use_efficient_attention(_sdpa_params(q, k, v, causal), False)


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """The kernel this block runs: :func:`block_kernel`'s, stepped down to what this device takes."""
    kind = block_kernel(q.device.type, q.dtype, q.shape[-1], causal, q.shape[2] == k.shape[2], v.shape[-1])
    if kind == "flash" and not _device_takes("flash", q, k, v, causal):
        kind = "efficient"  # flash's dtypes and head dims are a subset of the memory-efficient kernel's
    if kind == "efficient" and not _device_takes("efficient", q, k, v, causal):
        kind = "math"
    return kind


def _efficient_lse_rows(sq: int) -> int:
    if torch.version.hip:
        return sq
    return -(-sq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN


def _no_dropout_rng(device, dtype, seed_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The philox seed and offset a dropout-free fused backward is handed, shaped as its forward returns
    them (read only under dropout)."""
    return torch.empty(seed_shape, dtype=dtype, device=device), torch.empty((), dtype=dtype, device=device)


def _one_width(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` zero-padded on the last dim to the widest of them (for kernels that take one head dim)."""
    width = max(t.shape[-1] for t in tensors)
    return [t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in tensors]


def attend(kind: str, q, k, v, causal: bool, scale: float, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block with kernel ``kind``: ``(out in q's dtype or fp32, fp32 log-sum-exp [b, h, sq])``.
    ``mask`` (boolean ``[b, 1, sq, sk]``, True: may attend; packed documents) takes ``math`` only; a
    row it masks whole gets output 0 and log-sum-exp ``-inf`` (it adds nothing to the merge)."""
    if kind == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(*_one_width(q, k, v), 0.0, causal, scale=scale)
        return out[..., : v.shape[-1]], lse
    if kind == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    if kind == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[:, :, : q.shape[2]]
    tiles = _row_tiles(q, k.shape[2])
    outs, lses = [], []
    for start, stop in zip(tiles, tiles[1:]):
        p, lse = _tile_probs(q, k, None, start, stop, causal, scale, mask)
        outs.append(torch.matmul(p, v.float()).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def attend_backward(kind: str, do, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """A block's ``dq, dk, dv`` with kernel ``kind``, given the *merged* ``out`` and ``lse`` of all blocks
    (``mask``: :func:`attend`'s, ``math`` only)."""
    if kind == "cpu_flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_one_width(do, q, k, v, out), lse, 0.0, causal, scale=scale
        )
        return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]
    if kind == "flash":
        seed, offset = _no_dropout_rng(q.device, torch.uint64, (2,))
        return aten._scaled_dot_product_flash_attention_backward(
            do,
            q,
            k,
            v,
            out,
            lse.contiguous(),
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
    if kind == "efficient":
        pad = _efficient_lse_rows(q.shape[2]) - q.shape[2]  # the shape its forward returned
        lse = F.pad(lse, (0, pad)) if pad else lse.contiguous()
        seed, offset = _no_dropout_rng(q.device, torch.int64, ())
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv
    return _math_backward(do, q, k, v, out, lse, causal, scale, mask)


# ---------------------------------------------------------------- the math kernel


def _row_tiles(q: torch.Tensor, sk: int) -> list[int]:
    """Query-row tile starts so that one ``[b, h, rows, sk]`` fp32 score tile stays under
    :data:`MATH_SCORE_ELEMENTS` (the math kernel's memory is ``O(rows·sk)``, not ``O(s²)``)."""
    b, h, sq, _ = q.shape
    rows = max(1, MATH_SCORE_ELEMENTS // max(1, b * h * sk))
    return list(range(0, sq, rows)) + [sq]


def _tile_probs(q, k, lse, start, stop, causal, scale, mask=None):
    """``exp(S − lse)`` and the log-sum-exp of query rows ``[start, stop)`` (fp32; causal: key j ≤ row i;
    ``mask``: where True only); a row with no key left has probabilities 0 and log-sum-exp ``-inf``."""
    s = torch.matmul(q[:, :, start:stop].float(), k.float().transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(start, stop, device=s.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[2], device=s.device)[None, :] > rows, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, :, start:stop], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    finite = lse.masked_fill(torch.isinf(lse), 0.0) if mask is not None else lse
    return torch.exp(s - finite.unsqueeze(-1)), lse


def _math_backward(do, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    kf, vf = k.float(), v.float()
    dq, dk, dv = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.zeros_like(kf), torch.zeros_like(vf)
    tiles = _row_tiles(q, k.shape[2])
    for start, stop in zip(tiles, tiles[1:]):
        p, _ = _tile_probs(q, k, lse[:, :, start:stop], start, stop, causal, scale, mask)
        dof = do[:, :, start:stop].float()
        dv += torch.matmul(p.transpose(-1, -2), dof)
        delta = (dof * out[:, :, start:stop].float()).sum(-1, keepdim=True)
        ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - delta) * scale
        dq[:, :, start:stop] = torch.matmul(ds, kf)
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, start:stop].float())
    return dq, dk, dv
