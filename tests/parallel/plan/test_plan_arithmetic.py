"""The design brief's arithmetic, from first principles, and the hardware profiles."""

import pytest

from parallel.plan import ModelShape, PlanError, hardware_profile, model_state_bytes
from parallel.plan.memory import layer_activation_bytes
from parallel.plan.traffic import AxisTraffic, axis_traffic, dp_traffic, group_crosses_node, members_per_node

GB = 1e9


def test_175b_weights_adam_and_total():
    s = model_state_bytes(175_000_000_000, zero=0, dp=1, precision="bf16")
    assert s["params"] == 350 * GB
    assert s["optimizer"] == 2100 * GB  # fp32 master, m, v: 700 GB each (the brief says 1,050)
    assert s["grads"] == 700 * GB  # accumulated in fp32 (parallel.zero.theory.GRAD_BYTES)
    assert s["total"] == 3150 * GB


def test_7b_static_state_and_zero2_over_8():
    s = model_state_bytes(7_000_000_000, zero=0, dp=1, precision="fp16")
    # the brief's 14 + 14 + 84 keeps 16-bit gradients; ours accumulate in fp32: 14 + 28 + 84
    assert (s["params"], s["grads"], s["optimizer"]) == (14 * GB, 28 * GB, 84 * GB)
    z2 = model_state_bytes(7_000_000_000, zero=2, dp=8, precision="fp16")
    assert z2["optimizer"] == 10.5 * GB and z2["grads"] == 3.5 * GB and z2["params"] == 14 * GB


def test_7b_ring_all_reduce_over_100_gbit():
    hw = hardware_profile("a100_80gb", inter_node_gbps=12.5, latency_us=0.0)
    axis = AxisTraffic(group_size=8, crosses_node=True)
    t = axis.add("all_reduce", 14 * GB, 1, hw, "gradients")
    assert axis.bytes == pytest.approx(24.5 * GB)
    assert t == pytest.approx(1.96)


def test_zero_traffic_volumes_match_theory():
    """ZeRO-3 moves 1.5× ZeRO-0's volume (one micro-batch); stages 2-3 reduce every micro-batch."""
    hw = hardware_profile("h100", latency_us=0.0)
    psi, n = 8_000, 8
    sent = {}
    for zero in range(4):
        axis = AxisTraffic(n, False)
        dp_traffic(hw, axis, psi=psi, zero=zero, micro_batches=1, param_bytes=2, comm_bytes=2)
        sent[zero] = axis.bytes
    assert sent[0] == pytest.approx(2 * (n - 1) / n * psi * 2)
    assert sent[1] == sent[2] == pytest.approx(sent[0])
    assert sent[3] == pytest.approx(1.5 * sent[0])
    for zero, per_mb in ((0, False), (1, False), (2, True), (3, True)):
        axis = AxisTraffic(n, False)
        dp_traffic(hw, axis, psi=psi, zero=zero, micro_batches=4, param_bytes=2, comm_bytes=2)
        grads = 0.5 * sent[0]
        assert (axis.bytes - sent[zero] > 0) == per_mb, zero
        if zero == 2:
            assert axis.bytes == pytest.approx(sent[2] + 3 * grads)


def test_topk_sends_values_and_indices_from_every_rank():
    hw = hardware_profile("a100")
    axis = AxisTraffic(4, True)
    dp_traffic(
        hw, axis, psi=1000, zero=0, micro_batches=4, param_bytes=2, comm_bytes=2, compression="topk", topk_ratio=0.1
    )
    assert axis.bytes == pytest.approx(3 * 100 * (2 + 4))  # (N-1)·k·(b+4), once per step


def test_more_zero_never_raises_model_state_memory():
    for psi in (1, 7, 1000, 123_457):
        for dp in (1, 2, 3, 8, 64):
            for precision in ("fp32", "bf16"):
                totals = [model_state_bytes(psi, z, dp, precision)["total"] for z in range(4)]
                assert totals == sorted(totals, reverse=True), (psi, dp, precision, totals)


def test_padding_to_equal_shards():
    s = model_state_bytes(10, zero=3, dp=4, precision="fp32")  # 10 → 12 elements, 3 per rank
    assert s["params"] == 4 * 3 and s["optimizer"] == 8 * 3


def test_node_crossing():
    assert not group_crosses_node(1, 8, 8)
    assert group_crosses_node(1, 16, 8)
    assert group_crosses_node(8, 2, 8)
    assert not group_crosses_node(2, 4, 8) and group_crosses_node(4, 4, 8)


def test_a_ring_across_nodes_leaves_each_node_through_its_members_nics():
    """k members of a ring group per node: k rings, each through one member's NIC, so a rank sends at
    k NICs' rate, at most NVLink's; all-to-all and p2p stay at one NIC (every rank's bytes cross)."""
    assert [members_per_node(s, n, 8) for s, n in ((1, 64), (2, 32), (8, 64), (1, 4), (16, 4))] == [
        8,
        4,
        1,
        4,
        1,
    ]
    hw = hardware_profile("h100")  # NIC 50 GB/s, NVLink 450 GB/s per GPU
    assert hw.bandwidth(True, per_node=1) == 50e9 and hw.bandwidth(True, per_node=4) == 200e9
    assert hw.bandwidth(True, per_node=8) == 400e9 and hw.bandwidth(False, per_node=8) == 450e9
    assert hardware_profile("h100", inter_node_gbps=100.0).bandwidth(True, per_node=8) == 450e9  # NVLink bounds it
    ring, single = axis_traffic(1, 64, 8), axis_traffic(8, 64, 8)
    assert ring.add("all_gather", 64e9, 1, hw, "x") * 8 == pytest.approx(
        single.add("all_gather", 64e9, 1, hw, "x"), 1e-2
    )
    a2a = axis_traffic(1, 64, 8)
    assert a2a.add("all_to_all", 64e9, 1, hw, "x") == pytest.approx(single.add("all_to_all", 64e9, 1, hw, "x"))


