"""ZeRO-Offload (parallel/zero/offload.py): the same training with the optimizer (and stage 3's
parameter shards) in host memory as without; fp16 overflow skips on every rank; refusals."""

import contextlib

import pytest
import torch
from torch import nn

from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology
from parallel.zero import ZeroConfig, ZeroConfigError, ZeroDataParallel
from parallel.zero.offload import check_offload, host_state_bytes
from parallel.zero.theory import model_state_bytes

from .test_composition import Mlp
from .toy import BATCH, adamw, batches, make_model

STEPS, CLIP = 10, 0.5
FP32_CASES = [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "optimizer+params")]


def _train(g, make, stage, offload, precision="fp32", overflow_at=None, units=True):
    model = make()
    zdp = ZeroDataParallel(
        model,
        ZeroConfig(
            stage=stage,
            precision=precision,
            grad_clip=CLIP,
            offload=offload,
            bucket_mb=0.001,  # several buckets: several copies per step
        ),
        dp_group=g.dp,
        optimizer_factory=adamw,
        units=list(getattr(model, "blocks", [])) if units else None,
        tp_group=g.tp if g.tp_size > 1 else None,
    )
    per = BATCH // g.dp_size
    mine = slice(g.dp_rank * per, (g.dp_rank + 1) * per)
    norms, skipped, held = [], [], None
    for i, (x, y) in enumerate(batches(STEPS)):
        for m in range(2):  # two micro-batches: stage 0-1 accumulate, 2-3 reduce each
            xs, ys = x[mine].chunk(2)[m], y[mine].chunk(2)[m]
            loss = nn.functional.mse_loss(zdp(xs).float(), ys) / 2
            if i == overflow_at and g.dp_rank == 1:
                loss = loss * float("inf")
            with zdp.no_sync() if m == 0 else contextlib.nullcontext():
                zdp.backward(loss)
        out = zdp.step()
        norms.append(float(out["grad_norm"]))
        skipped.append(bool(out["skipped"]))
        held = zdp.held_bytes()
    shard = sum(b.layout.padded_numel for b in zdp.buckets)  # padded Ψ, as theory counts it
    return norms, skipped, {n: p.clone() for n, p in zdp.full_parameters().items()}, held, shard


def _compare_all(cases, precision, dp, tp, make, overflow_at=None):
    g = build_groups(Topology(dp=dp, pp=1, tp=tp))
    out = {}
    for stage, offload in cases:
        ref = _train(g, make, stage, "none", precision, overflow_at)
        got = _train(g, make, stage, offload, precision, overflow_at)
        out[(stage, offload)] = (ref, got)
    return out


def _check(results, tol, fp32_bytes=True):
    for per_rank in results:
        for (stage, offload), (ref, got) in per_rank.items():
            assert got[1] == ref[1], (stage, offload)  # the same steps skipped
            assert got[0] == pytest.approx(ref[0], rel=tol, abs=tol, nan_ok=True), (stage, offload)
            for name, p in ref[2].items():
                torch.testing.assert_close(got[2][name], p, atol=tol, rtol=0, msg=f"{stage} {offload} {name}")
            # the device holds no master or optimizer state any more; device and host bytes, counted
            # from the engine's tensors, equal the theory the planner prices with, to the byte
            assert got[3]["optimizer"] == 0 and ref[3]["optimizer"] > 0 and got[3]["host"] > 0
            pbytes = 4 if fp32_bytes else 2
            assert got[3] == model_state_bytes(got[4], stage, 2, pbytes, offload=offload), (stage, offload)
            assert got[3]["host"] == host_state_bytes(got[4] // 2, pbytes, offload)


def test_fp32_offload_equals_no_offload_over_dp():
    _check(run_ranks(_compare_all, 2, FP32_CASES, "fp32", 2, 1, make_model, timeout=180), 1e-6)


def test_fp32_offload_equals_no_offload_over_dp_and_tp():
    cases = [(1, "optimizer"), (3, "optimizer+params")]
    results = run_ranks(_compare_all, 4, cases, "fp32", 2, 2, lambda: Mlp(_tp_group()), timeout=180)
    _check(results, 1e-6)


def _tp_group():
    from parallel.groups import build_groups as bg

    return bg(Topology(dp=2, pp=1, tp=2)).tp


def test_bf16_offload_within_tolerance():
    _check(
        run_ranks(_compare_all, 2, [(2, "optimizer"), (3, "optimizer+params")], "bf16", 2, 1, make_model, timeout=180),
        1e-2,
        fp32_bytes=False,
    )


def test_fp16_overflow_skips_the_step_on_every_rank():
    results = run_ranks(
        _compare_all, 2, [(1, "optimizer"), (3, "optimizer+params")], "fp16", 2, 1, make_model, 3, timeout=180
    )
    for per_rank in results:
        for ref, got in per_rank.values():
            assert got[1][3] and not got[1][4]  # step 3 skipped on both ranks (only rank 1 overflowed)
    _check(results, 1e-3, fp32_bytes=False)


@pytest.mark.parametrize(
    "mode,stage,fix", [("optimizer", 0, "zero=1"), ("optimizer+params", 2, "zero=3"), ("disk", 3, "one of")]
)
def test_offload_refusals_name_the_fix(mode, stage, fix):
    with pytest.raises(ZeroConfigError, match=fix):
        check_offload(mode, stage)
