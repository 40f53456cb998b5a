"""Multi-head latent attention under context parallelism: DeepSeek tiny at cp=2, Ulysses and the ring,
dense (MoE off) and whole (routed and shared experts, a dense first layer), with a q latent and a plain
q projection, the core recomputed or not, YaRN rope scaling (its mscale² in the softmax scale) and packed
documents, trains as one process over three fp32 AdamW steps: the same losses, first-step gradients and
final weights (the decoupled rotary parts at their global positions, v narrower than q and k)."""

import pytest
import torch
import torch.distributed as dist

from models import build_model
from models.config import preset
from parallel import comm
from parallel.layers import cp_slice
from parallel.testing import run_ranks

from .test_mla_sequence_parallel import assert_trains_alike

STEPS, SEQ = 3, 16
DENSE = preset("deepseek_tiny", moe_experts=0, seq_len=SEQ, n_layers=2, tie_embeddings=False)
FULL = preset("deepseek_tiny", seq_len=SEQ, tie_embeddings=False)  # 3 layers: a dense one, then experts
PLAIN_Q = DENSE.replace(q_lora_rank=0, qkv_bias=True, o_bias=True, activation_checkpointing="selective")
YARN = DENSE.replace(rope_type="yarn")  # DeepSeek-V3's scaling: softmax scale × yarn_mscale(40)² ≈ 1.87
# name: (config, cp_impl, packed documents)
VARIANTS = {
    "dense_alltoall": (DENSE, "alltoall", False),
    "dense_ring": (DENSE, "ring", False),
    "plain_q_selective_alltoall": (PLAIN_Q, "alltoall", False),
    "plain_q_selective_ring": (PLAIN_Q, "ring", False),
    "full_alltoall": (FULL, "alltoall", False),
    "full_ring": (FULL, "ring", False),
    "yarn_alltoall": (YARN, "alltoall", False),
    "yarn_ring": (YARN, "ring", False),
    "documents_alltoall": (DENSE, "alltoall", True),
    "documents_ring": (DENSE, "ring", True),
}
# each window's positions: documents restarting mid-window (a chunk boundary falls inside one)
POSITIONS = torch.tensor(
    [[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6], [3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 0, 1, 2]]
)


def _batch(step, cfg):
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _train(cfg, impl, documents):
    """Losses of STEPS AdamW steps (the mean over all tokens), the first step's gradients and the last
    weights, on one process or as cp rank ``r`` of the world (the cp group)."""
    cp = dist.get_world_size() if dist.is_initialized() else 1
    r, group = (dist.get_rank(), dist.new_group(list(range(cp)))) if cp > 1 else (0, None)
    model = build_model(cfg, cp_group=group, cp_impl=impl, seed=3)
    # lr 1e-3: Adam turns ~1e-8 of gradient noise on near-zero gradients (unseen embedding rows) into ~lr
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], None
    for step in range(STEPS):
        ids, targets = _batch(step, cfg)
        logits = model(cp_slice(ids, cp, r), positions=POSITIONS if documents else None)
        loss = model.loss(logits, cp_slice(targets, cp, r))
        loss.backward()
        loss = loss.detach().clone()
        if cp > 1:  # every cp rank holds as many tokens: the mean over all is the mean of the ranks' means
            comm.all_reduce(loss, group=group)
            for p in model.parameters():
                comm.all_reduce(p.grad, group=group)
                p.grad.div_(cp)
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss / cp)
    return torch.stack(losses), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mla_at_cp2_trains_as_one_process(variant):
    cfg, impl, documents = VARIANTS[variant]
    ref = _train(cfg, impl, documents)
    for got in run_ranks(_train, 2, cfg, impl, documents, timeout=120):
        assert_trains_alike(got, ref)
