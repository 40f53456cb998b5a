"""data.blend: prepared corpora mixed in exact proportions, each walked by epochs, the same batches
in any layout; bad blends refused in one line."""

import json

import numpy as np
import pytest

from recipes.training.blend import BlendedDataset, open_blend, parse_blend
from recipes.training.data import DataError, TokenDataset, write_token_dir


def _corpus(tmp_path, name, first, n_windows, seq_len=8, vocab=60_000):
    tokens = (first + np.arange(n_windows * seq_len + 1)) % vocab  # a window's first token: corpus and window
    write_token_dir(tmp_path / name, {"train": tokens, "val": tokens[:40]}, vocab_size=vocab)
    return str(tmp_path / name)


def test_the_mix_is_exact_and_adds_up_to_the_batch(tmp_path):
    a, b = _corpus(tmp_path, "a", 0, 30), _corpus(tmp_path, "b", 10_000, 100)
    ds = open_blend(f"0.7 {a} 0.3 {b}", "train", 8, "epoch")
    for steps in range(0, 50):
        counts = ds.counts(steps, 10)
        assert counts.sum() == steps * 10 and abs(counts[0] - 7 * steps) <= 1 and abs(counts[1] - 3 * steps) <= 1
    x, _ = ds.global_batch(3, 10, seed=1)
    from_a = int((x[:, 0] < 10_000).sum())
    assert from_a == ds.counts(4, 10)[0] - ds.counts(3, 10)[0]
    m = ds.metrics(10, 10)
    assert m["blend0_frac"] == pytest.approx(0.7) and m["blend1_frac"] == pytest.approx(0.3)
    assert m["blend0_epoch"] == pytest.approx(70 / 30) and m["blend1_epoch"] == pytest.approx(30 / 100)


def test_each_corpus_is_walked_by_epochs_and_every_layout_reads_the_same(tmp_path):
    a, b = _corpus(tmp_path, "a", 0, 14), _corpus(tmp_path, "b", 10_000, 6)
    ds = open_blend(f"0.7 {a} 0.3 {b}", "train", 8, "epoch")
    seen_a, seen_b = [], []
    for step in range(2):  # 20 windows: 14 from a (one epoch), 6 from b (one epoch)
        whole = ds.global_batch(step, 10, seed=5)[0]
        halves = [ds.rank_microbatches(step, global_batch=10, dp=2, dp_rank=r, micro_batch=5, seed=5) for r in (0, 1)]
        assert np.array_equal(np.concatenate([x for h in halves for x, _ in h]), whole.numpy())  # dp=2 == dp=1
        firsts = whole[:, 0].numpy()
        seen_a += (firsts[firsts < 10_000] // 8).tolist()
        seen_b += ((firsts[firsts >= 10_000] - 10_000) // 8).tolist()
    assert sorted(seen_a) == list(range(14)) and sorted(seen_b) == list(range(6))


def test_bad_blends_are_refused_naming_the_problem(tmp_path):
    a = _corpus(tmp_path, "a", 0, 10)
    with pytest.raises(DataError, match="must be > 0"):
        parse_blend(f"0 {a}")
    with pytest.raises(DataError, match='pairs of "weight path"'):
        parse_blend(f"0.5 {a} 0.5")
    with pytest.raises(DataError, match="is not a number"):
        parse_blend(f"{a} 0.5")
    with pytest.raises(DataError, match=f"data.blend corpus {tmp_path}/nope: no such directory"):
        open_blend(f"1 {a} 1 {tmp_path}/nope", "train", 8, "epoch")
    other = _corpus(tmp_path, "o", 0, 10, vocab=300)
    with pytest.raises(DataError, match="different vocabularies"):
        BlendedDataset([TokenDataset.open(p, "train", 8) for p in (a, other)], [1, 1], [a, other])


def _train(rc, run_dir):
    from recipes.training.trainer import train

    return train(rc, run_dir)


def test_a_blended_run_logs_its_realised_mix(tmp_path):
    from parallel.testing import run_ranks
    from tests.recipes.test_train_e2e import tiny_recipe

    a, b = _corpus(tmp_path, "a", 0, 200, seq_len=32, vocab=256), _corpus(tmp_path, "b", 0, 100, seq_len=32, vocab=256)
    rc = tiny_recipe(data__blend=f"3 {a} 1 {b}", train__max_steps=4)
    run_ranks(_train, 1, rc, str(tmp_path / "run"), timeout=300)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["blend0_frac"] for r in rows] == [0.75] * 4 and rows[-1]["blend1_epoch"] == pytest.approx(8 / 100)
