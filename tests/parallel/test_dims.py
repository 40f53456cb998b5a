"""parallel.dims: the resolved layout, checked once, pure (no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from parallel.dims import LayoutError, ParallelDims

LLAMA = dict(seq_len=32, n_heads=8, n_kv_heads=4, n_layers=4, d_ff=64)


def test_derived_facts_are_properties():
    d = ParallelDims(dp=2, pp=2, tp=2, cp=2, sequence_parallel=True, **LLAMA)
    assert d.world_size == 16 and d.model_parallel_size == 8
    assert (d.cp_enabled, d.sp_enabled, d.tp_enabled, d.pp_enabled, d.dp_enabled, d.ep_enabled) == (
        True,
        True,
        True,
        True,
        True,
        False,
    )
    assert (d.local_seq_len, d.tp_seq_len) == (16, 8)
    assert d.activation_shape(micro_batch=3, d_model=64) == (3, 8, 64)
    assert d.ring and not d.ulysses
    assert d.dense_grad_group == "dpcp" and d.expert_grad_group == "dpcp"


def test_one_process_is_every_axis_off():
    d = ParallelDims(seq_len=16)
    assert d.world_size == 1 and not (d.cp_enabled or d.sp_enabled or d.pp_enabled or d.compression_enabled)
    assert d.local_seq_len == d.tp_seq_len == 16 and d.dense_grad_group == "dp"


def test_sequence_parallel_at_tp1_is_refused_and_off_without_it():
    with pytest.raises(LayoutError, match="sequence parallelism needs tp > 1") as e:
        ParallelDims(sequence_parallel=True)
    assert e.value.values == {"sequence_parallel": True, "tp": 1}
    assert not ParallelDims(tp=2).sp_enabled


def test_expert_groups():
    d = ParallelDims(dp=4, ep=2, moe_experts=4)
    assert d.ep_enabled and d.expert_grad_group == "edp" and d.dense_grad_group == "dp"


@pytest.mark.parametrize(
    "kw, needle, values",
    [
        (dict(tp=0), "tp must be a positive integer, got 0", {"tp": 0}),
        (dict(tp=True), "tp must be a positive integer, got True", {"tp": True}),
        (dict(cp=2, seq_len=30), "seq_len 30 is not divisible by 2·cp = 4", {"cp": 2}),
        (dict(cp=8, cp_impl="alltoall", **LLAMA), "n_kv_heads 4 divisible by cp·tp = 8·1 = 8", {"cp": 8}),
        (dict(cp=2, cp_impl="zigzag"), "cp_impl 'zigzag' is not one of ring, alltoall", {"cp_impl": "zigzag"}),
        (dict(tp=3, **LLAMA), "n_heads 8 is not divisible by tp 3", {"tp": 3}),
        (dict(tp=8, **LLAMA), "n_kv_heads 4 cannot be split over tp 8", {"tp": 8}),
        (dict(dp=6, ep=4, moe_experts=4), "ep 4 does not divide dp 6", {"ep": 4}),
        (dict(dp=2, ep=2), "ep=2 needs an MoE model", {"ep": 2}),
        (dict(pp=8, **LLAMA), "pp 8 × vpp 1 = 8 stages but the model has 4 layers", {"pp": 8, "vpp": 1}),
        (dict(pp=2, vpp=2), "vpp=2 needs pp_schedule=interleaved", {"schedule": "1f1b", "vpp": 2}),
        (dict(zero=1, compression="topk"), "Top-K compression needs ZeRO stage 0", {"compression": "topk", "zero": 1}),
        (
            dict(tp=4, cp=2, seq_len=12, sequence_parallel=True),
            "each cp rank's 6 tokens (seq_len 12 / cp 2) over tp 4",
            {"sequence_parallel": True},
        ),
    ],
)
def test_refusals_name_the_numbers(kw, needle, values):
    with pytest.raises(LayoutError) as e:
        ParallelDims(**kw)
    assert needle in str(e.value)
    if values is not None:
        assert e.value.values == values


def test_frozen_and_model_facts_optional():
    d = ParallelDims(dp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.dp = 4  # type: ignore[misc]
    with pytest.raises(LayoutError, match="built without seq_len"):
        _ = d.local_seq_len


def test_docstring_examples():
    import doctest

    import parallel.dims

    assert doctest.testmod(parallel.dims).failed == 0
