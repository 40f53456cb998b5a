"""Multi-head latent attention under sequence parallelism: DeepSeek tiny's attention (dense MLP: MoE
under SP is another layer's matter) at tp 2 + SP trains as one process over three fp32 AdamW steps,
with a q latent and with a plain q projection, the core recomputed or not."""

import pytest
import torch

from models import build_model, gather_full_state_dict
from models.config import preset
from parallel.groups import build_groups
from parallel.layers import reduce_sequence_parallel_grads
from parallel.testing import run_ranks
from parallel.topology import Topology

STEPS = 3
CFG = preset("deepseek_tiny", moe_experts=0, seq_len=12, n_layers=2, tie_embeddings=False)
VARIANTS = {
    "q_latent": CFG,
    "plain_q_selective": CFG.replace(q_lora_rank=0, qkv_bias=True, o_bias=True, activation_checkpointing="selective"),
}


def _batch(step):
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _train(cfg, tp):
    """Losses of STEPS AdamW steps, the first step's full gradients and the last full weights."""
    tp_group = build_groups(Topology(1, 1, tp)).tp if tp > 1 else None
    model = build_model(cfg, tp_group=tp_group, sequence_parallel=tp > 1, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(STEPS):
        ids, targets = _batch(step)
        loss = model.loss(model(ids), targets)
        loss.backward()
        reduce_sequence_parallel_grads(model, tp_group)  # the replicated down-projections' and norms' grads
        grads = grads or gather_full_state_dict(model, tp_group, grads=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())  # the whole batch's mean on every TP rank
    return torch.stack(losses), grads, gather_full_state_dict(model, tp_group)


def assert_trains_alike(got, ref) -> None:
    """``(losses, first gradients, last weights)`` of a parallel run against one process's."""
    (losses, grads, weights), (ref_losses, ref_grads, ref_weights) = got, ref
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=0, msg=name)
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mla_at_tp2_with_sequence_parallelism_trains_as_one_process(variant):
    cfg = VARIANTS[variant]
    ref = _train(cfg, 1)
    for got in run_ranks(_train, 2, cfg, 2, timeout=120):
        assert_trains_alike(got, ref)