def test_profiles_custom_and_errors():
    assert hardware_profile("H200").memory_bytes == 141e9
    assert hardware_profile("h100", inter_node_gbps=12.5).inter_node_gbps == 12.5
    mine = {
        "lab": dict(
            peak_tflops_16=100,
            peak_tflops_32=10,
            memory_bytes=24e9,
            intra_node_gbps=32,
            inter_node_gbps=3,
            gpus_per_node=4,
        )
    }
    assert hardware_profile("lab", mine).gpus_per_node == 4
    with pytest.raises(PlanError, match="unknown hardware profile 'tpu'.*known"):
        hardware_profile("tpu")
    with pytest.raises(PlanError, match="unknown hardware fields"):
        hardware_profile("cpu", bandwidth=3)
    with pytest.raises(PlanError, match="missing fields"):
        hardware_profile("lab", {"lab": dict(peak_tflops_16=1)})
    with pytest.raises(PlanError, match="efficiency"):
        hardware_profile("cpu", efficiency=1.5)


def test_zero_padding_per_bucket():
    from parallel.plan.memory import StageParams, zero_padded_numel

    block = ((10, 3, 5), (2,))  # weight-decay class packs as [10], [3, 5] under 12-element buckets
    p = StageParams(20, blocks=(block, block), root=((7,), (1, 1)))
    assert zero_padded_numel(p, 1, 12 * 4, 4) == 2 * 20 + 9  # dp=1: nothing added
    # dp=4 per block: [10]→12, [8]→8, [2]→4; root: [7]→8, [2]→4
    assert zero_padded_numel(p, 4, 12 * 4, 4) == 2 * (12 + 8 + 4) + 8 + 4
    # a parameter larger than a bucket gets its own; without groups the whole rank is padded
    assert zero_padded_numel(StageParams(5, root=((30, 1), ())), 4, 8, 4) == 32 + 4
    assert zero_padded_numel(StageParams(10), 4, 8, 4) == 12


def korthikanti_layer_bytes(
    shape, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False, checkpointing: str = "none"
) -> float:
    """Korthikanti et al. 2022 (Table 2), bytes per GPT layer in 16-bit with dropout: ``sbh(10 + 24/t + 5as/ht)``;
    with sequence parallelism ``sbh/t·(34 + 5as/h)``; ``selective`` drops ``5as/h``; ``full`` keeps ``2sbh/t'``."""
    s, b, h, a, t = shape.seq_len, micro_batch, shape.d_model, shape.n_heads, tp
    sbh = s * b * h
    if checkpointing == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 0.0 if checkpointing == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_layer_activations_are_korthikanti_without_dropout_with_flash_attention(sp, checkpointing):
    """GPT-3 175B at tp=8 in bf16: the paper's bytes per layer, less its two 1-byte dropout masks and
    the 5as/h score terms, plus LayerNorm's fp32 statistics and (no recomputation) flash's log-sum-exp."""
    shape = ModelShape("gpt", 96, 12288, 96, 96, 4 * 12288, 50257, 2048)  # GPT-3 175B
    t, b = 8, 1
    s, h, a = shape.seq_len, shape.d_model, shape.n_heads
    ts = t if sp else 1
    ours = layer_activation_bytes(shape, b, tp=t, sequence_parallel=sp, checkpointing=checkpointing)
    paper = korthikanti_layer_bytes(shape, b, tp=t, sequence_parallel=sp, checkpointing=checkpointing)
    scores = 5 * a * s * s * b / t if checkpointing == "none" else 0.0
    lse = 4 * b * a * s / t if checkpointing == "none" else 0.0
    assert ours == pytest.approx(paper - scores - 2 * s * b * h / ts + 16 * s * b / ts + lse, rel=1e-12)
    if sp and checkpointing == "selective":  # the figure: 34·sbh/t = 107 MB; ours 100.7 MB (was 189)
        assert paper == 34 * s * b * h / t
        assert ours == pytest.approx(100.67e6, rel=1e-4)


@pytest.mark.parametrize(
    "name, bf16, fp32, ring_gbps",
    [
        ("a100_80gb", 312.0, 19.5, 300.0),  # datasheet: 624 TFLOP/s with sparsity; NVLink3 600 GB/s both ways
        ("h100_sxm", 989.0, 67.0, 450.0),  # 1,979 with sparsity; NVLink4 900 GB/s both ways
        ("h100_pcie", 756.0, 51.0, 64.0),  # 1,513 with sparsity; PCIe Gen5 x16 128 GB/s both ways
        ("h200", 989.0, 67.0, 450.0),  # the H100 SXM's compute with HBM3e
    ],
)
def test_profiles_hold_the_datasheets_dense_peaks(name, bf16, fp32, ring_gbps):
    hw = hardware_profile(name)
    assert hw.peak_flops("bf16") == bf16 * 1e12 and hw.peak_flops("fp32") == fp32 * 1e12
    assert hw.bandwidth(crosses_node=False) == ring_gbps * 1e9
