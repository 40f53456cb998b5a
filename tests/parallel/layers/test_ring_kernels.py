"""Ring attention's block kernels (:mod:`parallel.layers.ring_kernels`, issue 34 item 4).

* The rule (device type, dtype, head dim, mask) → kernel, pure, and its step-down when a device refuses.
* The CUDA kernels' calls checked on ``meta`` tensors (torch's meta kernels carry the CUDA ops'
  signatures and output shapes): arguments, the memory-efficient kernel's padded log-sum-exp.
* The ring's blocks on one device: every virtual cp rank's blocks (``ring_block``), merged by
  log-sum-exp, and their backward from the merged output and log-sum-exp, against full-sequence
  attention in fp64 — on the CPU here (torch's CPU flash kernel, and the math fallback); marked
  ``cuda`` for ``benchmarks/gpu_check.sh``, which runs it on the GPU (flash, memory-efficient, math),
  with each kernel's time per block beside the math kernel's (``$GPU_CHECK_OUT/ring_kernels.json``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from parallel.layers import ring_kernels as rk
from parallel.layers.ring_attention import _expand_kv, _fold_kv, _merge, _rows, cp_slice, ring_block
from parallel.testing import run_ranks

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.mark.parametrize(
    "device, dtype, head_dim, causal, square, kernel",
    [
        ("cpu", FP32, 64, True, True, "cpu_flash"),
        ("cpu", BF16, 5, False, True, "cpu_flash"),  # the CPU kernel takes any head dim
        ("cpu", FP32, 64, True, False, "math"),  # a non-square causal block: not the ring's, and not fused
        ("cuda", BF16, 64, True, True, "flash"),
        ("cuda", FP16, 128, False, True, "flash"),
        ("cuda", BF16, 256, False, False, "flash"),  # unmasked: any number of keys
        ("cuda", BF16, 264, False, True, "efficient"),  # past flash's head dims
        ("cuda", BF16, 36, True, True, "math"),  # 16-bit head dims must be multiples of 8
        ("cuda", FP32, 36, True, True, "efficient"),  # fp32: flash does not take it, efficient does (÷4)
        ("cuda", FP32, 30, False, True, "math"),
        ("cuda", FP64, 64, False, True, "math"),
        ("cuda", BF16, 64, True, False, "math"),
        ("meta", BF16, 64, True, True, "math"),  # the dry run
        ("mps", FP32, 64, False, True, "math"),
    ],
)
def test_block_kernel_rule(device, dtype, head_dim, causal, square, kernel):
    assert rk.block_kernel(device, dtype, head_dim, causal, square) == kernel


@pytest.mark.parametrize(
    "device, dtype, head_dim, v_head_dim, kernel",
    [
        ("cpu", FP32, 12, 6, "cpu_flash"),  # zero-padded to one width
        ("cuda", BF16, 192, 128, "efficient"),  # DeepSeek-V3's MLA: flash takes one head dim only
        ("cuda", BF16, 128, 128, "flash"),
        ("cuda", FP32, 12, 6, "math"),  # fp32 efficient needs both widths ÷ 4
        ("cuda", BF16, 24, 12, "math"),  # 16-bit: ÷ 8
    ],
)
def test_block_kernel_rule_with_another_v_width(device, dtype, head_dim, v_head_dim, kernel):
    assert rk.block_kernel(device, dtype, head_dim, False, True, v_head_dim) == kernel


@pytest.mark.parametrize("dv", [6, 20])
def test_cpu_flash_block_with_another_v_width_equals_math(dv):
    """The CPU kernel takes one head dim: a narrower (or wider) v runs zero-padded, and its output,
    log-sum-exp and gradients (from the merged output, as the ring calls it) equal the exact math kernel's."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 8, 12, generator=g), torch.randn(2, 3, 8, 12, generator=g)
    v, do = torch.randn(2, 3, 8, dv, generator=g), torch.randn(2, 3, 8, dv, generator=g)
    for causal in (True, False):
        (out, lse), (ref_out, ref_lse) = (rk.attend(kind, q, k, v, causal, 0.3) for kind in ("cpu_flash", "math"))
        assert out.shape == ref_out.shape == (2, 3, 8, dv)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
        got = rk.attend_backward("cpu_flash", do, q, k, v, ref_out, ref_lse, causal, 0.3)
        ref = rk.attend_backward("math", do, q, k, v, ref_out, ref_lse, causal, 0.3)
        for name, a, b in zip(("dq", "dk", "dv"), got, ref):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b.to(a.dtype), atol=1e-5, rtol=0, msg=name)


