"""Top-k compression with error feedback: exact sparse sums, nothing lost, convergence kept."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.testing import run_ranks
from parallel.zero import TopKCompressor, ZeroConfig, ZeroConfigError, ZeroDataParallel, topk_count

from .toy import batches, make_model


def test_topk_count_is_ceil_of_ratio_and_refuses_bad_ratios():
    assert topk_count(1000, 0.01) == 10 and topk_count(1001, 0.01) == 11 and topk_count(5, 0.01) == 1
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ZeroConfigError, match="topk_ratio"):
            topk_count(10, bad)


def _exchange():
    rank = dist.get_rank()
    comp = TopKCompressor(40, 0.1, torch.float32)
    g = [torch.randn(40, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    out = torch.empty(40)
    handle, gathered = comp.start(g[rank].clone(), dist.group.WORLD)
    handle.wait()
    comp.finish(gathered, out)
    residual_after_one = comp.residual.clone()
    # second step: the residual is added to the fresh gradient before selecting
    handle, gathered = comp.start(torch.zeros(40), dist.group.WORLD)
    handle.wait()
    comp.finish(gathered, out2 := torch.empty(40))
    return g, out, residual_after_one, out2, comp.residual.clone()


def test_sparse_sum_is_every_ranks_top_k_and_the_residual_keeps_the_rest():
    (g, out, res, out2, res2), _ = run_ranks(_exchange, 2)
    expected = torch.zeros(40)
    for r in range(2):
        idx = g[r].abs().topk(4).indices
        expected[idx] += g[r][idx]
    torch.testing.assert_close(out, expected)
    mine = torch.zeros(40)
    idx = g[0].abs().topk(4).indices
    mine[idx] = g[0][idx]
    torch.testing.assert_close(res, g[0] - mine)  # what was not sent is kept, exactly
    assert res.count_nonzero() == 36
    # rank 0's next selection comes from its residual: 4 more of its entries arrive
    assert res2.count_nonzero() == 32 and out2.count_nonzero() >= 4


def _train(compression, steps=150):
    rank = dist.get_rank()
    zdp = ZeroDataParallel(
        make_model(),
        ZeroConfig(stage=0, compression=compression, topk_ratio=0.05),
        dp_group=dist.group.WORLD,
        optimizer_factory=lambda g: torch.optim.AdamW(g, lr=3e-3, weight_decay=0.0),
    )
    ((ex, ey),) = batches(1, batch=256, seed=7)
    with torch.no_grad():
        start = nn.functional.mse_loss(zdp(ex), ey).item()
    for x, y in batches(steps, batch=32, seed=1):
        zdp.backward(nn.functional.mse_loss(zdp(x[rank * 16 : (rank + 1) * 16]), y[rank * 16 : (rank + 1) * 16]))
        zdp.step()
    with torch.no_grad():
        return start, nn.functional.mse_loss(zdp(ex), ey).item()


def _both():
    return _train(None), _train("topk")


def test_topk_5_percent_converges_within_a_few_percent_of_uncompressed():
    (start, dense), (_, sparse) = run_ranks(_both, 2)[0]
    assert dense < 0.05 * start and sparse < 0.05 * start  # both learned the task
    # the fraction of the initial held-out loss removed differs by under 2 points
    assert abs(sparse - dense) / start < 0.02, (start, dense, sparse)


def test_compression_beyond_stage_0_is_refused_with_the_fix():
    with pytest.raises(ZeroConfigError, match="stage=0"):
        ZeroDataParallel(make_model(), ZeroConfig(stage=2, compression="topk"), dp_group=None, optimizer_factory=None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stage=4), "stage must be 0, 1, 2 or 3"),
        (dict(stage=0, precision="fp8"), "precision must be one of"),
        (dict(stage=0, compression="powersgd"), "compression must be"),
        (dict(stage=0, grad_clip=-1.0), "grad_clip must be positive"),
        (dict(stage=0, bucket_mb=0), "bucket_mb must be positive"),
        (dict(stage=0, compression="topk", topk_ratio=2.0), "topk_ratio"),
        (dict(stage=0, comm_dtype="int8"), "comm_dtype must be one of"),
    ],
)
def test_bad_settings_are_refused_before_any_communication(kwargs, match):
    with pytest.raises(ZeroConfigError, match=match):
        ZeroDataParallel(make_model(), ZeroConfig(**kwargs), dp_group=None, optimizer_factory=None)
