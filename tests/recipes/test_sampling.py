"""Epoch sampling: a seeded permutation of the windows, each read once per epoch, by any layout."""

import numpy as np
import pytest

from recipes.training.data import TokenDataset, open_data, write_token_dir
from recipes.training.sampling import permute


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_the_permutation_is_a_bijection_fixed_by_its_key(n):
    p = permute(np.arange(n), n, (5, 0))
    assert sorted(p.tolist()) == list(range(n))
    assert np.array_equal(p, permute(np.arange(n), n, (5, 0)))
    if n > 6:
        assert not np.array_equal(p, permute(np.arange(n), n, (5, 1)))  # another epoch: another order
        assert not np.array_equal(p, np.arange(n))
    assert np.array_equal(permute(np.arange(n)[::-1].copy(), n, (5, 0)), p[::-1])  # pointwise
    with pytest.raises(ValueError, match="range"):
        permute(np.array([n]), n, (5, 0))


def _dataset(n_windows=50, seq_len=8):
    tokens = np.arange(n_windows * seq_len + 1, dtype=np.int64)  # a window's first token is its start
    return TokenDataset(tokens=tokens, vocab_size=tokens.size, seq_len=seq_len, sampling="epoch")


@pytest.mark.parametrize("dp,micro_batch", [(1, 10), (2, 5), (2, 1), (5, 2)])
def test_every_window_once_per_epoch_at_any_dp_and_micro_batch(dp, micro_batch):
    ds, global_batch = _dataset(), 10
    seen = {0: [], 1: []}
    for step in range(10):  # two epochs of 50 windows, 5 steps each
        for r in range(dp):
            for x, y in ds.rank_microbatches(
                step, global_batch=global_batch, dp=dp, dp_rank=r, micro_batch=micro_batch, seed=7
            ):
                assert x.shape == (micro_batch, 8) and y.equal(x + 1)
                seen[step // 5].extend((x[:, 0] // 8).tolist())
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(50))
    assert seen[0] != seen[1]  # reshuffled per epoch
    assert ds.epochs_done(5, global_batch) == 1.0


def test_a_step_across_the_epoch_boundary_finishes_one_epoch_and_starts_the_next():
    ds = _dataset(n_windows=7)
    walk = np.concatenate([ds.offsets(s, 3, seed=1) for s in range(7)]) // 8  # 21 windows: three epochs
    assert [sorted(walk[i : i + 7].tolist()) for i in (0, 7, 14)] == [list(range(7))] * 3
    assert ds.epochs_done(7, 3) == 3.0


def test_auto_sampling_is_epochs_for_prepared_data_and_random_for_the_embedded_corpus(tmp_path):
    write_token_dir(tmp_path, {"train": np.arange(200) % 256, "val": np.arange(50) % 256}, vocab_size=256)
    assert open_data("memmap", str(tmp_path), "train", 8).sampling == "epoch"
    assert open_data("memmap", str(tmp_path), "train", 8, sampling="random").sampling == "random"
    assert open_data("embedded", None, "val", 8, embedded_mb=0.05).sampling == "random"
