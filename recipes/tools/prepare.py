"""Tokenise a corpus into the memory-mapped shards the trainer reads, streaming, on N processes.

    python -m recipes.prepare --output data/mine corpus/                       # text files, bytes
    python -m recipes.prepare --output data/mine --tokenizer tok/ --text-key text corpus/*.jsonl
    python -m recipes.prepare --output data/mine --tokenizer tokenizer.json saved_dataset/
    python -m recipes.prepare --output data/mine --tokenizer tiktoken:cl100k_base=cl100k.tiktoken hf:org/name

Inputs: :mod:`.prepare_inputs` (text files and folders; jsonl/json/parquet/arrow/csv; ``save_to_disk``
folders; ``hf:<name>``). Tokenizers: :mod:`.prepare_tokenizers` (bytes, a ``tokenizers`` JSON, a
``transformers`` folder, tiktoken). Every document ends with the tokenizer's EOS; empty ones are
skipped and counted. The split is by document: document ``i`` (counting the non-empty ones) goes to
``val`` where its Weyl point ``frac((i+1)·φ)`` falls below ``--val-fraction``, evenly spread and the same
on every run (the last document moves to ``val`` if none fell there).

Output (:mod:`.prepare_writer`): ``<split>-NNNNN.bin`` shards, ``<split>.idx`` document ends and
``meta.json`` (tokenizer, vocabulary, dtype, EOS/BOS ids, tokens, documents and shards per split).
Everything is written into ``<output>/.partial`` and moved into place when complete, ``meta.json``
last: an interrupted run leaves nothing that looks finished, and running it again starts over.
Memory is bounded by the chunks in flight (``2 × --workers`` chunks of at most
:data:`CHUNK_DOCS` documents or :data:`CHUNK_BYTES` bytes), not by the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..training.corpus_format import DTYPES, DataError
from .prepare_inputs import check_inputs, documents, sources
from .prepare_tokenizers import DocTokenizer, load_tokenizer
from .prepare_writer import SplitWriter

CHUNK_DOCS, CHUNK_BYTES = 256, 4 << 20
SHARD_TOKENS = 1 << 30  # a shard closes after the document that reaches this many tokens
GOLDEN = 0.6180339887498949
_WORKER_TOKENIZER: DocTokenizer | None = None


def is_val(i: int, val_fraction: float) -> bool:
    """Whether non-empty document ``i`` belongs to the validation split."""
    return ((i + 1) * GOLDEN) % 1.0 < val_fraction


def _chunks(docs: Iterator) -> Iterator[list]:
    chunk, size = [], 0
    for d in docs:
        chunk.append(d)
        size += len(d)
        if len(chunk) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _init_worker(tok: DocTokenizer) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER_TOKENIZER = tok


def _encode(texts: list) -> list[np.ndarray]:
    return _WORKER_TOKENIZER.encode(texts)


def encoded(tok: DocTokenizer, chunks: Iterator[list], workers: int) -> Iterator[list[np.ndarray]]:
    """Each chunk's token arrays, in input order; ``workers`` processes (1: this one), at most
    ``2 × workers`` chunks in flight."""
    if workers <= 1:
        yield from (tok.encode(c) for c in chunks)
        return
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tok,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.submit(_encode, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def resolve_dtype(dtype: str, vocab: int) -> str:
    if dtype == "auto":
        return "uint16" if vocab <= 2**16 else "uint32"
    if dtype not in DTYPES:
        raise DataError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    if np.iinfo(DTYPES[dtype]).max < vocab - 1:
        raise DataError(f"the tokenizer's vocabulary of {vocab:,} ids does not fit {dtype}; use --dtype uint32")
    return dtype


def prepare(
    inputs: list[str],
    output: str | Path,
    tokenizer: str | None = None,
    *,
    eos_token: str | None = None,
    text_key: str = "text",
    input_split: str = "train",
    workers: int = 1,
    val_fraction: float = 0.05,
    shard_tokens: int = SHARD_TOKENS,
    dtype: str = "auto",
    progress: bool = True,
) -> dict:
    """Tokenise ``inputs`` into ``output`` (module docstring); returns the written ``meta.json``.
    Raises :class:`DataError` for any bad input before a worker starts, and for an empty corpus."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise DataError(f"--output {out} is a file; give a directory")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    srcs = sources(inputs)
    tok = load_tokenizer(tokenizer, eos_token)
    dt = resolve_dtype(dtype, tok.vocab_size)
    check_inputs(srcs, input_split, text_key)
    partial = out / ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (out / "meta.json").unlink(missing_ok=True)  # what was here is not finished any more
    writers = {s: SplitWriter(partial, s, DTYPES[dt], shard_tokens) for s in ("train", "val")}
    n_docs = skipped = 0
    t0 = time.perf_counter()
    bar = tqdm(unit="doc", desc="prepare", disable=None if progress else True, file=sys.stderr)
    specials = 1 + (tok.bos_id is not None)  # an empty document is only its BOS and EOS
    try:
        for arrays in encoded(tok, _chunks(documents(srcs, input_split, text_key)), workers):
            for ids in arrays:
                if ids.size <= specials:
                    skipped += 1
                    continue
                writers["val" if is_val(n_docs, val_fraction) else "train"].add(ids)
                n_docs += 1
            bar.update(len(arrays))
            rate = (writers["train"].tokens + writers["val"].tokens) / (time.perf_counter() - t0)
            bar.set_postfix(tokens_per_s=f"{rate:,.0f}")
    except DataError:  # a bad record found while reading: nothing of this run stays
        for w in writers.values():
            w.close()
        shutil.rmtree(partial)
        raise
    finally:
        bar.close()
    if n_docs < 2:
        shutil.rmtree(partial)
        raise DataError(
            f"{n_docs} non-empty document(s) ({skipped} empty skipped): a train/val split by document needs at "
            f"least 2; give more documents (one per text file, or per record of a jsonl/parquet file)"
        )
    if writers["val"].documents == 0:
        writers["val"].add(writers["train"].pop_last())
    splits = {s: w.close() for s, w in writers.items()}
    meta = {
        "format": 2,
        "dtype": dt,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "tokenizer": tok.describe(),
        "tokens": {s: r["tokens"] for s, r in splits.items()},
        "documents": {s: r["documents"] for s, r in splits.items()},
        "shards": {s: r["shards"] for s, r in splits.items()},
        "index": {s: r["index"] for s, r in splits.items()},
        "skipped_empty": skipped,
        "val_fraction": val_fraction,
        "inputs": [s.path for s in srcs],
    }
    for f in sorted(partial.iterdir()):
        os.replace(f, out / f.name)
    (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    os.replace(partial / "meta.json", out / "meta.json")
    partial.rmdir()
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="text files, dataset files (jsonl/parquet/arrow/csv), folders, hf:<name>")
    ap.add_argument("--output", required=True, help="directory to write the shards, indexes and meta.json")
    ap.add_argument("--tokenizer", help="tokenizer.json, a transformers folder, tiktoken:<enc>=<file>, or bytes")
    ap.add_argument("--eos-token", help="a tokenizer.json's end-of-document token (default: found by name)")
    ap.add_argument("--text-key", default="text", help="the text column of dataset inputs")
    ap.add_argument("--input-split", default="train", help="the split of a saved or Hub dataset dict")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    ap.add_argument("--dtype", default="auto", help="auto, uint16 or uint32")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.shard_tokens < 1:
        ap.error(f"--workers and --shard-tokens must be ≥ 1, got {args.workers} and {args.shard_tokens}")
    try:
        meta = prepare(
            args.inputs,
            args.output,
            args.tokenizer,
            eos_token=args.eos_token,
            text_key=args.text_key,
            input_split=args.input_split,
            workers=args.workers,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            dtype=args.dtype,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t, d = meta["tokens"], meta["documents"]
    print(
        f"wrote {args.output}: train {t['train']:,} tokens in {d['train']:,} documents, val {t['val']:,} in "
        f"{d['val']:,} ({meta['skipped_empty']} empty skipped; vocabulary {meta['vocab_size']:,}, {meta['dtype']}); "
        f"train with data.source=memmap data.path={args.output} model.vocab_size={meta['vocab_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
