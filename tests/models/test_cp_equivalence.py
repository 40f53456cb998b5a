"""Context parallelism computes the single-process model: loss and every gradient, GPT and Llama,
ring and Ulysses, with and without activation checkpointing (global positions, LSE merge, dK/dV ring)."""

import pytest
import torch
import torch.distributed as dist

from models import ModelConfig, build_model
from parallel import comm
from parallel.layers import cp_slice
from parallel.testing import run_ranks

GPT = ModelConfig(arch="gpt", n_layers=2, d_model=32, n_heads=4, vocab_size=200, seq_len=16)
LLAMA = ModelConfig(arch="llama", n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, d_ff=96, vocab_size=200, seq_len=16)
CASES = [(GPT, "ring", "none"), (GPT, "alltoall", "full"), (LLAMA, "ring", "selective"), (LLAMA, "alltoall", "none")]


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 200, (2, 16), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _reference(cfg):
    model = build_model(cfg, seed=3)
    ids, targets = _batch()
    loss = model.loss(model(ids), targets)
    loss.backward()
    return loss.item(), _grads(model)


def _cp_rank(cases):
    cp, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)), group_desc="cp")
    ids, targets = _batch()
    out = []
    for cfg, impl, ckpt in cases:
        model = build_model(cfg.replace(activation_checkpointing=ckpt), cp_group=group, cp_impl=impl, seed=3)
        loss = model.loss(model(cp_slice(ids, cp, r)), cp_slice(targets, cp, r))
        loss.backward()
        # the mean over all tokens: every cp rank holds the same number, so the mean of the ranks' means
        comm.all_reduce(loss := loss.detach().clone(), group=group)
        for p in model.parameters():
            comm.all_reduce(p.grad, group=group)
        out.append((loss.item() / cp, {n: g / cp for n, g in _grads(model).items()}))
    return out


@pytest.mark.parametrize("cp", [2])
def test_cp_model_matches_one_process(cp):
    refs = {cfg.arch: _reference(cfg) for cfg in (GPT, LLAMA)}
    results = run_ranks(_cp_rank, cp, CASES, timeout=120)[0]
    for (cfg, impl, ckpt), (loss, grads) in zip(CASES, results):
        ref_loss, ref_grads = refs[cfg.arch]
        assert loss == pytest.approx(ref_loss, abs=1e-6), (cfg.arch, impl, ckpt)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=f"{cfg.arch} {impl} {ckpt} {name}")
