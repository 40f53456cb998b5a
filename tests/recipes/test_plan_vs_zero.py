"""Predicted model states and DP bytes against the ZeRO engine's own buffers and traffic.

Runs once ``parallel.zero`` is merged (skipped before): dp=3 so that ZeRO pads its
buckets, tiny buckets so that a block spans several."""

import pytest
import torch

from parallel import comm
from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology
from recipes.config import model_config
from recipes.tools.plan import plan_from_config
from recipes.tools.plan_scenarios import scenario_config

zero = pytest.importorskip("parallel.zero")


def _zero_step(rc, stage):
    from models.transformer import build_model

    groups = build_groups(Topology(3, 1, 1))
    cfg = model_config(rc.model)
    model = build_model(cfg, seed=0)
    z = zero.ZeroDataParallel(
        model,
        zero.ZeroConfig(stage=stage, precision=rc.train.precision, bucket_mb=rc.comm.bucket_mb),
        dp_group=groups.dp,
        optimizer_factory=torch.optim.AdamW,
        units=list(model.blocks.values()),
    )
    ids = torch.randint(0, cfg.vocab_size, (rc.train.micro_batch, cfg.seq_len))
    counter = comm.CommCounter()
    with counter:
        z.backward(model.loss(z(ids), ids))
        z.step()
    nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    params = sum(nbytes(b.param_shard) if stage == 3 else nbytes(b.flat_param) for b in z.buckets)
    grads = sum(nbytes(b.flat_grad) + nbytes(b.grad_shard) for b in z.buckets)
    optim = sum(nbytes(t) for s in z.optimizer.state.values() for k, t in s.items() if k != "step")
    optim += sum(nbytes(b.master) for b in z.buckets if b.master_is_separate)
    return {"params": params, "grads": grads, "optimizer": optim}, counter.sent_bytes("dp")


@pytest.mark.parametrize(
    "precision, stage, bucket_mb",
    [("fp32", 0, 0.01), ("bf16", 1, 25), ("bf16", 2, 0.01), ("fp32", 3, 0.01), ("bf16", 3, 25)],
)
def test_model_states_and_dp_bytes_equal_the_engine(precision, stage, bucket_mb):
    rc = scenario_config(
        [
            "model.preset=gpt_tiny",
            "model.d_model=64",
            "model.seq_len=16",
            "model.vocab_size=250",
            "parallel.dp=3",
            f"parallel.zero={stage}",
            f"train.precision={precision}",
            f"comm.bucket_mb={bucket_mb}",
            "train.micro_batch=2",
            "train.global_batch=6",
            "plan.hardware=cpu",
        ]
    )
    plan = plan_from_config(rc)
    for measured, dp_sent in run_ranks(_zero_step, 3, rc, stage, timeout=60):
        memory = plan.ranks[0].memory
        assert {k: memory[k] for k in measured} == measured
        # + the 4-byte gradient-norm all-reduce of stages 1-3
        assert plan.ranks[0].traffic["dp"]["bytes"] == pytest.approx(dp_sent, abs=8)
