"""Context-parallel attention (ring and Ulysses) against full-sequence SDPA on the gathered sequence."""

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import comm
from parallel.layers import LayerConfigError
from parallel.layers.ring_attention import (
    check_cp_seq_len,
    check_ulysses_heads,
    context_parallel_attention,
    cp_chunks,
    cp_positions,
    cp_slice,
    cp_unslice,
    ring_block,
    ring_bytes,
    ulysses_bytes,
)
from parallel.testing import run_ranks

# (impl, causal, heads, kv_heads, head_dim, v_head_dim): GQA, odd head dims, both masks, both implementations,
# v narrower or wider than q and k (multi-head latent attention's v_head_dim ≠ nope + rope)
CASES = [
    ("ring", True, 4, 4, 8, 8),
    ("ring", False, 4, 4, 8, 8),
    ("ring", True, 4, 2, 5, 5),
    ("ring", False, 6, 2, 3, 3),
    ("ring", True, 4, 4, 12, 6),
    ("ring", True, 4, 2, 5, 7),
    ("alltoall", True, 4, 4, 8, 8),
    ("alltoall", True, 8, 4, 5, 5),
    ("alltoall", False, 4, 4, 3, 3),
    ("alltoall", True, 4, 4, 12, 6),
]


def _tensors(seed, b, h, hk, s, d, dv):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, h, s, d), (b, hk, s, d), (b, hk, s, dv), (b, h, s, dv))
    return [torch.randn(*shape, generator=g) for shape in shapes]


def _reference(q, k, v, do, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    (out * do).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_rank(cases, s):
    cp, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)), group_desc="cp")
    results = []
    for i, (impl, causal, h, hk, d, dv) in enumerate(cases):
        if impl == "alltoall" and (h % cp or hk % cp):
            continue
        q, k, v, do = _tensors(i, 2, h, hk, s, d, dv)
        local = [cp_slice(t, cp, r, dim=2).clone().requires_grad_() for t in (q, k, v)]
        counter = comm.CommCounter()
        with counter:
            out = context_parallel_attention(*local, group, impl=impl, causal=causal)
            (out * cp_slice(do, cp, r, dim=2)).sum().backward()
        ref = _reference(q, k, v, do, causal)
        got = [out.detach()] + [t.grad for t in local]
        err = max((a - cp_slice(b, cp, r, dim=2)).abs().max().item() for a, b in zip(got, ref))
        results.append((impl, causal, h, hk, d, dv, err, counter.sent_bytes("cp")))
    return results


@pytest.mark.parametrize("cp, kernel", [(2, "flash"), (4, "flash"), (2, "math")])
def test_cp_attention_equals_full_sdpa(cp, kernel, monkeypatch):
    kernels = importlib.import_module("parallel.layers.ring_kernels")
    if kernel == "math":  # the fallback of every device, checked here (the ranks inherit the patch)
        monkeypatch.setattr(kernels, "block_kernel", lambda *a, **k: "math")
        monkeypatch.setattr(kernels, "MATH_SCORE_ELEMENTS", 100)  # several query-row tiles per block
    s = 8 * cp
    for rank_results in run_ranks(_cp_rank, cp, CASES, s, timeout=120):
        assert len(rank_results) >= 7
        for impl, causal, h, hk, d, dv, err, sent in rank_results:
            assert err < 1e-5, (impl, causal, h, hk, d, dv, err)
            elt = 4
            if impl == "ring":
                theory = ring_bytes(2, hk, s // cp, d, cp, elt, v_head_dim=dv)
                assert sent == theory["forward"] + theory["backward"]
            else:
                theory = ulysses_bytes(2, h, hk, s // cp, d, cp, elt, v_head_dim=dv)
                assert sent == pytest.approx(theory["forward"] + theory["backward"])


def _units(rows, cols, masked):
    """(query half × key half) pairs a ring step computes; the own block's causal mask hides one of four."""
    return 3 if masked else (2 if rows == "all" else 1) * (2 if cols == "all" else 1)


def test_layout_helpers():
    assert [cp_chunks(2, r) for r in range(2)] == [(0, 3), (1, 2)]
    x = torch.arange(24).view(1, 24)
    parts = [cp_slice(x, 3, r) for r in range(3)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert torch.equal(cp_unslice(parts), x)
    for r in range(3):
        assert torch.equal(cp_positions(24, 3, r), parts[r][0])
    # the load balance: every rank computes the same number of half-chunk pairs under the causal mask
    for cp in (2, 3, 4, 8):
        work = [sum(_units(*ring_block(cp, r, src, True)) for src in range(cp)) for r in range(cp)]
        assert work == [2 * cp + 1] * cp


def test_refusals_name_the_numbers():
    with pytest.raises(LayerConfigError, match=r"seq_len 30 is not divisible by 2·cp = 4"):
        check_cp_seq_len(30, 2)
    check_cp_seq_len(30, 1)
    with pytest.raises(LayerConfigError, match=r"n_heads 6 divisible by cp·tp = 2·2 = 4"):
        check_ulysses_heads(6, 2, cp=2, tp=2)
    with pytest.raises(LayerConfigError, match=r"n_kv_heads 2 divisible by cp·tp = 4·1 = 4"):
        check_ulysses_heads(8, 2, cp=4, tp=1)
