"""ParallelSelfAttention without the causal mask and with an attention mask (encoders, ViT, padding):
its output and input gradient equal a plain softmax attention computed from the gathered full weights,
at tp=1 and tp=2."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.layers import LayerConfigError, ParallelSelfAttention, gather_full_tensor, init_parameters_
from parallel.testing import run_ranks

B, S, D, H, KV = 2, 6, 16, 4, 2


def _plain(x, w, causal, keep):
    """Softmax attention written out (no SDPA): ``keep`` [b, s] marks real tokens (None: all)."""
    hd = D // H
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).view(B, S, H, hd).transpose(1, 2)
    k = (x @ w["k_proj.weight"].T + w["k_proj.bias"]).view(B, S, KV, hd).transpose(1, 2)
    v = (x @ w["v_proj.weight"].T + w["v_proj.bias"]).view(B, S, KV, hd).transpose(1, 2)
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    allowed = torch.ones(B, 1, S, S, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    if keep is not None:
        allowed &= keep[:, None, None, :]
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, S, D) @ w["o_proj.weight"].T + w["o_proj.bias"]


def _keep():
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, 4:] = False  # sample 0: two padding tokens at the end
    keep[1, 5:] = False  # sample 1: one (right padding: causal rows always keep their first token)
    return keep


CASES = [(False, None), (False, "bool"), (False, "float"), (True, "bool")]


def _rank(group=None):
    out = {}
    for causal, mask in CASES:
        attn = ParallelSelfAttention(D, H, KV, tp_group=group, causal=causal)
        init_parameters_(attn, seed=3, tp_group=group)
        full = {n: gather_full_tensor(p, group) for n, p in attn.named_parameters()}
        x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(4), requires_grad=True)
        keep = _keep() if mask else None
        attn_mask = None if keep is None else keep[:, None, None, :]
        if mask == "float":
            attn_mask = torch.zeros(B, 1, 1, S).masked_fill(~attn_mask, float("-inf"))
        y = attn(x, attn_mask=attn_mask)
        y.square().sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        ref = _plain(x_ref, full, causal, keep)
        ref.square().sum().backward()
        out[causal, mask] = ((y - ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item())
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_non_causal_and_masked_attention_equal_a_plain_softmax(tp):
    results = [_rank()] if tp == 1 else run_ranks(lambda: _rank(dist.group.WORLD), tp, timeout=60)
    for res in results:
        for case, (dy, dx) in res.items():
            assert dy < 1e-5 and dx < 1e-4, (case, dy, dx)


def test_non_causal_differs_from_causal_and_equals_sdpa():
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    enc = ParallelSelfAttention(D, H, causal=False)
    dec = ParallelSelfAttention(D, H)
    dec.load_state_dict(enc.state_dict())
    assert not torch.allclose(enc(x), dec(x))  # the flag reaches the kernel
    qkv = [m(x).view(B, S, H, D // H).transpose(1, 2) for m in (enc.q_proj, enc.k_proj, enc.v_proj)]
    core = F.scaled_dot_product_attention(*qkv).transpose(1, 2).reshape(B, S, D)
    torch.testing.assert_close(enc(x), enc.o_proj(core))


def test_what_the_mask_cannot_do_is_refused():
    attn = ParallelSelfAttention(D, H)
    with pytest.raises(LayerConfigError, match="broadcast over the heads"):
        attn(torch.randn(B, S, D), attn_mask=torch.ones(B, H, S, S, dtype=torch.bool))
