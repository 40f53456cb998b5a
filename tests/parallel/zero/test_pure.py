"""The pure parts: bucket layout, loss-scale bookkeeping, the ZeRO formulas, config refusals."""

import pytest

from parallel.zero import DynamicLossScaler, ZeroConfigError, model_state_bytes, plan_buckets, step_sent_bytes


def _params():
    # (name, shape, wants weight decay, unit)
    return [
        ("a.w", (4, 5), True, 0, ""),
        ("a.b", (5,), False, 0, ""),
        ("b.w", (3, 3), True, 1, ""),
        ("b.b", (3,), False, 1, ""),
        ("head", (7,), True, 2, ""),
        ("c.w", (2, 2), True, 0, ""),
        ("emb", (3, 2), True, 2, "embedding"),
    ]


def test_buckets_split_by_unit_and_weight_decay_and_pad_to_dp():
    buckets = plan_buckets(_params(), dp=4, bucket_bytes=10**6, element_size=4)
    assert [(b.unit, b.weight_decay, [s.name for s in b.slots]) for b in buckets] == [
        (0, True, ["a.w", "c.w"]),
        (0, False, ["a.b"]),
        (1, True, ["b.w"]),
        (1, False, ["b.b"]),
        (2, True, ["head"]),
        (2, True, ["emb"]),
    ]
    assert [b.extra_reduce for b in buckets] == [""] * 5 + ["embedding"]
    a = buckets[0]
    assert (a.numel, a.padded_numel, a.shard_numel) == (24, 24, 6)
    assert [(s.offset, s.end) for s in a.slots] == [(0, 20), (20, 24)]
    assert [b.padded_numel for b in buckets[1:]] == [8, 12, 4, 8, 8]
    # shards tile the padded buffer, in rank order
    assert [a.shard_range(r) for r in range(4)] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert [(s.name, lo, hi) for s, lo, hi in a.overlaps(*a.shard_range(3))] == [("a.w", 18, 20), ("c.w", 20, 24)]


def test_a_bucket_closes_before_it_would_exceed_the_byte_limit():
    params = [(f"p{i}", (10,), True, 0, "") for i in range(5)]
    buckets = plan_buckets(params, dp=2, bucket_bytes=80, element_size=4)  # 20 elements per bucket
    assert [[s.name for s in b.slots] for b in buckets] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    big = plan_buckets([("huge", (100,), True, 0, "")], dp=3, bucket_bytes=8, element_size=4)
    assert len(big) == 1 and big[0].padded_numel == 102  # a parameter is never split


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dp=0, bucket_bytes=8, element_size=4), "dp must be"),
        (dict(dp=2, bucket_bytes=0, element_size=4), "bucket_mb"),
    ],
)
def test_bad_layout_settings_are_refused(kwargs, match):
    with pytest.raises(ZeroConfigError, match=match):
        plan_buckets(_params(), **kwargs)


def test_loss_scale_backs_off_after_hysteresis_overflows_and_grows_after_a_clean_window():
    s = DynamicLossScaler(scale=2.0**16, growth_interval=3, hysteresis=2, min_scale=2.0**14)
    s.update(True)
    assert s.scale == 2.0**16  # one overflow is tolerated (hysteresis 2)
    s.update(True)
    assert s.scale == 2.0**15
    s.update(True), s.update(True)
    assert s.scale == 2.0**14
    s.update(True), s.update(True)
    assert s.scale == 2.0**14  # never below min_scale
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0**15
    s.update(False), s.update(True), s.update(False), s.update(False)
    assert s.scale == 2.0**15  # an overflow restarts the growth window
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored == s


@pytest.mark.parametrize(
    "kwargs", [dict(scale=0), dict(backoff_factor=1.0), dict(growth_interval=0), dict(scale=1.0, min_scale=2.0)]
)
def test_bad_scaler_settings_are_refused(kwargs):
    with pytest.raises(ZeroConfigError):
        DynamicLossScaler(**kwargs)


def test_zero_formulas_match_the_paper_and_design_md():
    psi, n = 7 * 10**9, 8
    # the ZeRO paper (16-bit gradients): 7B with bf16 + Adam: 14 + 14 + 84 = 112 GB at stage 0
    assert model_state_bytes(psi, 0, n, param_bytes=2, grad_bytes=2) == {
        "params": 14e9,
        "grads": 14e9,
        "optimizer": 84e9,
        "total": 112e9,
    }
    # ZeRO-2 over 8: optimizer 10.5 GB, gradients 1.75 GB per GPU
    z2 = model_state_bytes(psi, 2, n, param_bytes=2, grad_bytes=2)
    assert (z2["optimizer"], z2["grads"], z2["params"]) == (10.5e9, 1.75e9, 14e9)
    assert model_state_bytes(psi, 3, n, param_bytes=2, grad_bytes=2)["total"] == 112e9 / n
    # ours (and Megatron's): fp32 gradient accumulation, 2 + 4 + 12 = 18 bytes per parameter; 6 + 12/N at stage 1
    assert model_state_bytes(psi, 0, n, param_bytes=2)["total"] == 18 * psi
    assert model_state_bytes(psi, 1, n, param_bytes=2)["total"] == (6 + 12 / n) * psi
    assert model_state_bytes(psi, 2, n, param_bytes=2)["grads"] == 4 * psi / n
    assert model_state_bytes(100, 1, 4)["optimizer"] == 8 * 100 / 4  # fp32: no separate master
    # the design brief: 7B fp16 gradients ring all-reduce at N=8: 24.5 GB sent per rank
    assert step_sent_bytes(psi, 0, n, param_bytes=2, comm_bytes=2) == pytest.approx(24.5e9)
    assert step_sent_bytes(psi, 1, n, 2, 2) == step_sent_bytes(psi, 2, n, 2, 2) == pytest.approx(24.5e9)
    assert step_sent_bytes(psi, 3, n, 2, 2) == pytest.approx(1.5 * 24.5e9)
    # the default wire is fp32: twice the 16-bit gradient bytes at stage 0
    assert step_sent_bytes(psi, 0, n, param_bytes=2) == pytest.approx(49e9)
