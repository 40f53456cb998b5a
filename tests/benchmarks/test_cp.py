"""The cp benchmark's contender computes what ring attention computes, and both byte counts are the theory."""

import pytest

from benchmarks.cp import attention_side_by_side
from parallel.layers.ring_attention import ring_bytes


def test_allgather_contender_equals_ring_and_bytes_are_theory():
    cp, seq, heads, head_dim = 2, 64, 2, 8
    r = attention_side_by_side(cp, seq, heads, heads, head_dim, iters=1)
    assert r["max_abs_diff"] < 1e-5
    kv = ring_bytes(1, heads, seq // cp, head_dim, cp, 4)
    assert r["ours_sent_bytes"] == kv["forward"] + kv["backward"]
    assert r["theirs_sent_bytes"] == pytest.approx(2 * (cp - 1) * kv["kv"])  # all-gather + reduce-scatter
    assert r["torch_context_parallel"]  # "ok", or the refusal torch gives on this machine
