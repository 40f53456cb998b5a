"""The plain PyTorch GPT the suite hands to PyTorch's wrappers computes what ours computes."""

import pytest
import torch

from benchmarks.gpt import PlainGPT, plain_like_ours, plain_loss, suite_model, suite_recipe
from models.transformer import build_model


def test_plain_gpt_matches_ours_loss_and_gradients():
    rc = suite_recipe(quick=True)
    cfg = suite_model(rc)
    ours = build_model(cfg, seed=rc.train.seed)
    plain = plain_like_ours(cfg, rc.train.seed)
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in ours.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    a, b = ours.loss(ours(x), y), plain_loss(plain(x), y)
    a.backward()
    b.backward()
    assert b.item() == pytest.approx(a.item(), abs=1e-5)
    ours_grads = dict(ours.named_parameters())
    assert torch.allclose(plain.blocks["1"].fc_in.weight.grad, ours_grads["blocks.1.mlp.fc_in.weight"].grad, atol=1e-6)
    assert torch.allclose(plain.tok_embed.weight.grad, ours_grads["tok_embed.weight"].grad, atol=1e-6)


def test_plain_stages_compose_to_the_whole_model():
    rc = suite_recipe(quick=True)
    cfg = suite_model(rc)
    whole = plain_like_ours(cfg, rc.train.seed)
    first = plain_like_ours(cfg, rc.train.seed, range(0, 2), has_head=False)
    last = plain_like_ours(cfg, rc.train.seed, range(2, 4), has_embedding=False)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    assert torch.allclose(last(first(x)), whole(x), atol=1e-5)


def test_plain_gpt_refuses_what_it_cannot_mirror():
    with pytest.raises(ValueError, match="tie_embeddings=True"):
        PlainGPT(suite_model(suite_recipe()).replace(tie_embeddings=True))


@pytest.mark.parametrize("size,params", [("small", 0.87e6), ("medium", 3.3e6), ("large", 25.6e6)])
def test_suite_sizes_have_the_parameter_counts_they_claim(size, params):
    cfg = suite_model(suite_recipe(size=size))
    with torch.device("meta"):
        n = sum(p.numel() for p in PlainGPT(cfg).parameters())
    assert n == pytest.approx(params, rel=0.01)
    with pytest.raises(ValueError, match="unknown size"):
        suite_recipe(size="huge")
