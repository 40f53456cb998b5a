"""DeepSeek-V3 (MLA, sigmoid group-limited routing with a selection bias, shared experts, a dense first
layer; YaRN, which scales the softmax too) loaded from a folder ``save_pretrained`` wrote: transformers'
logits at (tp, pp, ep) = (1,1,1), (2,1,1), (1,2,1) and (2,2,2); lossless export; ``from_pretrained`` of our export;
the refusals (odd sizes: vocab 250, 6 experts in 3 groups, v_head_dim ≠ qk head dim)."""

import json

import pytest
import torch

from models import build_model
from models.config import ModelConfigError
from models.hf import config_from_hf, export_hf_state_dict, hf_config_dict, load_hf_weights, save_hf_safetensors
from parallel import comm
from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip("this transformers has no DeepSeek-V3", allow_module_level=True)
VOCAB, SEQ, LAYERS = 250, 12, 3
SHAPE = dict(
    hidden_size=48,
    intermediate_size=40,
    moe_intermediate_size=12,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=6,
    routed_scaling_factor=2.5,
    kv_lora_rank=24,
    qk_rope_head_dim=4,
    v_head_dim=6,
    qk_nope_head_dim=8,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    num_mtp_layers=0,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
# DeepSeek-V3's published YaRN keys (factor 40 from a 4k window), mscale ≠ mscale_all_dim so that both the
# rotary attention factor and the softmax's mscale² differ from 1; the short window puts the ramp on these positions
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}  # fmt: skip
VARIANTS = {
    "v3": dict(q_lora_rank=20, n_group=3, topk_group=2),  # q latent, interleaved rope, group-limited
    "yarn": dict(q_lora_rank=20, n_group=3, topk_group=2, rope_parameters=YARN, max_position_embeddings=1280),
    # a plain q projection, rotate-half rope, one group, weights not renormalised, attention biases
    "plain_q": dict(
        q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False, attention_bias=True
    ),  # fmt: skip
}


def _hf(variant, folder):
    torch.manual_seed(5)
    config = transformers.DeepseekV3Config(**SHAPE | VARIANTS[variant])
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias") or "gate.weight" in n:
                p.normal_(0, 0.3)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # selection differs from the scores' own top-k
                b.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _ours(folder, tp=1, ep=1, pp=1):
    """Logits of the folder's model at tp × ep ranks, the layers split over ``pp`` stages run in turn."""
    groups = build_groups(Topology(ep, 1, tp, ep=ep)) if tp * ep > 1 else None
    tp_group, ep_group = (groups.tp, groups.ep) if groups else (None, None)
    cfg = config_from_hf(json.loads(open(f"{folder}/config.json").read()))
    cuts = [0, 2, LAYERS] if pp == 2 else [0, LAYERS]
    h = _ids()
    for s, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        stage = build_model(cfg, tp_group=tp_group, ep_group=ep_group, layers=range(lo, hi), device="meta",
                            has_embedding=s == 0, has_head=hi == LAYERS)  # fmt: skip
        h = load_hf_weights(stage.to_empty(device="cpu"), folder, tp_group)(h)
    return comm.all_gather_along(h.detach(), -1, tp_group)[..., :VOCAB]


def _export(folder, tp, ep):
    """Our export of the folder's model loaded at tp × ep ranks (each rank holds its experts only)."""
    groups = build_groups(Topology(ep, 1, tp, ep=ep))
    cfg = config_from_hf(json.loads(open(f"{folder}/config.json").read()))
    stage = build_model(cfg, tp_group=groups.tp, ep_group=groups.ep, device="meta").to_empty(device="cpu")
    return export_hf_state_dict(load_hf_weights(stage, folder, groups.tp), groups.tp, groups.ep)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    hf = _hf(request.param, folder)
    with torch.no_grad():
        return request.param, str(folder), hf, hf(_ids()).logits


def test_a_saved_folder_gives_transformers_logits_on_the_grid(saved):
    variant, folder, _, ref = saved
    torch.testing.assert_close(_ours(folder), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(_ours(folder, pp=2), ref, atol=1e-5, rtol=0)
    for logits in run_ranks(_ours, 2, folder, 2, timeout=120):  # tp 2 alone: MLA's heads (either q) split
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    if variant != "plain_q":  # tp 2 splits the heads, ep 2 the experts (each rank loads its own), 2 stages
        for logits in run_ranks(_ours, 4, folder, 2, 2, 2, timeout=120):
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_export_is_lossless_and_loads_with_from_pretrained(saved, tmp_path):
    variant, folder, hf, _ = saved
    cfg = config_from_hf(hf.config.to_dict())
    assert config_from_hf(hf_config_dict(cfg)) == cfg
    state = hf.state_dict()
    exports = [export_hf_state_dict(load_hf_weights(build_model(cfg), folder))]
    if variant == "v3":  # every global expert gathered over ep, the heads over tp: (1,1,1)'s export
        exports += run_ranks(_export, 4, folder, 2, 2, timeout=120)
    for exported in exports:
        assert exported.keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in exported.items())
    if variant == "plain_q":
        return  # one from_pretrained round trip without YaRN is enough
    ours = build_model(cfg, seed=4)
    ours.blocks["2"].mlp.e_score_correction_bias.normal_(0, 0.1)  # the bias travels too
    save_hf_safetensors(export_hf_state_dict(ours), str(tmp_path / "ours"), hf_config_dict(cfg))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(_ids()).logits, ours(_ids())[..., :VOCAB], atol=1e-5, rtol=0)


def test_unknown_rope_is_refused_and_mtp_layers_are_ignored_with_a_warning(saved):
    c = saved[2].config.to_dict()
    with pytest.warns(UserWarning, match="num_nextn_predict_layers=1: the multi-token prediction layers are ignored"):
        config_from_hf(c | {"num_nextn_predict_layers": 1})
    with pytest.raises(ModelConfigError, match="rope_type 'dynamic' is not supported"):
        config_from_hf(c | {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}})


def test_yarn_scales_the_softmax_by_mscale_all_dim_squared(saved):
    """Without the softmax's mscale² (transformers' ``yarn_apply_mscale``) the logits move (the parity
    test above holds it; this shows the variant exercises it)."""
    variant, folder, _, ref = saved
    if variant != "yarn":
        pytest.skip("the YaRN variant only")
    cfg = config_from_hf(json.loads(open(f"{folder}/config.json").read()))
    assert cfg.rope_type == "yarn" and cfg.rope_factor == 40.0 and cfg.rope_mscale_all_dim == 0.707
    plain = load_hf_weights(build_model(cfg), folder)
    for block in plain.blocks.values():
        block.attn.scale = cfg.qk_head_dim**-0.5  # the softmax scale without mscale²
    with torch.no_grad():
        assert (plain(_ids())[..., :VOCAB] - ref).abs().max() > 1e-3
