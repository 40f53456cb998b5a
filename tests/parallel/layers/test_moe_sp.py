"""MoELayer under tensor + sequence parallelism (tp=2) against one process holding whole sequences.

Each TP rank routes its ``s/tp`` tokens of every sequence; summed over TP, the router's and the experts'
gradients (and the shared experts' row-parallel ones) equal one process's, the input gradient and output
are its slices, the aux losses (balance, z, sequence-wise) its values, and the aux-loss-free bias update
is the same bit for bit.
"""

import pytest
import torch
import torch.distributed as dist

from parallel.layers.moe import (
    SEQUENCE_PARALLEL_CAPACITY_REFUSED,
    MoEConfig,
    MoEConfigError,
    MoELayer,
    update_router_bias_,
)
from parallel.params import is_sequence_parallel, tp_shard_dim
from parallel.testing import run_ranks

B, S, D, TP = 2, 8, 16, 2

CASES = {
    "softmax_k2_shared_z": MoEConfig(8, 24, top_k=2, num_shared_experts=1, z_loss_weight=1e-2, aux_loss_weight=0.1),
    "sigmoid_groups_seq_aux": MoEConfig(
        8,
        20,
        top_k=2,
        score_func="sigmoid",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        bias_update_rate=0.01,
        seq_aux_loss_weight=0.1,
        aux_loss_weight=0.05,
        num_shared_experts=1,
    ),  # fmt: skip
}


def _run(cfg: MoEConfig, layer: MoELayer, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (layer(x) * g).sum().backward()
    return x.grad


def _case(cfg: MoEConfig, group) -> dict:
    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(B, S, D, generator=gen), torch.randn(B, S, D, generator=gen)
    torch.manual_seed(7)
    ref = MoELayer(D, cfg)
    torch.manual_seed(7)
    layer = MoELayer(D, cfg, tp_group=group, sequence_parallel=True)
    mine = slice(rank * S // TP, (rank + 1) * S // TP)
    ref_x_grad, x_grad = _run(cfg, ref, x, g), _run(cfg, layer, x[:, mine], g[:, mine])
    errs = {"x.grad": (x_grad - ref_x_grad[:, mine]).abs().max()}
    for key in ("aux_loss", "balance_loss", "z_loss"):
        errs[key] = (layer.last_stats[key] - ref.last_stats[key]).abs()
    refs = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad.clone()
        if is_sequence_parallel(p):  # replicated, a slice of the sequence each: summed over TP (ZeRO's job)
            dist.all_reduce(grad, group=group)
            want = refs[name].grad
        else:  # TP-sharded (the shared experts' column/row weights): this rank's slice
            want = refs[name].grad.chunk(TP, dim=tp_shard_dim(p))[rank]
        errs[name] = (grad - want).abs().max()
    update_router_bias_(ref)
    update_router_bias_(layer, (group,))
    bias_equal = ref.e_score_correction_bias is None or torch.equal(
        ref.e_score_correction_bias, layer.e_score_correction_bias
    )
    moved = ref.e_score_correction_bias is None or bool(ref.e_score_correction_bias.abs().sum() > 0)
    marked = all(is_sequence_parallel(p) for p in (layer.router.weight, *layer.experts.parameters()))
    return {"errs": {k: float(v) for k, v in errs.items()}, "bias_equal": bias_equal, "moved": moved, "marked": marked}


def _all(_world: int) -> dict:
    return {name: _case(cfg, dist.group.WORLD) for name, cfg in CASES.items()}


def test_moe_under_sequence_parallelism_equals_one_process():
    for res in run_ranks(_all, TP, TP, timeout=240):
        for name, r in res.items():
            bad = {k: v for k, v in r["errs"].items() if v > 1e-5}
            assert not bad, f"{name}: {bad}"
            assert r["bias_equal"] and r["moved"] and r["marked"], (name, r)


def test_capacity_under_sequence_parallelism_is_refused():
    def build(_):
        with pytest.raises(MoEConfigError, match="sequence parallelism routes dropless only"):
            MoELayer(D, MoEConfig(4, 8, capacity_factor=1.0), tp_group=dist.group.WORLD, sequence_parallel=True)
        return SEQUENCE_PARALLEL_CAPACITY_REFUSED

    assert run_ranks(build, 2, 2, timeout=60)[0].startswith("MoE with sequence parallelism")
