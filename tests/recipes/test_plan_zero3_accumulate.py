"""``parallel.zero_accumulate=unsharded`` (stages 2-3): the planner prices one reduce-scatter per
step and the full fp32 gradient held while accumulating — equal to what the ZeRO engine sends; the
recipe refuses it below stage 2 and with offload; ``parallel.zero3_accumulate`` is its old name."""

import contextlib

import pytest
import torch

from parallel import comm
from parallel.groups import build_groups
from parallel.plan.memory import zero_bucket_numels
from parallel.testing import run_ranks
from parallel.topology import Topology
from parallel.zero import ZeroConfig, ZeroDataParallel
from parallel.zero.packing import reduction_buffer_bytes
from parallel.zero.theory import accumulation_grad_bytes
from recipes.config import ConfigError, model_config
from recipes.tools.plan import plan_from_config
from recipes.tools.plan_scenarios import scenario_config

M = 4


def _config(accumulate: str, zero: int = 3, key: str = "zero_accumulate", extra=()):
    return scenario_config(
        [
            "model.preset=gpt_tiny",
            "model.d_model=64",
            "model.seq_len=16",
            "model.vocab_size=250",
            "parallel.dp=3",
            f"parallel.zero={zero}",
            f"parallel.{key}={accumulate}",
            "comm.bucket_mb=0.01",
            "train.micro_batch=2",
            f"train.global_batch={2 * 3 * M}",
            "plan.hardware=cpu",
            *extra,
        ]
    )


def _sent(rc) -> float:
    from models.transformer import build_model

    groups = build_groups(Topology(3, 1, 1))
    cfg = model_config(rc.model)
    model = build_model(cfg, seed=0)
    z = ZeroDataParallel(
        model,
        ZeroConfig(stage=rc.parallel.zero, bucket_mb=rc.comm.bucket_mb, accumulate=rc.parallel.zero_accumulate),
        dp_group=groups.dp,
        optimizer_factory=torch.optim.AdamW,
        units=list(model.blocks.values()),
    )
    counter = comm.CommCounter()
    with counter:
        for i in range(M):
            ids = torch.randint(0, cfg.vocab_size, (rc.train.micro_batch, cfg.seq_len))
            with z.no_sync() if i < M - 1 else contextlib.nullcontext():
                z.backward(model.loss(z(ids), ids) / M)
        z.step()
    return counter.sent_bytes("dp")


@pytest.mark.parametrize("zero", [2, 3])
def test_planner_prices_unsharded_accumulation_as_the_engine_runs_it(zero):
    plans = {a: plan_from_config(_config(a, zero)) for a in ("sharded", "unsharded")}
    for a, plan in plans.items():
        for dp_sent in run_ranks(_sent, 3, _config(a, zero), timeout=60):
            assert plan.ranks[0].traffic["dp"]["bytes"] == pytest.approx(dp_sent, abs=8), a  # + the norm
    sharded, unsharded = (plans[a].ranks[0] for a in ("sharded", "unsharded"))
    assert unsharded.traffic["dp"]["bytes"] < sharded.traffic["dp"]["bytes"]
    extra = unsharded.memory["buffers"] - sharded.memory["buffers"]
    # the full fp32 gradient while accumulating; the reductions in flight then send that buffer
    # itself (fp32 on the wire), so their full-gradient copies are not held on top of it
    buckets = [n for unit in zero_bucket_numels(unsharded.params, 3, 0.01 * 2**20, 4, zero == 3) for n in unit]
    copies = reduction_buffer_bytes(buckets, 4, 3) - reduction_buffer_bytes(buckets, 4, 3, sends_accumulator=True)
    assert extra == accumulation_grad_bytes(unsharded.params.numel, zero, "unsharded") - copies > 0


def test_unsharded_accumulation_needs_zero_2_or_3_and_no_offload():
    from recipes.validation import validate

    with pytest.raises(ConfigError, match="set parallel.zero=2 or 3"):
        validate(_config("unsharded", zero=1))
    with pytest.raises(ConfigError, match="parallel.zero_accumulate=sharded or parallel.offload=none"):
        validate(_config("unsharded", zero=2, extra=["parallel.offload=optimizer"]))
    with pytest.raises(ConfigError, match="parallel.zero_accumulate"):
        validate(_config("full"))


def test_the_old_key_is_an_alias():
    from recipes.validation import validate

    rc = _config("unsharded", zero=2, key="zero3_accumulate")
    validate(rc)
    assert rc.parallel.zero_accumulate == "unsharded"
    assert plan_from_config(rc).ranks[0].memory == plan_from_config(_config("unsharded", 2)).ranks[0].memory
    with pytest.raises(ConfigError, match="disagree"):
        validate(_config("sharded", key="zero3_accumulate", extra=["parallel.zero_accumulate=unsharded"]))
    with pytest.raises(ConfigError, match="parallel.zero3_accumulate"):
        validate(_config("full", key="zero3_accumulate"))
