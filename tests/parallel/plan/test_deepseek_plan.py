"""The planner's DeepSeek-V3 / Qwen3-MoE numbers: published parameter counts (total and active), the
closed form against the built model (benchmarks/deepseek_flops.py holds FLOPs per token against
torch's FLOP counter), and MLA's activation bytes against what autograd saves (at tp 2 + SP too)."""

import pytest
import torch

from models.config import preset
from models.transformer import build_model
from parallel.groups import build_groups
from parallel.plan import ModelShape, stage_activation_bytes
from parallel.plan.moe import MoEShape, param_counts
from parallel.testing import run_ranks
from parallel.topology import Topology


@pytest.mark.parametrize(
    "name, total, active",
    [("deepseek_v3", 671.0, 37.0), ("qwen3_30b_a3b", 30.5, 3.3)],  # DeepSeek-AI; Qwen (published, in billions)
)
def test_published_totals_and_the_built_model(name, total, active):
    cfg = preset(name, vocab_multiple=1)  # the vocabulary unpadded, as published
    n = param_counts(MoEShape.of(cfg))
    assert n["total"] / 1e9 == pytest.approx(total, abs=0.05)
    assert n["active"] / 1e9 == pytest.approx(active, abs=0.6 if name == "deepseek_v3" else 0.06)
    model = build_model(cfg, device="meta")
    built = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert (n["total"], n["expert"]) == (built, experts)
    assert n["active"] == built - experts + experts * cfg.moe_top_k // cfg.moe_experts  # k of E experts per token


def _saved_and_predicted(precision, ckpt, tp=1, sp=False):
    """What autograd saves on this rank for one micro-batch of a dense DeepSeek tiny, and the plan's figure."""
    # dense (the MoE blocks' bytes are test_moe_plan's), v as wide as q·k: torch's fused CPU kernel runs
    cfg = preset("deepseek_tiny", moe_experts=0, d_model=64, seq_len=16, v_head_dim=12, activation_checkpointing=ckpt)
    tp_group = build_groups(Topology(1, 1, tp)).tp if tp > 1 else None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = build_model(cfg, dtype=dtype, tp_group=tp_group, sequence_parallel=sp)
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(model(ids), ids)
    predicted = stage_activation_bytes(
        ModelShape.of(cfg), 4, 3, has_embedding=True, has_head=True, checkpointing=ckpt, precision=precision,
        tp=tp, sequence_parallel=sp,
    )  # fmt: skip
    return sum(seen.values()), predicted


@pytest.mark.parametrize(
    "precision, ckpt", [("fp32", "none"), ("fp32", "selective"), ("fp32", "full"), ("bf16", "none")]
)
def test_mla_activation_bytes_match_what_autograd_saves(precision, ckpt):
    saved, predicted = _saved_and_predicted(precision, ckpt)
    assert predicted == pytest.approx(saved, rel=0.02)


@pytest.mark.parametrize("ckpt", ["none", "selective"])
def test_mla_activation_bytes_under_sequence_parallelism(ckpt):
    """At tp 2 + SP the replicated latents are the rank's half of the tokens (the plan said the whole: +12%)."""
    for saved, predicted in run_ranks(_saved_and_predicted, 2, "fp32", ckpt, 2, True, timeout=120):
        assert predicted == pytest.approx(saved, rel=0.02)
