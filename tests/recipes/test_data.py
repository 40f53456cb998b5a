"""Data: layout-independent global batches, the embedded corpus, memmap round trip."""

import json

import numpy as np
import pytest
import torch

from recipes.tools import prepare
from recipes.training.data import DataError, TokenDataset, embedded_corpus, open_data, write_token_dir


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("GRIDTRAIN_CACHE", str(tmp_path / "cache"))
    return embedded_corpus(mb=0.25, val_fraction=0.05)


def test_embedded_corpus_is_real_text_and_cached(corpus):
    meta = json.loads((corpus / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    text = np.fromfile(corpus / "train.bin", dtype=np.uint16)[:2000].astype(np.uint8).tobytes()
    assert b"def " in text or b"import " in text
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == int(0.25 * 2**20)
    mtime = (corpus / "meta.json").stat().st_mtime
    assert embedded_corpus(mb=0.25, val_fraction=0.05) == corpus
    assert (corpus / "meta.json").stat().st_mtime == mtime  # not rebuilt


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_global_batch_is_the_same_for_every_dp(corpus, micro_batch):
    ds = TokenDataset.open(corpus, "train", seq_len=16)
    for step in range(3):
        x, y = ds.global_batch(step, 8, seed=7)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
        for dp in (1, 2, 4):
            parts = [
                mb
                for r in range(dp)
                for mb in ds.rank_microbatches(step, global_batch=8, dp=dp, dp_rank=r, micro_batch=micro_batch, seed=7)
            ]
            assert all(px.shape == (micro_batch, 16) for px, _ in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), x)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)
    a, _ = ds.global_batch(0, 8, seed=7)
    b, _ = ds.global_batch(1, 8, seed=7)
    assert not torch.equal(a, b)


def test_memmap_round_trip_uint16_and_uint32(tmp_path):
    small = np.arange(100) % 300
    write_token_dir(tmp_path / "a", {"train": small, "val": small[:40]}, vocab_size=300)
    ds = TokenDataset.open(tmp_path / "a", "train", seq_len=8)
    assert ds.tokens.dtype == np.uint16 and np.array_equal(ds.tokens, small)
    big = np.array([0, 70_000, 5, 99_999] * 10)
    write_token_dir(tmp_path / "b", {"train": big}, vocab_size=100_000)
    ds = TokenDataset.open(tmp_path / "b", "train", seq_len=4)
    assert ds.tokens.dtype == np.uint32 and np.array_equal(ds.tokens, big)
    with pytest.raises(DataError, match="outside"):
        write_token_dir(tmp_path / "c", {"train": np.array([0, 256])}, vocab_size=256)


def test_prepare_command_writes_what_the_trainer_reads(tmp_path):
    src = tmp_path / "text"
    src.mkdir()
    (src / "a.txt").write_text("hello world " * 50)
    (src / "b.txt").write_text("gridtrain " * 50)
    assert prepare.main(["--output", str(tmp_path / "out"), str(src)]) == 0
    ds = open_data("memmap", str(tmp_path / "out"), "train", seq_len=8)
    val = open_data("memmap", str(tmp_path / "out"), "val", seq_len=8)
    # one document per file, each ended by byte 0; split by document (two: one each)
    assert ds.tokens.astype(np.uint8).tobytes() == b"hello world " * 50 + b"\0"
    assert val.tokens.astype(np.uint8).tobytes() == b"gridtrain " * 50 + b"\0"
    assert prepare.main(["--output", str(tmp_path / "x"), str(tmp_path / "nope")]) == 2


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="python -m recipes.prepare"):
        open_data("memmap", str(tmp_path / "nothing"), "train", 8)
    write_token_dir(tmp_path / "t", {"train": np.arange(5)}, vocab_size=256)
    with pytest.raises(DataError, match="holds 5 tokens, fewer than one window of seq_len 8 \\+ 1 = 9"):
        TokenDataset.open(tmp_path / "t", "train", 8)
    # exactly one window (seq_len + 1 tokens) is enough, and it is the only window drawn
    ds = TokenDataset.open(tmp_path / "t", "train", 4)
    x, y = ds.global_batch(0, 3, seed=1)
    assert x.tolist() == [[0, 1, 2, 3]] * 3 and y.tolist() == [[1, 2, 3, 4]] * 3
    with pytest.raises(DataError, match="val.bin is missing"):
        TokenDataset.open(tmp_path / "t", "val", 2)
