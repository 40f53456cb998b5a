"""Hugging Face Mixtral: random weights, odd sizes; our logits equal transformers' at ep 1 and 2; round trip."""

import pytest
import torch

from models import build_model
from models.hf import config_from_hf, export_hf_state_dict, hf_config_dict, load_hf_weights
from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology

transformers = pytest.importorskip("transformers")
MixtralConfig = getattr(transformers, "MixtralConfig", None)
if MixtralConfig is None:
    pytest.skip("this transformers has no Mixtral", allow_module_level=True)


def _hf():
    torch.manual_seed(5)
    c = MixtralConfig(
        vocab_size=101,
        hidden_size=24,
        intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        sliding_window=None,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.MixtralForCausalLM(c).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.3) if "norm" not in n else p.uniform_(0.5, 1.5)
    return model


def _ids():
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))


def _ours(hf, ep_group=None, source=None):
    cfg = config_from_hf(hf.config)
    stage = build_model(cfg, device="meta", ep_group=ep_group).to_empty(device="cpu")
    return load_hf_weights(stage, hf.state_dict() if source is None else source)


@pytest.mark.parametrize("from_folder", [True, False])
def test_mixtral_logits_and_round_trip(tmp_path, from_folder):
    """From the folder save_pretrained writes (the Hub's per-expert names on disk) and from the
    in-memory state dict (transformers ≥ 5's stacked experts); our export loads with from_pretrained."""
    from models.hf import save_hf_safetensors

    hf = _hf()
    with torch.no_grad():
        want = hf(_ids()).logits
    if from_folder:
        hf.save_pretrained(tmp_path / "hf")
    ours = _ours(hf, source=str(tmp_path / "hf") if from_folder else None)
    assert ours.cfg.moe_experts == 4 and ours.cfg.moe_top_k == 2
    got = ours(_ids()).detach()[..., :101]
    assert (got - want).abs().max() < 1e-5
    exported = export_hf_state_dict(ours)
    ref = hf.state_dict()
    assert set(exported) == set(ref)
    assert all(torch.equal(exported[k], ref[k]) for k in ref)
    assert config_from_hf(hf_config_dict(ours.cfg)) == ours.cfg
    save_hf_safetensors(exported, str(tmp_path / "ours"), hf_config_dict(ours.cfg))
    back = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    with torch.no_grad():
        assert (back(_ids()).logits - want).abs().max() < 1e-5


def _ep_rank(want, folder):
    groups = build_groups(Topology(dp=2, ep=2))
    ours = _ours(_hf(), groups.ep, folder)
    assert ours.blocks["0"].mlp.experts.gate_proj.shape[0] == 2  # this rank's half of the experts
    with pytest.raises(ValueError, match="split over ep=2: pass that ep group"):
        export_hf_state_dict(ours)
    return float((ours(_ids()).detach()[..., :101] - want).abs().max()), export_hf_state_dict(ours, None, groups.ep)


def test_mixtral_logits_and_export_at_ep2_from_a_saved_folder(tmp_path):
    """Each ep rank loads its experts; the export gathers them all: ep 1's state dict, which
    from_pretrained loads."""
    from models.hf import save_hf_safetensors

    hf = _hf()
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(_ids()).logits
    ref = hf.state_dict()
    for diff, exported in run_ranks(_ep_rank, 2, want, str(tmp_path / "hf"), timeout=120):
        assert diff < 1e-5
        assert set(exported) == set(ref) and all(torch.equal(exported[k], ref[k]) for k in ref)
    save_hf_safetensors(exported, str(tmp_path / "ours"), hf_config_dict(config_from_hf(hf.config)))
    back = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    with torch.no_grad():
        assert (back(_ids()).logits - want).abs().max() < 1e-5