def test_choose_steps_down_where_the_device_refuses(monkeypatch):
    q = torch.zeros(1, 2, 8, 16)
    assert rk.choose(q, q, q, True) == "cpu_flash"
    monkeypatch.setattr(rk, "block_kernel", lambda *a, **k: "flash")  # as on a GPU
    refused: set = set()
    monkeypatch.setattr(rk, "_device_takes", lambda kind, *a: kind not in refused)
    assert rk.choose(q, q, q, True) == "flash"
    refused.add("flash")  # e.g. a GPU before sm80, or torch.backends.cuda.enable_flash_sdp(False)
    assert rk.choose(q, q, q, True) == "efficient"
    refused.add("efficient")
    assert rk.choose(q, q, q, True) == "math"


@pytest.mark.parametrize("kind", ["flash", "efficient"])
@pytest.mark.parametrize("sq, sk, causal", [(24, 24, True), (12, 24, False), (40, 20, False)])
def test_cuda_kernel_calls_on_meta(kind, sq, sk, causal):
    b, h, d = 2, 3, 64
    q = torch.empty(b, h, sq, d, device="meta", dtype=BF16)
    k, v = (torch.empty(b, h, sk, d, device="meta", dtype=BF16) for _ in range(2))
    out, lse = rk.attend(kind, q, k, v, causal, 0.125)
    assert out.shape == q.shape and lse.shape == (b, h, sq) and lse.dtype == FP32
    merged_lse = torch.empty(b, h, 2 * sq, device="meta")[:, :, sq:]  # a half of the merged rows: not contiguous
    dq, dk, dv = rk.attend_backward(kind, out, q, k, v, out, merged_lse, causal, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# ---------------------------------------------------------------- the ring's blocks on one device


def ring_on_one_device(q, k, v, do, cp: int, causal: bool, scale: float):
    """Every cp rank's ring forward and backward, computed in one process as ``_RingAttention`` does
    (blocks by ``ring_block``, LSE merge in fp32, backward from the merged output and LSE); returns
    the whole sequence's ``out, dq, dk, dv`` (in cp_slice layout per rank, concatenated) and the kernels run."""
    h, hk = q.shape[1], k.shape[1]
    qs, ks, vs, dos = ([cp_slice(t, cp, r, dim=2) for r in range(cp)] for t in (q, k, v, do))
    kinds, outs, lses = set(), [], []
    for r in range(cp):
        halves: list = [None, None]
        for step in range(cp):
            src = (r - step) % cp
            rows, cols, masked = ring_block(cp, r, src, causal)
            kb, vb = (_expand_kv(_rows(t[src], cols), h) for t in (ks, vs))
            qb = _rows(qs[r], rows)
            kind = rk.choose(qb, kb, vb, masked)
            kinds.add(kind)
            o, lse = rk.attend(kind, qb, kb, vb, masked, scale)
            if rows == "all":
                for i, (oh, lh) in enumerate(zip(o.chunk(2, 2), lse.chunk(2, 2))):
                    halves[i] = _merge(halves[i], oh, lh)
            else:
                halves[1] = _merge(halves[1], o, lse)
        outs.append(torch.cat([halves[0][0], halves[1][0]], dim=2).to(q.dtype))
        lses.append(torch.cat([halves[0][1], halves[1][1]], dim=2))
    dqs, dks, dvs = ([torch.zeros(t.shape, device=t.device) for t in ts] for ts in (qs, ks, vs))
    for r in range(cp):
        for step in range(cp):
            src = (r - step) % cp
            rows, cols, masked = ring_block(cp, r, src, causal)
            kb, vb = (_expand_kv(_rows(t[src], cols), h) for t in (ks, vs))
            qb = _rows(qs[r], rows)
            kind = rk.choose(qb, kb, vb, masked)
            gq, gk, gv = rk.attend_backward(
                kind, _rows(dos[r], rows), qb, kb, vb, _rows(outs[r], rows), _rows(lses[r], rows), masked, scale
            )
            _rows(dqs[r], rows).add_(gq.float())
            _rows(dks[src], cols).add_(_fold_kv(gk.float(), hk))
            _rows(dvs[src], cols).add_(_fold_kv(gv.float(), hk))
    return [torch.cat(ts, dim=2) for ts in (outs, dqs, dks, dvs)], kinds


def _full(q, k, v, do, causal, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    (out * do).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _block_seconds(kind, q, k, v, do, scale, iters=5):
    """Seconds of one unmasked block's forward + backward with ``kind`` (CUDA events; the CPU's clock)."""
    import time

    def once():
        o, lse = rk.attend(kind, q, k, v, False, scale)
        rk.attend_backward(kind, do, q, k, v, o.to(q.dtype), lse, False, scale)

    once()
    if q.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            once()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        once()
    return (time.perf_counter() - t) / iters


CASES = [  # (dtype, heads, kv heads, head dim, causal)
    (FP32, 4, 4, 64, True),
    (FP32, 4, 2, 36, False),
    (BF16, 4, 4, 64, True),
    (BF16, 8, 2, 128, True),
    (FP16, 4, 4, 64, False),
    (BF16, 4, 4, 36, True),  # the math fallback on a GPU
]


def _parity(device_name: str, cp: int, seq: int, force_math: bool, timing_shape):
    if device_name == "cuda":
        torch.cuda.set_device(0)
    device = torch.device(device_name)
    if force_math:
        rk.block_kernel = lambda *a, **k: "math"  # this forked rank only
    rows = []
    for i, (dtype, h, hk, d, causal) in enumerate(CASES):
        g = torch.Generator().manual_seed(i)
        ts = [torch.randn(2, n, seq, d, generator=g, dtype=FP64).to(dtype).double() for n in (h, hk, hk, h)]
        scale = d**-0.5
        exact = _full(*ts, causal, scale)  # fp64 on the CPU, of the very inputs (rounded to dtype)
        local = [t.to(device, dtype) for t in ts]
        got, kinds = ring_on_one_device(*local, cp, causal, scale)
        torch_sdpa = _full(*local, causal, scale)  # torch's own kernel on the whole sequence, same dtype
        ref_local = [torch.cat([cp_slice(t, cp, r, dim=2) for r in range(cp)], dim=2) for t in exact]
        errs = [float((a.double().cpu() - b).abs().max()) for a, b in zip(got, ref_local)]
        torch_errs = [float((a.double().cpu() - b).abs().max()) for a, b in zip(torch_sdpa, exact)]
        rows.append(
            dict(
                dtype=str(dtype),
                heads=h,
                kv_heads=hk,
                head_dim=d,
                causal=causal,
                kinds=sorted(kinds),
                err=errs,
                torch_err=torch_errs,
            )
        )
    timing = None
    if timing_shape is not None:
        b, h, s, d = timing_shape
        q, k, v, do = (torch.randn(b, h, s, d, device=device, dtype=BF16) for _ in range(4))
        kind = rk.choose(q, k, v, False)
        timing = dict(
            shape=[b, h, s, d],
            dtype="bf16",
            kernel=kind,
            fused_s=_block_seconds(kind, q, k, v, do, d**-0.5),
            math_s=_block_seconds("math", q, k, v, do, d**-0.5),
        )
    return rows, timing


def _check(rows):
    for r in rows:
        floor = 1e-5 if r["dtype"] == str(FP32) else 2e-3
        for name, ours, theirs in zip(("out", "dq", "dk", "dv"), r["err"], r["torch_err"]):
            assert ours <= 2 * theirs + floor, (r, name)


@pytest.mark.parametrize("force_math", [False, True], ids=["device-kernels", "math"])
def test_ring_blocks_on_one_device_equal_full_attention(force_math):
    rows, _ = run_ranks(_parity, 1, "cpu", 2, 32, force_math, None, timeout=120)[0]
    _check(rows)
    assert all(r["kinds"] == (["math"] if force_math else ["cpu_flash"]) for r in rows)


@pytest.mark.cuda
def test_ring_blocks_on_the_cuda_device_equal_full_attention():
    """On the GPU when there is one (``-m cuda``; the CPU otherwise): the kernel each case runs, its
    parity with fp64 full attention (as close as torch's own SDPA on the whole sequence, ×2), and one
    block's forward + backward time beside the math kernel's."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (1, 16, 2048, 128) if device == "cuda" else (1, 2, 128, 64)
    rows, timing = run_ranks(_parity, 1, device, 2, 64 if device == "cuda" else 32, False, shape, timeout=300)[0]
    _check(rows)
    kinds = {(r["dtype"], r["head_dim"]): r["kinds"] for r in rows}
    if device == "cuda":
        assert kinds[(str(BF16), 64)][0] in ("flash", "efficient")  # a fused kernel, never math, for bf16 d=64
        assert kinds[(str(FP32), 64)] == ["efficient"]
        assert kinds[(str(BF16), 36)] == ["math"]
    out = os.environ.get("GPU_CHECK_OUT")
    if out:
        with open(os.path.join(out, "ring_kernels.json"), "w") as f:
            json.dump({"device": device, "cases": rows, "block_timing": timing}, f, indent=1)
    print(json.dumps({"kinds": {f"{k[0]} d={k[1]}": v for k, v in kinds.items()}, "block_timing": timing}))
