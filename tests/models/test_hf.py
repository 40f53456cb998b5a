"""Hugging Face GPT-2 and Llama weights: same logits as transformers at tp=2, lossless round trip."""

import pytest
import torch

from models import build_model
from models.hf import config_from_hf, export_hf_state_dict, load_hf_weights, save_hf_safetensors
from parallel import comm
from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology

transformers = pytest.importorskip("transformers")


def _hf_model(arch):
    torch.manual_seed(11)
    if arch == "gpt2":
        c = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=8, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(c)
    else:
        c = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            max_position_embeddings=8,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = transformers.LlamaForCausalLM(c)
        with torch.no_grad():  # HF zero-initialises nothing we could hide behind, but make norms non-trivial
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
    return model.eval()


def _ids():
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(3))


def _load_rank(hf_config, source, sp):
    groups = build_groups(Topology(1, 1, 2))
    cfg = config_from_hf(hf_config)
    stage = load_hf_weights(
        build_model(cfg, tp_group=groups.tp, sequence_parallel=sp, device="meta").to_empty(device="cpu"),
        source,
        groups.tp,
    )
    logits = comm.all_gather_along(stage(_ids()).detach(), -1, groups.tp)[..., : cfg.vocab_size]
    exported = export_hf_state_dict(stage, groups.tp)
    # a pipeline's last stage alone (layers 1.. and the head) loads the same tensors
    last = load_hf_weights(
        build_model(cfg, tp_group=groups.tp, layers=range(1, 2), has_embedding=False), source, groups.tp
    )
    last_exported = export_hf_state_dict(last, groups.tp)
    return logits, exported, last_exported


@pytest.mark.parametrize("arch,sp", [("gpt2", False), ("llama", True)])
def test_hf_weights_at_tp2_give_transformers_logits_and_export_losslessly(arch, sp, tmp_path):
    hf = _hf_model(arch)
    with torch.no_grad():
        ref = hf(_ids()).logits
    state = {k: v for k, v in hf.state_dict().items()}
    source = state
    if arch == "llama":  # load from a folder as save_pretrained writes it
        hf.save_pretrained(tmp_path, safe_serialization=True)
        source = str(tmp_path)
    logits, exported, last_exported = run_ranks(_load_rank, 2, hf.config.to_dict(), source, sp)[0]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    expected = {k: v for k, v in state.items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    assert exported.keys() == expected.keys()
    for k in expected:
        assert torch.equal(exported[k], expected[k]), k
    for k, v in last_exported.items():
        assert torch.equal(v, state[k]), k
    assert any(".1." in k for k in last_exported) and not any(".0." in k for k in last_exported)


def test_export_reimport_roundtrip_through_safetensors(tmp_path):
    hf = _hf_model("gpt2")
    cfg = config_from_hf(hf.config)
    ours = build_model(cfg, seed=9)
    save_hf_safetensors(export_hf_state_dict(ours), str(tmp_path), hf.config.to_dict())
    back = load_hf_weights(build_model(cfg, seed=1), str(tmp_path))
    for (n, a), (_, b) in zip(ours.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), n
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, ours(_ids())[..., : cfg.vocab_size], atol=1e-5, rtol=0)


def test_mismatched_vocab_refused_with_shapes():
    hf = _hf_model("gpt2")
    cfg = config_from_hf(hf.config, vocab_size=90)
    with pytest.raises(ValueError, match=r"wte.weight has shape \(100, 32\)"):
        load_hf_weights(build_model(cfg), hf.state_dict())


def test_config_json_round_trips_for_both_architectures():
    from models.config import preset
    from models.hf import config_from_hf, hf_config_dict

    for name in ("gpt_tiny", "llama_tiny", "gpt2", "llama_7b"):
        cfg = preset(name)
        assert config_from_hf(hf_config_dict(cfg)) == cfg, name
