"""Bytes each layer moves per forward+backward equal its docstring's formula; bad sizes are refused."""

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.layers import (
    ColumnParallelLinear,
    LayerConfigError,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_token_ids,
    init_parameters_,
    vocab_parallel_cross_entropy,
)
from parallel.layers import init as layer_init
from parallel.testing import run_ranks

B, S, D = 2, 4, 16


def _sent(group, fn):
    counter = comm.CommCounter()
    with counter:
        fn()
    return counter.sent_bytes("tp"), counter.calls("tp")


def _bytes_rank():
    n = dist.get_world_size()
    group = dist.new_group(list(range(n)), group_desc="tp")
    out = {}
    for sp in (False, True):
        s_local = S // n if sp else S
        layers = {
            "mlp_gelu": ParallelMLP(D, 32, tp_group=group, sequence_parallel=sp),
            "mlp_swiglu": ParallelMLP(D, 32, activation="swiglu", tp_group=group, sequence_parallel=sp),
            "attention": ParallelSelfAttention(D, 8, 4, tp_group=group, sequence_parallel=sp, rope=True),
        }
        for name, layer in layers.items():
            init_parameters_(layer, tp_group=group)
            x = torch.randn(B, s_local, D, requires_grad=True)
            out[name, sp] = _sent(group, lambda: layer(x).sum().backward())
        emb = init_parameters_(VocabParallelEmbedding(64, D, tp_group=group, sequence_parallel=sp), tp_group=group)
        out["embedding", sp] = _sent(group, lambda: emb(torch.randint(0, 64, (B, S))).sum().backward())
    logits = torch.randn(B, S, 64 // n, requires_grad=True)
    out["cross_entropy", False] = _sent(
        group, lambda: vocab_parallel_cross_entropy(logits, torch.randint(0, 64, (B, S)), group).sum().backward()
    )
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_per_layer_match_docstring_formulas(n):
    got = run_ranks(_bytes_rank, n)[0]
    A = B * S * D * 4  # full activation bytes
    ring = (n - 1) / n
    for sp in (False, True):
        # MLP / attention: one all-reduce fwd + one bwd, or all-gather + reduce-scatter each way, and with
        # sequence parallelism one more all-gather in backward (the column layer's input, saved as a shard)
        for name in ("mlp_gelu", "mlp_swiglu", "attention"):
            assert got[name, sp] == (pytest.approx((5 if sp else 4) * ring * A), 2 if not sp else 5), (name, sp)
        assert got["embedding", sp] == (pytest.approx(2 * ring * A), 1 if not sp else 2)
    assert got["cross_entropy", False] == (pytest.approx(2 * ring * 3 * B * S * 4), 2)


def _error_rank():
    group = dist.new_group([0, 1], group_desc="tp")
    errors = {}
    cases = {
        "heads": lambda: ParallelSelfAttention(24, 3, tp_group=group),
        "kv_heads": lambda: ParallelSelfAttention(32, 4, 1, tp_group=group),
        "d_ff": lambda: ParallelMLP(16, 33, tp_group=group),
        "vocab": lambda: VocabParallelEmbedding(63, 8, tp_group=group),
        "vocab_table": lambda: VocabParallelEmbedding(64, 8, vocab_size=65, tp_group=group),
        "shape": lambda: ColumnParallelLinear(8, 16, tp_group=group)(torch.zeros(2, 7)),
        "row_shape": lambda: RowParallelLinear(16, 8, tp_group=group)(torch.zeros(2, 16)),
        "ids": lambda: check_token_ids(torch.tensor([[3, 50]]), 50),  # the layers' host-batch check
    }
    for name, make in cases.items():
        try:
            make()
        except LayerConfigError as e:
            errors[name] = str(e)
    comm.all_reduce(torch.zeros(1), group=group)  # both ranks done with the group before exiting
    return errors


def test_bad_sizes_refused_with_the_numbers():
    errors = run_ranks(_error_rank, 2)[0]
    assert "n_heads = 3" in errors["heads"] and "tensor-parallel size 2" in errors["heads"]
    assert "n_kv_heads 1 < tensor-parallel size 2" in errors["kv_heads"]
    assert "out_features = 33" in errors["d_ff"]
    assert "num_embeddings (padded vocab) = 63" in errors["vocab"]
    assert "vocab_size 65 exceeds the table's 64" in errors["vocab_table"]
    assert "last dim 7" in errors["shape"] and "expected 8" in errors["shape"]
    assert "last dim 16" in errors["row_shape"] and "expected 8" in errors["row_shape"]
    assert "[3, 50]" in errors["ids"] and "[0, 50)" in errors["ids"]


def test_init_of_a_large_shard_draws_only_bounded_tiles(monkeypatch):
    """A row-parallel shard of a [512, 8192] matrix at tp=8 is drawn tile by tile: the scratch
    never exceeds one tile, and the values equal the same slice of the full initialisation."""
    drawn = []
    real_randn = torch.randn

    def spy(*shape, **kw):
        t = real_randn(*shape, **kw)
        drawn.append(t.numel())
        return t

    full = torch.empty(512, 8192)
    layer_init.init_tensor_shard_(full, key="w", seed=5, std=1.0, shard_dim=None, tp_rank=0, tp_size=1)
    monkeypatch.setattr(layer_init.torch, "randn", spy)
    for dim, shard_shape in ((1, (512, 1024)), (0, (64, 8192))):
        drawn.clear()
        shard = torch.empty(shard_shape)
        layer_init.init_tensor_shard_(shard, key="w", seed=5, std=1.0, shard_dim=dim, tp_rank=3, tp_size=8)
        assert torch.equal(shard, full.chunk(8, dim)[3])
        assert max(drawn) <= layer_init.TILE_ROWS * layer_init.TILE_COLS
        assert sum(drawn) <= 2 * full.numel() // 8 + layer_init.TILE_ROWS * layer_init.TILE_COLS
