"""Stage contract: pipeline splits, tied embeddings, checkpointing, config validation, meta sizes."""

import pytest
import torch

from models import ModelConfig, ModelConfigError, build_model, gather_full_state_dict, preset
from parallel.params import is_shared_embedding

CFG = ModelConfig(arch="gpt", n_layers=4, d_model=32, n_heads=4, vocab_size=100, seq_len=8)
LLAMA = ModelConfig(
    arch="llama",
    n_layers=3,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    vocab_size=100,
    seq_len=8,
    tie_embeddings=False,
)


def _ids(seed=0):
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt", "llama"])
def test_pipeline_split_has_global_names_same_weights_and_same_logits(cfg):
    full = build_model(cfg, seed=4)
    cut = 2
    first = build_model(cfg, seed=4, layers=range(0, cut), has_head=False)
    last = build_model(cfg, seed=4, layers=range(cut, cfg.n_layers), has_embedding=False)
    assert list(last.blocks.keys()) == [str(i) for i in range(cut, cfg.n_layers)]
    ref = gather_full_state_dict(full)
    for stage in (first, last):
        for name, t in gather_full_state_dict(stage).items():
            key = "tok_embed.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name
            assert torch.equal(t, ref[key]), name
    ids = _ids()
    torch.testing.assert_close(last(first(ids)), full(ids), atol=0, rtol=0)


def test_tied_embeddings_shared_on_one_stage_and_marked_across_stages():
    full = build_model(CFG)
    assert full.lm_head.weight is full.tok_embed.weight
    assert not is_shared_embedding(full.tok_embed.weight)
    first = build_model(CFG, layers=range(0, 2), has_head=False)
    last = build_model(CFG, layers=range(2, 4), has_embedding=False)
    assert is_shared_embedding(first.tok_embed.weight) and is_shared_embedding(last.lm_head.weight)
    untied = build_model(CFG.replace(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_embed.weight
    assert not torch.equal(untied.lm_head.weight, untied.tok_embed.weight)


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_gives_the_same_gradients(cfg, mode):
    grads = {}
    for m in ("none", mode):
        model = build_model(cfg.replace(activation_checkpointing=m), seed=2)
        ids = _ids(1)
        model.loss(model(ids), ids).backward()
        grads[m] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads[mode][name], g, atol=1e-6, rtol=0, msg=name)


def test_full_checkpointing_stores_fewer_activations():
    def saved_bytes(mode):
        model = build_model(CFG.replace(activation_checkpointing=mode))
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss(model(_ids()), _ids())
        return total

    none, selective, full = saved_bytes("none"), saved_bytes("selective"), saved_bytes("full")
    assert full < selective < none


@pytest.mark.parametrize(
    "change,tp,needle",
    [
        (dict(n_heads=2, n_kv_heads=2), 4, "n_heads 2 is not divisible by tp 4"),
        (dict(n_kv_heads=2), 4, "n_kv_heads 2 cannot be split over tp 4"),
        (dict(n_heads=3), 1, "d_model 32 is not divisible by n_heads 3"),
        (dict(d_ff=90), 4, "d_ff 90 is not divisible by tp 4"),
        (dict(arch="bert"), 1, "arch 'bert'"),
        (dict(activation_checkpointing="some"), 1, "activation_checkpointing 'some'"),
        (dict(n_layers=0), 1, "n_layers must be ≥ 1"),
    ],
)
def test_config_errors_name_the_numbers(change, tp, needle):
    with pytest.raises(ModelConfigError, match=needle):
        CFG.replace(**change).validate(tp=tp)


def test_bad_inputs_refused():
    model = build_model(CFG)
    with pytest.raises(ModelConfigError, match="exceeds the model's seq_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ModelConfigError, match=r"token ids \[batch, seq\]"):
        model(torch.zeros(8, dtype=torch.long))
    middle = build_model(CFG, layers=range(1, 2), has_embedding=False, has_head=False)
    with pytest.raises(ModelConfigError, match=r"hidden \[batch, seq, 32\]"):
        middle(torch.zeros(2, 8, 16))
    with pytest.raises(ModelConfigError, match="inside"):
        build_model(CFG, layers=range(3, 6))
    with pytest.raises(ModelConfigError, match="has_head"):
        middle.loss(torch.zeros(1), torch.zeros(1))


@pytest.mark.parametrize("name,params", [("gpt2", 124.44e6), ("gpt3_175b", 174.6e9), ("llama_7b", 6.738e9)])
def test_presets_build_on_meta_with_the_published_sizes(name, params):
    cfg = preset(name)
    model = build_model(cfg, device="meta")
    unpadded = sum(p.numel() for p in model.parameters()) - (cfg.padded_vocab() - cfg.vocab_size) * cfg.d_model * (
        1 if cfg.tie_embeddings else 2
    )
    assert unpadded == pytest.approx(params, rel=2e-3)
    assert cfg.padded_vocab(8) % (128 * 8) == 0


def test_meta_then_to_empty_keeps_marks_and_tie():
    stage = build_model(CFG, device="meta").to_empty(device="cpu")
    assert stage.lm_head.weight is stage.tok_embed.weight
    assert stage.tok_embed.weight.tp_shard_dim == 0 and stage.tok_embed.weight.vocab_size == 100
    assert stage.blocks["0"].attn.o_proj.weight.tp_shard_dim == 1
    assert stage.blocks["0"].attn.o_proj.bias.no_weight_decay


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt", "llama"])
def test_bf16_stage_trains_with_bf16_grads_and_nearly_the_fp32_loss(cfg):
    ids = _ids(5)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(cfg, dtype=dtype, seed=6)
        loss = model.loss(model(ids), ids)
        loss.backward()
        assert loss.dtype == torch.float32  # the cross-entropy accumulates in fp32
        assert all(p.grad.dtype == dtype for p in model.parameters())
        losses[dtype] = loss.item()
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], abs=2e-2)


def test_changing_a_preset_re_derives_what_it_derived():
    from models.config import preset

    assert preset("gpt_tiny", d_model=256).d_ff == 1024
    assert preset("gpt_tiny", n_heads=8).n_kv_heads == 8
    assert preset("llama_tiny", n_heads=8).n_kv_heads == 2  # set explicitly by the preset: kept
    assert preset("llama_tiny", d_model=64).d_ff == 352  # likewise
    assert preset("gpt_tiny", d_model=256, d_ff=300).d_ff == 300
