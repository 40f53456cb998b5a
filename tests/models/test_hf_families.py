"""Llama 3.1 (rope scaling, biases, head_dim ≠ d/h), Qwen2 (q/k/v biases), Qwen3 (QK-norm) and YaRN, each
loaded from a folder ``save_pretrained`` wrote: transformers' logits at tp 1 and 2, as one stage and as two
pipeline stages (Qwen3 MoE also at ep 2), lossless export, and ``from_pretrained`` of our export (odd sizes:
vocab 300, kv < heads)."""

import json

import pytest
import torch

from models import build_model
from models.hf import config_from_hf, export_hf_state_dict, hf_config_dict, load_hf_weights, save_hf_safetensors
from parallel import comm
from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 300, 12
COMMON = dict(
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short: the scaling bites at these positions
}
# YaRN (Qwen3's long-context configs): frequencies 2..6 of 8 sit on the ramp between kept and interpolated
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 4096}
# every optional key: the betas, no truncation, an explicit attention factor; a short original window puts
# the ramp (dims 0.6..2.0 of 6) where these positions turn
LLAMA_YARN = QWEN3_YARN | {
    "original_max_position_embeddings": 256,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "truncate": False,
    "attention_factor": 0.9,
}
FAMILIES = {
    "llama3.1": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **COMMON, head_dim=16, rope_parameters=LLAMA31_ROPE, attention_bias=True, mlp_bias=True
        )
    ),
    "llama-linear": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16)),
    "qwen3-yarn": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**COMMON | {"max_position_embeddings": 16384}, head_dim=16, rope_parameters=QWEN3_YARN)
    ),
    "llama-yarn": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON | {"max_position_embeddings": 1024}, rope_parameters=LLAMA_YARN)
    ),
    # six experts (not a power of two), the first layer dense, top-k weights not renormalised
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **COMMON, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0]
        )
    ),
}


def _hf(family, folder):
    torch.manual_seed(5)
    model = FAMILIES[family]().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _ours(folder, tp, ep=1):
    """Logits at tp × ep ranks as one stage and as two (layer 0 | layer 1, each stage built and loaded
    alone, run in turn); the whole model's export (gathering every expert over ep); at ep 1 the keys of
    the last stage's export."""
    groups = build_groups(Topology(ep, 1, tp, ep=ep))
    cfg = config_from_hf(json.loads(open(f"{folder}/config.json").read()))

    def stage(layers, **kw):
        built = build_model(cfg, tp_group=groups.tp, ep_group=groups.ep, layers=layers, device="meta", **kw)
        return load_hf_weights(built.to_empty(device="cpu"), folder, groups.tp)

    def gathered(h):
        return comm.all_gather_along(h.detach(), -1, groups.tp)[..., :VOCAB]

    whole = stage(range(2))
    logits = gathered(whole(_ids()))
    last = stage(range(1, 2), has_embedding=False)
    two_stages = gathered(last(stage(range(1), has_head=False)(_ids())))
    if ep > 1:
        return logits, two_stages, export_hf_state_dict(whole, groups.tp, groups.ep), None
    return logits, two_stages, export_hf_state_dict(whole, groups.tp), sorted(export_hf_state_dict(last, groups.tp))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_saved_folder_gives_transformers_logits_at_tp1_and_tp2_on_one_and_two_stages(family, tmp_path):
    """(tp, pp) in {1, 2}²; Qwen3 MoE also at ep 2 with each (tp, pp), each ep rank loading its own experts."""
    hf = _hf(family, tmp_path / "hf")
    with torch.no_grad():
        ref = hf(_ids()).logits
    state = hf.state_dict()
    for tp in (1, 2):
        logits, two_stages, exported, last_keys = run_ranks(_ours, tp, str(tmp_path / "hf"), tp, timeout=120)[0]
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(two_stages, ref, atol=1e-5, rtol=0)
        tied = hf.config.tie_word_embeddings
        assert exported.keys() == {k for k in state if not (tied and k == "lm_head.weight")}
        for k, v in exported.items():
            assert torch.equal(v, state[k]), (family, tp, k)
        assert last_keys and all(".0." not in k for k in last_keys)
    if family == "qwen3_moe":  # each ep rank loads its experts only; export at ep 2 (× tp 2) is ep 1's
        for tp in (1, 2):
            for logits, two_stages, exported, _ in run_ranks(_ours, 2 * tp, str(tmp_path / "hf"), tp, 2, timeout=120):
                torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
                torch.testing.assert_close(two_stages, ref, atol=1e-5, rtol=0)
                assert exported.keys() == state.keys()
                assert all(torch.equal(v, state[k]) for k, v in exported.items())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_our_export_loads_with_from_pretrained_and_the_config_round_trips(family, tmp_path):
    hf = _hf(family, tmp_path / "hf")
    cfg = config_from_hf(hf.config.to_dict())
    assert config_from_hf(hf_config_dict(cfg)) == cfg
    ours = build_model(cfg, seed=4)
    save_hf_safetensors(export_hf_state_dict(ours), str(tmp_path / "ours"), hf_config_dict(cfg))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(_ids()).logits, ours(_ids())[..., :VOCAB], atol=1e-5, rtol=0)
