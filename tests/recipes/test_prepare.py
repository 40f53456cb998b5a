"""``python -m recipes.prepare`` on the inputs and tokenizers users have, made here as files:
documents kept apart by EOS, split by document, sharded, read back by the trainer as written."""

import json

import numpy as np
import pytest

from recipes.tools import prepare
from recipes.tools.prepare_tokenizers import load_tokenizer
from recipes.training.data import DataError, TokenDataset, read_meta, split_tokens

DOCS = [f"document {i}: " + "lorem ipsum dolor " * (i % 5) + "end." for i in range(60)]


def _jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({key: d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _documents(out, split):
    """Each document of ``split`` as written: the stream cut at the index's ends."""
    meta = read_meta(out)
    tokens = np.asarray(split_tokens(out, split, meta)[np.arange(meta["tokens"][split])])
    ends = np.fromfile(out / meta["index"][split], dtype=np.uint64).astype(np.int64)
    return [tokens[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def _bpe(tmp_path, bos=False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_documents_end_with_eos_and_the_split_is_by_document(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", DOCS[:30] + [""] + DOCS[30:])  # one empty record: skipped, counted
    meta = prepare.prepare([str(src)], tmp_path / "out", progress=False, val_fraction=0.1)
    assert meta["skipped_empty"] == 1 and meta["eos_id"] == 0 and meta["documents"] == {"train": 54, "val": 6}
    train, val = _documents(tmp_path / "out", "train"), _documents(tmp_path / "out", "val")
    want = [np.frombuffer(d.encode() + b"\0", dtype=np.uint8) for d in DOCS]
    expect_val = [i for i in range(len(DOCS)) if prepare.is_val(i, 0.1)]
    assert [d.tolist() for d in val] == [want[i].tolist() for i in expect_val]
    assert [d.tolist() for d in train] == [want[i].tolist() for i in range(len(DOCS)) if i not in expect_val]
    assert all(int((d == 0).sum()) == 1 and d[-1] == 0 for d in train + val)  # one EOS, at the end


@pytest.mark.parametrize("fmt", ["parquet", "saved", "csv"])
def test_every_dataset_format_gives_the_same_documents_as_jsonl(tmp_path, fmt):
    import datasets

    ref = prepare.prepare([str(_jsonl(tmp_path / "c.jsonl", DOCS))], tmp_path / "ref", progress=False)
    ds = datasets.Dataset.from_dict({"body": DOCS})
    if fmt == "parquet":
        ds.to_parquet(str(tmp_path / "c.parquet"))
        src = tmp_path / "c.parquet"
    elif fmt == "csv":
        ds.to_csv(str(tmp_path / "c.csv"), index=False)
        src = tmp_path / "c.csv"
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        src = tmp_path / "saved"
    meta = prepare.prepare([str(src)], tmp_path / "out", text_key="body", progress=False)
    assert meta["tokens"] == ref["tokens"] and meta["documents"] == ref["documents"]
    for split in ("train", "val"):
        assert [d.tolist() for d in _documents(tmp_path / "out", split)] == [
            d.tolist() for d in _documents(tmp_path / "ref", split)
        ]


def test_a_tokenizers_json_and_a_transformers_folder_tokenize_as_their_libraries_do(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok, path = _bpe(tmp_path)
    src = _jsonl(tmp_path / "c.jsonl", DOCS)
    meta = prepare.prepare([str(src)], tmp_path / "a", str(path), progress=False)
    eos = tok.token_to_id("<|endoftext|>")
    assert meta["eos_id"] == eos and meta["vocab_size"] == tok.get_vocab_size() and meta["bos_id"] is None
    got = _documents(tmp_path / "a", "train") + _documents(tmp_path / "a", "val")
    want = [tok.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS]
    assert sorted(d.tolist() for d in got) == sorted(want)

    tok_bos, _ = _bpe(tmp_path / "..", bos=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok_bos, bos_token="<s>", eos_token="<|endoftext|>", unk_token="<unk>"
    )
    hf.save_pretrained(tmp_path / "hf_tok")
    meta = prepare.prepare([str(src)], tmp_path / "b", str(tmp_path / "hf_tok"), progress=False, workers=2)
    assert meta["bos_id"] == 1 and meta["eos_id"] == eos and meta["tokenizer"]["kind"] == "transformers"
    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf_tok")
    got = _documents(tmp_path / "b", "train") + _documents(tmp_path / "b", "val")
    assert sorted(d.tolist() for d in got) == sorted(loaded(d)["input_ids"] + [eos] for d in DOCS)
    assert all(d[0] == 1 and d[-1] == eos for d in got)


def _ranks_file(path):
    import base64

    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return path


def test_tiktoken_from_a_local_ranks_file(tmp_path):
    import tiktoken

    ranks = _ranks_file(tmp_path / "bytes.tiktoken")
    spec = f"tiktoken:cl100k_base={ranks}"  # its pattern and specials, these 256 byte ranks
    meta = prepare.prepare([str(_jsonl(tmp_path / "c.jsonl", DOCS))], tmp_path / "out", spec, progress=False)
    enc = load_tokenizer(spec).impl
    assert isinstance(enc, tiktoken.Encoding) and meta["eos_id"] == enc.eot_token == 100257
    assert meta["vocab_size"] == enc.n_vocab and meta["dtype"] == "uint32"
    got = _documents(tmp_path / "out", "train") + _documents(tmp_path / "out", "val")
    assert sorted(d.tolist() for d in got) == sorted(enc.encode_ordinary(d) + [100257] for d in DOCS)
    with pytest.raises(DataError, match="does not fit uint16; use --dtype uint32"):  # cl100k's specials: > 65,535
        prepare.prepare([str(tmp_path / "c.jsonl")], tmp_path / "x", spec, dtype="uint16")
    with pytest.raises(DataError, match="holds 256 ranks, not the r50k_base encoding's 50,256"):
        prepare.prepare([str(tmp_path / "c.jsonl")], tmp_path / "x", f"tiktoken:r50k_base={ranks}")


def test_shards_and_workers_change_nothing_the_trainer_reads(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", DOCS * 4)
    one = prepare.prepare([str(src)], tmp_path / "one", progress=False)
    many = prepare.prepare([str(src)], tmp_path / "many", progress=False, workers=2, shard_tokens=500)
    assert len(many["shards"]["train"]) > 5 and many["tokens"] == one["tokens"]
    a, b = TokenDataset.open(tmp_path / "one", "train", 64), TokenDataset.open(tmp_path / "many", "train", 64)
    for step in range(5):  # windows that cross shard boundaries among them
        xa, ya = a.global_batch(step, 16, seed=3)
        xb, yb = b.global_batch(step, 16, seed=3)
        assert xa.equal(xb) and ya.equal(yb)
    sizes = [np.fromfile(tmp_path / "many" / s, dtype=np.uint16).size for s in many["shards"]["train"]]
    assert sum(sizes) == many["tokens"]["train"] and max(sizes) <= 500 + max(len(d) + 1 for d in DOCS)


def test_bad_inputs_are_one_line_before_any_worker(tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", DOCS, key="content")
    assert prepare.main(["--output", str(tmp_path / "o"), str(src)]) == 2
    assert "has no column 'text' (it has ['content', 'n']); name it with --text-key" in capsys.readouterr().err
    _jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(DataError, match="0 non-empty document\\(s\\) \\(2 empty skipped\\)"):
        prepare.prepare([str(tmp_path / "empty.jsonl")], tmp_path / "o", progress=False)
    assert not (tmp_path / "o" / "meta.json").exists() and not (tmp_path / "o" / ".partial").exists()
    import datasets

    datasets.Dataset.from_dict({"text": DOCS * 50}).to_parquet(str(tmp_path / "c.parquet"))
    data = (tmp_path / "c.parquet").read_bytes()
    (tmp_path / "c.parquet").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(DataError, match="c.parquet"):
        prepare.prepare([str(tmp_path / "c.parquet")], tmp_path / "o", progress=False)
    with pytest.raises(DataError, match="no such file or folder"):
        prepare.prepare([str(src)], tmp_path / "o", str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match="does not exist"):
        prepare.prepare([str(tmp_path / "nope")], tmp_path / "o")


def test_an_interrupted_run_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "c.jsonl", DOCS)
    prepare.prepare([str(src)], tmp_path / "out", progress=False)  # a finished run, then one interrupted
    calls = {"n": 0}
    real = prepare.SplitWriter.add

    def dying_add(self, ids):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        real(self, ids)

    monkeypatch.setattr(prepare.SplitWriter, "add", dying_add)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare([str(src)], tmp_path / "out", progress=False)
    with pytest.raises(DataError, match="holds no meta.json"):
        TokenDataset.open(tmp_path / "out", "train", 8)
    monkeypatch.setattr(prepare.SplitWriter, "add", real)
    meta = prepare.prepare([str(src)], tmp_path / "out", progress=False)  # run again: starts over
    assert sum(meta["documents"].values()) == len(DOCS) and not (tmp_path / "out" / ".partial").exists()
