"""DeepSeek-V3's router pieces without processes: the aux-loss-free bias update (sign of the load's
deviation, no gradient) and the sequence-wise balance loss against a per-sequence loop."""

import torch

from parallel.layers.moe import MoEConfig, MoELayer, update_router_bias_
from parallel.layers.moe_routing import route, sequence_aux_loss

CFG = MoEConfig(num_experts=4, d_ff=8, top_k=2, score_func="sigmoid", n_group=2, topk_group=1, bias_update_rate=0.1)


def test_the_bias_moves_by_the_sign_of_the_load_and_only_in_the_update():
    layer = MoELayer(6, CFG)
    x = torch.randn(3, 5, 6, requires_grad=True)
    layer(x).sum().backward()
    assert torch.equal(layer.e_score_correction_bias, torch.zeros(4))  # forward and backward leave it
    layer.load_sum = torch.tensor([5, 1, 3, 3])  # mean 3: over-, under-, evenly loaded
    update_router_bias_(layer)
    assert torch.equal(layer.e_score_correction_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert layer.load_sum is None
    update_router_bias_(layer)  # no tokens since: no change
    assert torch.equal(layer.e_score_correction_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    # group-limited: with one of two groups allowed, a token's experts share a group
    layer.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # group 1 always wins
    assert (route(layer.router(torch.randn(20, 6)), CFG, layer.e_score_correction_bias).experts >= 2).all()


def test_sequence_aux_loss_equals_the_per_sequence_formula():
    cfg = MoEConfig(num_experts=6, d_ff=8, top_k=3, score_func="sigmoid")
    r = route(torch.randn(4 * 7, 6, generator=torch.Generator().manual_seed(0)), cfg)
    per_seq = []
    for b in range(4):
        experts, probs = r.experts[b * 7 : (b + 1) * 7], r.probs[b * 7 : (b + 1) * 7]
        f = torch.stack([(experts == e).sum() for e in range(6)]).float() * 6 / (3 * 7)
        per_seq.append((f * probs.mean(0)).sum())
    torch.testing.assert_close(sequence_aux_loss(r, cfg, batch=4), torch.stack(per_seq).mean())
