"""``recipes.prepare`` against ``datasets.map`` with the same tokenizer, batched, on the same workers.

    python -m benchmarks.prepare [--mb 200] [--workers 2] [--vocab 8192] [--out DIR]
    python -m benchmarks.prepare --memory --mb 5120     # peak RSS only: the bytes tokenizer, no datasets.map

The corpus is jsonl made here from the Python standard library's sources (one document per file
chunk of about 4 KB, repeated to ``--mb``); the tokenizer a byte-level BPE trained on its first MB
and saved as a ``transformers`` folder, used by both sides. Ours streams into shards (EOS per
document, a document index); theirs is ``load_dataset("json")`` then ``.map(batched=True,
num_proc=workers)`` returning the ids (what a user writes before Megatron's or torchtitan's
loaders), its Arrow cache in a fresh folder. Reported: tokens/s per worker each side, the ratio, and
our peak RSS (this process and its workers' largest, ``getrusage``) beside the corpus size.
``--memory``: only ``python -m recipes.prepare`` in a child process, with the bytes tokenizer (what
bounds memory is the chunks in flight, not the tokenizer), and the largest process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def make_corpus(path: Path, mb: float, doc_bytes: int = 4096) -> int:
    """Write ``mb`` MB of jsonl documents; return the number written."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for f in sorted(root.rglob("*.py"))[:400]:
        try:
            t = f.read_text(errors="replace")
        except OSError:
            continue
        texts += [t[i : i + doc_bytes] for i in range(0, len(t), doc_bytes)]
    n, size, target = 0, 0, int(mb * 2**20)
    with open(path, "w") as out:
        while size < target:
            for t in texts:
                line = json.dumps({"text": t}) + "\n"
                out.write(line)
                size += len(line)
                n += 1
                if size >= target:
                    break
    return n


def make_tokenizer(corpus: Path, folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    lines = []
    with open(corpus) as f:
        for line in f:
            lines.append(json.loads(line)["text"])
            if len(lines) >= 256:
                break
    tok.train_from_iterator(lines, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def theirs(corpus: Path, folder: Path, workers: int, cache: Path) -> tuple[float, int]:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(folder)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    ids = ds.map(
        lambda b: {"ids": [x + [tok.eos_token_id] for x in tok(b["text"])["input_ids"]]},
        batched=True,
        num_proc=workers if workers > 1 else None,
        remove_columns=["text"],
    )
    tokens = sum(len(x) for x in ids.with_format("numpy")["ids"])
    return time.perf_counter() - t0, int(tokens)


def ours(corpus: Path, folder: Path, workers: int, out: Path) -> tuple[float, int]:
    from recipes.tools.prepare import prepare

    t0 = time.perf_counter()
    meta = prepare([str(corpus)], out, str(folder), workers=workers, progress=False)
    return time.perf_counter() - t0, sum(meta["tokens"].values())


def memory(corpus: Path, workers: int, out: Path) -> tuple[float, float]:
    """``python -m recipes.prepare`` (bytes tokenizer) in a child: its seconds and its largest process's peak RSS (MB)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "recipes.prepare", str(corpus), "--output", str(out), "--tokenizer", "bytes"]
    subprocess.run([*cmd, "--workers", str(workers)], check=True, capture_output=True)
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", default=None, help="a folder for the corpus and outputs (default: a temporary one)")
    ap.add_argument("--memory", action="store_true", help="peak RSS of recipes.prepare only (bytes tokenizer)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        tmp = Path(tmp)
        docs = make_corpus(tmp / "corpus.jsonl", a.mb)
        if a.memory:
            seconds, rss = memory(tmp / "corpus.jsonl", a.workers, tmp / "ours")
            print(f"{a.mb:g} MB, {docs:,} documents, {a.workers} workers: {seconds:.1f} s, peak RSS {rss:.0f} MB")
            return {"corpus_mb": a.mb, "documents": docs, "workers": a.workers, "seconds": seconds, "peak_rss_mb": rss}
        make_tokenizer(tmp / "corpus.jsonl", tmp / "tok", a.vocab)
        t_ours, n_ours = ours(tmp / "corpus.jsonl", tmp / "tok", a.workers, tmp / "ours")
        rss = _peak_rss_mb()
        t_theirs, n_theirs = theirs(tmp / "corpus.jsonl", tmp / "tok", a.workers, tmp / "hf_cache")
    row = {
        "corpus_mb": a.mb,
        "documents": docs,
        "workers": a.workers,
        "ours_tokens_per_s_per_worker": n_ours / t_ours / a.workers,
        "theirs_tokens_per_s_per_worker": n_theirs / t_theirs / a.workers,
        "ours_s": t_ours,
        "theirs_s": t_theirs,
        "same_tokens": n_ours == n_theirs,
        "ours_peak_rss_mb": rss,
    }
    row["ratio"] = row["ours_tokens_per_s_per_worker"] / row["theirs_tokens_per_s_per_worker"]
    print(
        f"{a.mb:g} MB, {docs:,} documents, {a.workers} workers: ours {row['ours_tokens_per_s_per_worker']:,.0f} "
        f"tokens/s/worker ({t_ours:.1f} s), datasets.map {row['theirs_tokens_per_s_per_worker']:,.0f} ({t_theirs:.1f} s): "
        f"{row['ratio']:.2f}x; same tokens: {row['same_tokens']}; our peak RSS {rss:.0f} MB"
    )
    return row


if __name__ == "__main__":
    main()
