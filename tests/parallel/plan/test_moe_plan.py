"""The MoE planner numbers against Mixtral's published sizes, our built models and the byte counter."""

import pytest
import torch
import torch.distributed as dist

from models.config import preset
from models.transformer import build_model
from parallel import comm
from parallel.layers.moe import MoELayer
from parallel.plan.moe import (
    MoEShape,
    all_to_all_payload_bytes,
    flops_per_token,
    param_counts,
)
from parallel.testing import run_ranks
from parallel.zero import theory as zero_theory


def test_mixtral_8x7b_total_and_active_parameters():
    n = param_counts(MoEShape.of(preset("mixtral_8x7b")))
    assert n["total"] / 1e9 == pytest.approx(46.7, abs=0.05)  # Mistral AI: 46.7B total
    assert n["active"] / 1e9 == pytest.approx(12.9, abs=0.05)  # 12.9B used per token
    assert flops_per_token(preset("mixtral_8x7b")) < 6 * n["total"] / 3  # active, not total


@pytest.mark.parametrize(
    "cfg",
    [
        preset("mixtral_tiny"),
        preset("gpt_tiny", moe_experts=4, moe_top_k=1, moe_every=2, moe_shared_experts=1, moe_d_ff=48),
    ],
    ids=["mixtral_tiny", "gpt_moe_every2_shared"],
)
def test_counts_equal_the_built_model(cfg):
    model = build_model(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n = param_counts(MoEShape.of(cfg))
    assert (n["total"], n["expert"]) == (total, expert)


# the closed forms the planner's numbers are held against
def expert_params_per_rank(shape: MoEShape, ep: int, pp: int = 1) -> float:
    """Expert parameters one rank holds (``E / ep`` experts of its ``1/pp`` share of the MoE layers)."""
    s = MoEShape.of(shape)
    if s.moe_experts % ep:
        raise ValueError(f"ep={ep} does not divide moe_experts={s.moe_experts}")
    return param_counts(s)["expert"] / ep / pp


def expert_state_bytes_per_rank(
    shape: MoEShape, *, ep: int, dp: int, pp: int = 1, zero: int = 1, param_bytes: int = 2
) -> float:
    """Bytes of expert weights, fp32 gradients and AdamW states on one rank, sharded over ``edp = dp / ep``
    as ZeRO ``zero`` shards them (:func:`parallel.zero.theory.model_state_bytes`)."""
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    return zero_theory.model_state_bytes(expert_params_per_rank(shape, ep, pp), zero, dp // ep, param_bytes)["total"]


def all_to_all_seconds(payload_bytes: float, ep: int, bandwidth_bytes_per_s: float) -> float:
    """Time to move ``payload_bytes`` of all-to-all over ``ep`` ranks: each sends ``(ep-1)/ep`` of it."""
    return 0.0 if ep == 1 else payload_bytes * (ep - 1) / ep / bandwidth_bytes_per_s


def test_expert_state_shrinks_with_ep_and_edp():
    s = MoEShape.of(preset("mixtral_8x7b"))
    one = expert_state_bytes_per_rank(s, ep=1, dp=8, zero=1)
    assert expert_state_bytes_per_rank(s, ep=8, dp=8, zero=1) == pytest.approx(
        one / 8 * (2 + 4 + 12) / (2 + 4 + 12 / 8)
    )
    assert all_to_all_seconds(1e9, 1, 1e9) == 0 and all_to_all_seconds(1e9, 4, 1e9) == 0.75


T, D = 10, 12


def _bytes_rank(cfg):
    torch.manual_seed(0)
    layer = MoELayer(D, cfg.moe_config(), ep_group=dist.group.WORLD)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    counter = comm.CommCounter()
    with counter:
        layer(x).sum().backward()
    return counter.payload_bytes(op="all_to_all")


def test_all_to_all_bytes_equal_theory():
    cfg = preset("mixtral_tiny", n_layers=1, d_model=D, moe_experts=4, moe_top_k=2)
    got = run_ranks(_bytes_rank, 2, cfg, timeout=120)
    assert sum(got) == 2 * all_to_all_payload_bytes(MoEShape.of(cfg), T)  # every routed row out and back
    assert min(got) > 0


# ------------------------------------------------------------------ plan_layout / recommend with experts
def _plan(cfg, hw="a100_80gb", global_batch=64, **layout):
    from parallel.plan import Training, hardware_profile, plan_layout, resolve
    from recipes.tools.plan import meta_param_counter

    tr = Training(global_batch=global_batch, micro_batch=1, checkpointing="full")
    return plan_layout(cfg, resolve(cfg, **layout), tr, hardware_profile(hw), meta_param_counter(cfg))


def test_mixtral_8x7b_on_16_a100():
    from parallel.plan import hardware_profile

    """Mixtral-8x7B at dp=16 ep=8 ZeRO-1: two experts per rank, their optimizer state over edp=2;
    all-to-all bytes as the formula says; FLOPs (and MFU) from the 12.9B active parameters."""
    cfg = preset("mixtral_8x7b")
    s, n = MoEShape.of(cfg), param_counts(MoEShape.of(cfg))
    p = _plan(cfg, dp=16, ep=8, zero=1)
    r = p.ranks[0]
    dense = n["total"] - n["expert"]
    assert r.params.numel == dense + n["expert"] // 8  # vocabulary 32000 is already a multiple of 128
    experts = expert_state_bytes_per_rank(s, ep=8, dp=16, zero=1)  # the formula, unpadded
    assert r.memory["model_states"] == pytest.approx(dense * (2 + 4 + 12 / 16) + experts, rel=1e-6)
    assert p.fits and 60e9 < p.peak_memory < 86e9  # ≈ 81 GB of the 85.9 GB (80 GiB) A100
    m = 64 // 16  # micro-batches per step, 4096 tokens each; full recomputation repeats the forward's
    rows = 2 * 4096 * 4096 * 2  # top-2 × tokens × d × bf16
    payload = 32 * m * (2 * 8 * 8 + 2 * 2 * rows + 2 * rows)  # counts (twice), rows out/back (twice), backward
    assert r.traffic["ep"]["bytes"] == pytest.approx(payload * 7 / 8)
    assert all_to_all_payload_bytes(s, 4096, elem_bytes=2) * m * 7 / 8 < r.traffic["ep"]["bytes"]  # + recomputation
    assert p.step["model_flops_per_token"] == flops_per_token(cfg)
    assert p.step["params_active"] == n["active"] and p.step["params_total"] == n["total"]
    peak = hardware_profile("a100_80gb").peak_flops("bf16") / 1e12
    assert 0.3 < p.step["mfu"] < 0.7 and p.step["tflops_per_gpu"] == pytest.approx(p.step["mfu"] * peak, rel=1e-9)
    assert not _plan(cfg, dp=8, ep=8, zero=1).fits  # 46.7B × 16 B of states exceed 8 × 80 GB


@pytest.mark.parametrize(
    "layout, match",
    [
        (dict(dp=4, ep=3), r"ep 3 does not divide dp 4"),
        (dict(dp=6, ep=6), r"num_experts=4 is not divisible by ep=6"),
    ],
)
def test_planner_refuses_bad_ep(layout, match):
    from parallel.plan import PlanError

    with pytest.raises(PlanError, match=match):
        _plan(preset("mixtral_tiny"), hw="cpu", global_batch=12, **layout)


def test_recommend_picks_expert_parallelism_for_mixtral():
    from parallel.plan import Training, hardware_profile, recommend
    from recipes.tools.plan import meta_param_counter

    cfg = preset("mixtral_8x7b")
    tr = Training(global_batch=256, micro_batch=1)
    plans = recommend(
        cfg, 64, tr, hardware_profile("a100_80gb"), meta_param_counter(cfg),
        top=3, micro_batches=(1,), checkpointing=("full",), zeros=(1,),
    )  # fmt: skip
    assert plans and plans[0].layout["ep"] > 1, [p.layout for p in plans]


def test_moe_with_sequence_parallelism_is_planned_with_the_local_tokens():
    """tp=2 with SP: each tp rank routes s/2 tokens, so the ep all-to-alls carry half the rows of tp=2
    without SP; the router statistics (2E + 1 fp32) are all-reduced over tp once per MoE layer call."""
    from parallel.layers.moe import router_stats_numel

    cfg = preset("mixtral_8x7b")
    plain, sp = (_plan(cfg, dp=8, tp=2, ep=8, zero=1, sequence_parallel=on) for on in (False, True))
    counts = 32 * (64 // 8) * 2 * 8 * 8 * 7 / 8  # the count exchanges (twice: full recomputation) are the same
    sp_rows, plain_rows = (p.ranks[0].traffic["ep"]["bytes"] - counts for p in (sp, plain))
    assert sp_rows == pytest.approx(plain_rows / 2)
    stats = [i for i in sp.ranks[0].traffic["tp"]["items"] if i.startswith("MoE router statistics")]
    layers, m = 32, 64 // 8  # pp=1: all 32 MoE blocks, 8 micro-batches; full recomputation repeats the forward's
    assert stats == [f"MoE router statistics (forward): {2 * layers * m:g} × all_reduce of 0.0 MB"]
    assert router_stats_numel(8) == 2 * 8 + 1
    assert not [i for i in plain.ranks[0].traffic["tp"]["items"] if i.startswith("MoE router statistics")]
