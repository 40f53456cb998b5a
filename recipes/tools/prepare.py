"""Tokenise text files into the memory-mapped format the trainer reads.

    python -m recipes.prepare --output data/mytext corpus/*.txt
    python -m recipes.prepare --output data/mytext --tokenizer tokenizer.json corpus/

Byte-level by default (vocabulary 256, no dependency); with ``--tokenizer`` a
local Hugging Face ``tokenizers`` JSON file (``pip install tokenizers``) is
used. Writes ``train.bin``, ``val.bin`` and ``meta.json``; train with
``data.source=memmap data.path=data/mytext model.vocab_size=<vocab>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ..training.data import DataError, write_token_dir


def _files(inputs: list[str]) -> list[Path]:
    out = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file()))
        elif p.is_file():
            out.append(p)
        elif p.exists():
            raise DataError(
                f"input {item} is not a regular file or directory (a device, pipe or socket); "
                f"give text files or directories of them"
            )
        else:
            raise DataError(f"input {item} does not exist")
    if not out:
        raise DataError("no input files given")
    return out


def tokenize(files: list[Path], tokenizer: str | None) -> tuple[np.ndarray, int]:
    """All files' tokens, concatenated in order, and the vocabulary size."""
    if tokenizer is None:
        data = b"".join(f.read_bytes() for f in files)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64), 256
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from None
    tok = Tokenizer.from_file(tokenizer)
    ids: list[int] = []
    for f in files:
        ids.extend(tok.encode(f.read_text(errors="replace")).ids)
    return np.asarray(ids, dtype=np.int64), tok.get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="text files or directories")
    ap.add_argument("--output", required=True, help="directory to write train.bin/val.bin/meta.json")
    ap.add_argument("--tokenizer", help="a local tokenizers JSON file (default: bytes)")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    args = ap.parse_args(argv)
    try:
        out_path = Path(args.output)
        if out_path.exists() and not out_path.is_dir():
            raise DataError(
                f"--output {out_path} is a file; give a directory (it will hold train.bin, val.bin, meta.json)"
            )
        if not 0 < args.val_fraction < 1:
            raise DataError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
        tokens, vocab = tokenize(_files(args.inputs), args.tokenizer)
        n_val = max(1, int(tokens.size * args.val_fraction))
        if tokens.size - n_val < 2:
            raise DataError(f"only {tokens.size} tokens: too few to split")
        out = write_token_dir(args.output, {"train": tokens[:-n_val], "val": tokens[-n_val:]}, vocab)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {tokens.size - n_val:,} train + {n_val:,} val tokens (vocab {vocab}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
