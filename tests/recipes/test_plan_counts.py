"""The planner's numbers against the real model: parameter counts (meta device, and real
tensor-parallel ranks), activation bytes against the tensors autograd saves, the partition."""

import pytest
import torch

from models.config import preset
from models.transformer import build_model
from parallel.groups import build_groups
from parallel.pipeline.partition import stage_costs
from parallel.plan import ModelShape, PlanError, layer_partition, stage_activation_bytes
from parallel.plan.shape import layer_costs
from parallel.testing import run_ranks
from parallel.topology import Topology
from recipes.tools.plan import meta_param_counter


def _total(counter, cfg, pp=1, tp=1, vpp=1):
    """Σ over pipeline ranks of what their TP group holds, the tied head copy counted once."""
    ranges = layer_partition(ModelShape.of(cfg), pp, vpp)
    n = len(ranges)
    stages = [counter(r, v == 0, v == n - 1, tp) for v, r in enumerate(ranges)]
    return sum(s.full - s.tied_copy for s in stages), stages


def test_published_totals():
    gpt2 = preset("gpt2", vocab_multiple=1)  # vocabulary 50257, unpadded
    assert _total(meta_param_counter(gpt2), gpt2)[0] == 124_439_808
    # our default pads the vocabulary to a multiple of 128 (50304): 47 · 768 more
    assert _total(meta_param_counter(preset("gpt2")), preset("gpt2"))[0] == 124_439_808 + 47 * 768
    llama = preset("llama_7b")  # 32000 is already a multiple of 128
    assert _total(meta_param_counter(llama), llama)[0] == 6_738_415_616
    # Llama 3.1 8B and 70B: 8.03B and 70.6B published (the meta-llama/Llama-3.1-8B and -70B model pages on the
    # Hugging Face Hub); exactly 8,030,261,248 and 70,553,706,496 from their published configs (vocabulary
    # 128,256, untied), summed over the stages and TP ranks of a split layout (tp = 2 pads nothing: 501 · 256)
    for name, published, pp, tp in (("llama3_8b", 8_030_261_248, 4, 2), ("llama3_70b", 70_553_706_496, 8, 2)):
        cfg = preset(name)
        assert _total(meta_param_counter(cfg), cfg, pp=pp, tp=tp)[0] == published, name


@pytest.mark.parametrize("name", ["gpt2", "gpt_tiny", "llama_tiny"])
def test_per_rank_counts_sum_to_the_total(name):
    cfg = preset(name, n_layers=12)
    counter = meta_param_counter(cfg)
    checked = 0
    for tp in (1, 2, 4):
        if cfg.n_kv_heads % tp:
            continue
        whole = build_model(cfg.replace(vocab_multiple=cfg.vocab_multiple * tp), device="meta")
        expected = sum(p.numel() for p in whole.parameters())
        for pp, vpp in ((1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (12, 1), (2, 2), (3, 2), (2, 3)):
            try:
                total, stages = _total(counter, cfg, pp, tp, vpp)
            except PlanError as e:  # the balanced split cannot always be cut into vpp equal chunks
                assert "vpp" in str(e)
                continue
            assert total == expected, (tp, pp, vpp)
            for s in stages:  # the shard plus the replicated parameters rebuild the stage
                assert (s.numel - s.replicated) * tp + s.replicated == s.full
                zero_groups = [g for unit in s.blocks + (s.root,) for g in unit]
                assert sum(map(sum, zero_groups)) == s.numel  # ZeRO's bucket classes hold every parameter
            checked += 1
    assert checked >= 12


def _real_rank_counts(cfg, tp, sp, ranges):
    groups = build_groups(Topology(1, 1, tp))
    n = len(ranges)
    return [
        sum(
            p.numel()
            for p in build_model(
                cfg,
                tp_group=groups.tp,
                sequence_parallel=sp,
                layers=r,
                has_embedding=v == 0,
                has_head=v == n - 1,
                device="meta",
            ).parameters()
        )
        for v, r in enumerate(ranges)
    ]


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_counts_equal_a_real_tensor_parallel_rank(name):
    cfg = preset(name, n_layers=5, d_model=64)
    ranges = layer_partition(ModelShape.of(cfg), 3)
    counter = meta_param_counter(cfg)
    real = run_ranks(_real_rank_counts, 2, cfg, 2, True, ranges, timeout=60)
    predicted = [counter(r, v == 0, v == len(ranges) - 1, 2).numel for v, r in enumerate(ranges)]
    assert real[0] == real[1] == predicted


def test_gpt3_175b_on_35_stages_is_balanced_to_one_layer():
    shape = ModelShape.of(preset("gpt3_175b"))
    ranges = layer_partition(shape, 35)
    costs = stage_costs(ranges, **layer_costs(shape))
    assert sum(len(r) for r in ranges) == 96 and len(ranges) == 35
    assert max(costs) - min(costs) <= 1.0 + 1e-9
    assert {len(r) for r in ranges} == {2, 3}


def _saved_bytes(model, ids):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(model(ids), ids)
    return sum(seen.values())


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_activation_bytes_match_what_autograd_saves(name, precision, ckpt):
    cfg = preset(name, n_layers=3, d_model=64, seq_len=16, activation_checkpointing=ckpt)
    model = build_model(cfg, dtype=DTYPES[precision])
    measured = _saved_bytes(model, torch.randint(0, cfg.vocab_size, (4, 16)))
    predicted = stage_activation_bytes(
        ModelShape.of(cfg), 4, 3, has_embedding=True, has_head=True, checkpointing=ckpt, precision=precision
    )
    assert predicted == pytest.approx(measured, rel=0.02)


def _tp_saved(cfg, tp, sp):
    groups = build_groups(Topology(1, 1, tp))
    model = build_model(cfg, tp_group=groups.tp, sequence_parallel=sp)
    return _saved_bytes(model, torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("sp", [False, True])
def test_activation_bytes_on_tensor_parallel_ranks(sp):
    cfg = preset("llama_tiny", n_layers=2, d_model=64, seq_len=16)
    measured = run_ranks(_tp_saved, 2, cfg, 2, sp, timeout=60)
    predicted = stage_activation_bytes(
        ModelShape.of(cfg), 2, 2, has_embedding=True, has_head=True, tp=2, sequence_parallel=sp, precision="fp32"
    )
    for m in measured:
        assert predicted == pytest.approx(m, rel=0.15)
