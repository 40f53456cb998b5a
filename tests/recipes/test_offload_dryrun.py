"""ZeRO-Offload in the dry run (mode=dryrun): Llama-2-13B on one A100-80GB fits with the optimizer on
the host and not without, and the planner agrees with the dry run within 10 %.

What is compared is the device memory held at the step's peak without the step's temporaries:
at ZeRO 2 with dp = 1 the engine keeps every bucket's full fp32 gradient (the reduce-scatter's
input, 4·Ψ bytes: 48.5 GiB here) alive until backward ends, with or without offload, which the
planner does not count (its ``buffers`` hold two buckets); see docs/offload.md."""

import json

import pytest

from recipes.tools import dryrun, dryrun_classes
from recipes.tools.plan import plan_from_config

from .test_dryrun import recipe

GiB = 2**30
LLAMA2_13B = [
    "model.n_layers=40",
    "model.d_model=5120",
    "model.n_heads=40",
    "model.n_kv_heads=40",
    "model.d_ff=13824",
    "train.global_batch=2",
    "train.micro_batch=1",
    "parallel.tp=1",
    "parallel.sequence_parallel=false",
    "parallel.dp=1",
    "data.source=embedded",
    "data.path=null",
]


@pytest.mark.parametrize("zero,offload,fits", [(2, "none", False), (2, "optimizer", True)])
def test_llama2_13b_on_one_a100_fits_only_with_offload(tmp_path, zero, offload, fits):
    rc = recipe("llama_7b", LLAMA2_13B + [f"parallel.zero={zero}", f"parallel.offload={offload}"])
    plan = plan_from_config(rc)
    results = dryrun_classes.run_forked(rc, [0], 1, str(tmp_path), jobs=1, timeout_s=300)
    mem = results[0]["memory"]
    cmp = dryrun.compare_with_plan(results[0], plan)["memory"]["plan"]
    device, held = 80 * GiB, mem["total"] - mem["temporaries"]
    assert (held <= device) == fits and plan.fits == fits, (held / GiB, plan.fits)
    assert 0.9 <= held / cmp["total"] <= 1.1, (held / GiB, cmp["total"] / GiB)
    assert [mem[k] for k in ("params", "grads", "optimizer")] == [cmp[k] for k in ("params", "grads", "optimizer")]
    # the host holds the fp32 master, both moments and the gradient copy target: 16 B per parameter
    assert mem.get("host", 0) == plan.ranks[0].memory.get("host", 0)
    if offload != "none":
        assert mem["host"] == 16 * plan.ranks[0].params.numel  # dp = 1: no padding beyond the buckets'
    print(
        json.dumps({k: round(v / GiB, 2) for k, v in mem.items()}),
        json.dumps({k: round(v / GiB, 2) for k, v in cmp.items()}),
    )
