"""Training data: an embedded corpus that needs no download, and memory-mapped token files.

Token files are flat arrays of uint16 or uint32 token ids (the nanoGPT /
Megatron ``.bin`` convention) beside a ``meta.json`` saying ``dtype`` and
``vocab_size``; ``python -m recipes.prepare`` writes them (as shards, with a
document index) from text files and datasets.

The embedded corpus is real text with no download: the Python standard
library's own source files, read as bytes (vocabulary 256), built on first use
and cached under ``$GRIDTRAIN_CACHE`` (default ``~/.cache/gridtrain``).

**The global batch does not depend on the layout** (docs/architecture.md invariant 2):
:meth:`TokenDataset.global_batch` draws the ``global_batch`` sequence offsets of
step ``s`` from a generator seeded by ``(seed, s)``; a DP rank takes its
contiguous slice of them and each micro-batch a contiguous slice of that. Under
context parallelism each cp rank of a DP rank takes the same samples and keeps its
load-balanced part of every sequence (:func:`parallel.layers.cp_slice`: chunks
``i`` and ``2·cp−1−i`` of ``2·cp``), inputs and targets alike.
"""

from __future__ import annotations

import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from parallel.layers import cp_slice

from .corpus_format import DTYPES, DataError
from .packing import window_positions
from .sampling import SAMPLINGS, epoch_walk

MIN_SOURCE_BYTES = 10_000  # fewer bytes of stdlib source than this: the Python installation lacks its sources
MAX_SCANNED_TOKENS = 2**28  # token files up to this size are scanned for ids ≥ vocab up front (≈0.2 s/GB)


def window_tokens(seq_len: int) -> int:
    """Tokens one training window reads: ``seq_len`` inputs and the next-token target of the last."""
    return seq_len + 1


def _prepare_hint(path: Path | str) -> str:
    return f"make it with `python -m recipes.prepare --output {path} FILES...`"


def read_meta(path: str | Path) -> dict:
    """The checked ``meta.json`` of a token directory: ``dtype`` (uint16/uint32), ``vocab_size``
    (positive int) and, when the writer recorded them, the token count per split. Raises
    :class:`DataError` saying what is wrong with the directory and how to make a good one."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"no such directory; {_prepare_hint(path)}")
    if not path.is_dir():
        raise DataError(
            "a file, not a token directory; give the directory `python -m recipes.prepare "
            "--output DIR FILES...` wrote (train.bin, val.bin, meta.json)"
        )
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"holds no meta.json, so recipes.tools.prepare did not write it; {_prepare_hint(path)}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is not valid JSON ({e}); write it again with recipes.tools.prepare") from None
    ok = (
        isinstance(meta, dict)
        and meta.get("dtype") in DTYPES
        and isinstance(meta.get("vocab_size"), int)
        and not isinstance(meta.get("vocab_size"), bool)
        and meta["vocab_size"] >= 1
    )
    if not ok:
        raise DataError(
            f'{meta_path} needs "dtype" (one of {sorted(DTYPES)}) and a positive integer '
            f'"vocab_size", got {str(meta)[:120]}; write it again with recipes.tools.prepare'
        )
    return meta


def split_tokens(path: str | Path, split: str, meta: dict) -> np.ndarray | ShardedTokens:
    """The token ids of one split, memory-mapped: the shards ``meta["shards"][split]`` lists (what
    ``recipes.prepare`` writes), else ``<split>.bin``; each checked against ``meta``: present,
    non-empty, a whole number of ids, and as many in all as the header records."""
    names = (meta.get("shards") or {}).get(split) if isinstance(meta.get("shards"), dict) else None
    parts = [_one_file(Path(path) / name, split, meta) for name in (names or [f"{split}.bin"])]
    total = sum(p.size for p in parts)
    want = (meta.get("tokens") or {}).get(split) if isinstance(meta.get("tokens"), dict) else None
    if want is not None and want != total:
        where = Path(path) / (f"{split}-*.bin" if names else f"{split}.bin")
        raise DataError(
            f"{where} holds {total:,} tokens but meta.json says {want:,} (truncated or "
            f"replaced); write the directory again with recipes.tools.prepare"
        )
    return parts[0] if len(parts) == 1 else ShardedTokens(parts)


def _one_file(bin_path: Path, split: str, meta: dict) -> np.ndarray:
    if not bin_path.is_file():
        raise DataError(
            f"{bin_path} is missing (the {split!r} split); write the directory again with recipes.tools.prepare"
        )
    item = np.dtype(DTYPES[meta["dtype"]]).itemsize
    size = bin_path.stat().st_size
    if size == 0 or size % item:
        raise DataError(
            f"{bin_path} has {size} bytes, not a positive multiple of {item} ({meta['dtype']}); "
            f"it is empty or truncated: write it again with recipes.tools.prepare"
        )
    return np.memmap(bin_path, dtype=DTYPES[meta["dtype"]], mode="r")


class ShardedTokens:
    """Several memory-mapped shards read as one array: ``size``, ``dtype``, slices and integer-array
    indexing (a window may span two shards)."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts, self.dtype = parts, np.result_type(*(p.dtype for p in parts))
        self.starts = np.cumsum([0] + [p.size for p in parts])
        self.size = int(self.starts[-1])

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self[np.arange(*index.indices(self.size))]
        index = np.asarray(index)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty(index.shape, dtype=self.dtype)
        for s in np.unique(shard):
            sel = shard == s
            out[sel] = self.parts[s][index[sel] - self.starts[s]]
        return out


def document_index(path: str | Path, split: str, meta: dict, n_tokens: int) -> np.ndarray:
    """The document ends of one split (``<split>.idx``, uint64, memory-mapped) that ``packing=documents``
    reads; :class:`DataError` when the directory has none or it does not cover the split's tokens."""
    name = (meta.get("index") or {}).get(split) if isinstance(meta.get("index"), dict) else None
    where = Path(path) / (name or f"{split}.idx")
    if not name or not where.is_file():
        raise DataError(
            f"{where} is missing: data.packing=documents needs the document index that `python -m recipes.prepare` "
            f"writes (this corpus has none); prepare it again with recipes.prepare, or use data.packing=concat"
        )
    size = where.stat().st_size
    ends = np.memmap(where, dtype=np.uint64, mode="r") if size and not size % 8 else np.zeros(0, np.uint64)
    if ends.size == 0 or int(ends[-1]) != n_tokens:
        last = int(ends[-1]) if ends.size else 0
        raise DataError(
            f"{where} ends at token {last:,} but the {split!r} split holds {n_tokens:,} (truncated or replaced); "
            f"prepare it again with recipes.prepare"
        )
    return ends


def max_token(tokens: np.ndarray | ShardedTokens, chunk: int = 1 << 24) -> int:
    """The largest id in ``tokens``, read in chunks (bounded memory)."""
    if isinstance(tokens, ShardedTokens):
        return max(max_token(p, chunk) for p in tokens.parts)
    return max(int(tokens[i : i + chunk].max()) for i in range(0, tokens.size, chunk))


def cache_dir() -> Path:
    return Path(os.environ.get("GRIDTRAIN_CACHE", Path.home() / ".cache" / "gridtrain"))


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # concurrent ranks: the last identical write wins


def write_token_dir(path: str | Path, splits: dict[str, np.ndarray], vocab_size: int) -> Path:
    """Write ``{split: token array}`` as ``<split>.bin`` plus ``meta.json`` into ``path``."""
    path = Path(path)
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    for name, tokens in splits.items():
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise DataError(f"split {name!r} has token ids outside [0, {vocab_size})")
        _atomic_write(path / f"{name}.bin", arr.astype(DTYPES[dtype]).tobytes())
    meta = {"dtype": dtype, "vocab_size": vocab_size, "tokens": {k: int(np.asarray(v).size) for k, v in splits.items()}}
    _atomic_write(path / "meta.json", json.dumps(meta, indent=1).encode())
    return path


def embedded_corpus(mb: float = 4.0, val_fraction: float = 0.05) -> Path:
    """The byte-level stdlib-source corpus as a token directory (built once, cached)."""
    limit = int(mb * 2**20)
    out = cache_dir() / f"stdlib-bytes-{limit}-{val_fraction}"
    if (out / "meta.json").exists():
        return out
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts:
            continue
        try:
            b = f.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        size += len(b)
        if size >= limit:
            break
    data = np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)
    if data.size < min(limit, MIN_SOURCE_BYTES):
        raise DataError(
            f"found only {data.size} bytes of Python source under {root} (this Python installation "
            f"ships without its sources); use data.source=memmap with recipes.tools.prepare"
        )
    n_val = max(1, int(data.size * val_fraction))
    if not 0 < val_fraction < 1 or n_val >= data.size:
        raise DataError(
            f"val_fraction {val_fraction} of {data.size} bytes leaves no training tokens; "
            f"use data.val_fraction in (0, 1)"
        )  # nothing cached
    return write_token_dir(out, {"train": data[:-n_val], "val": data[-n_val:]}, vocab_size=256)


@dataclass
class TokenDataset:
    """One split of a token directory, memory-mapped; samples fixed-length windows.

    ``sampling="random"``: each step draws its windows' starts anywhere, with replacement.
    ``"epoch"``: the split is cut into :meth:`n_windows` windows (stride ``seq_len``), and the global
    batches walk a seeded permutation of them, a fresh one per epoch: each window is read once per
    epoch. Both are functions of (seed, step, global batch) alone, so any layout reads the same."""

    tokens: np.ndarray
    vocab_size: int
    seq_len: int
    sampling: str = "random"
    doc_ends: np.ndarray | None = None  # packing=documents: one past each document's last token (uint64)

    def n_windows(self) -> int:
        """Windows of an epoch: ``seq_len`` inputs each, consecutive ones sharing one token (the target)."""
        return (self.tokens.size - 1) // self.seq_len

    def epochs_done(self, steps: int, global_batch: int) -> float:
        """Epochs read after ``steps`` steps of ``global_batch`` windows (epoch sampling's count)."""
        return steps * global_batch / self.n_windows()

    def metrics(self, steps: int, global_batch: int) -> dict:
        """What a logged row says about the data after ``steps`` steps: the epochs read (1.25: a
        quarter into the second) under epoch sampling, else nothing."""
        return {"epoch": self.epochs_done(steps, global_batch)} if self.sampling == "epoch" else {}

    @classmethod
    def open(
        cls, path: str | Path, split: str, seq_len: int, sampling: str = "random", packing: str = "concat"
    ) -> TokenDataset:
        path = Path(path)
        try:
            meta = read_meta(path)
        except DataError as e:
            raise DataError(f"{path}: {e}") from None
        tokens = split_tokens(path, split, meta)
        if tokens.size < window_tokens(seq_len):
            raise DataError(
                f"{path / (split + '.bin')} holds {tokens.size:,} tokens, fewer than one window of "
                f"seq_len {seq_len} + 1 = {window_tokens(seq_len):,}"
            )
        if sampling not in SAMPLINGS:
            raise DataError(f"data.sampling must be one of {SAMPLINGS}, got {sampling!r}")
        ends = document_index(path, split, meta, tokens.size) if packing == "documents" else None
        return cls(tokens=tokens, vocab_size=int(meta["vocab_size"]), seq_len=seq_len, sampling=sampling, doc_ends=ends)

    def offsets(self, step: int, count: int, seed: int) -> np.ndarray:
        """The ``count`` window starts of ``step`` (0-based), a function of (seed, step, count) only.
        Random sampling: any window that fits (start + seq_len + 1 ≤ tokens); epoch sampling: windows
        ``step·count … step·count + count − 1`` of the epoch-by-epoch permutation."""
        if self.sampling == "epoch":
            return epoch_walk(step * count, count, self.n_windows(), (seed,)) * self.seq_len
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, self.tokens.size - window_tokens(self.seq_len) + 1, size=count)

    def windows(self, starts: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Inputs and next-token targets ``[len(starts), seq_len]`` (int64); with a document index
        (``packing=documents``) also the inputs' positions in their documents (:func:`window_positions`)."""
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        chunk = torch.from_numpy(self.tokens[idx].astype(np.int64))
        if self.doc_ends is None:
            return chunk[:, :-1], chunk[:, 1:]
        return chunk[:, :-1], chunk[:, 1:], window_positions(self.doc_ends, np.asarray(starts), self.seq_len)

    def global_batch(self, step: int, global_batch: int, seed: int) -> tuple[torch.Tensor, ...]:
        return self.windows(self.offsets(step, global_batch, seed))

    def rank_microbatches(
        self,
        step: int,
        *,
        global_batch: int,
        dp: int,
        dp_rank: int,
        micro_batch: int,
        seed: int,
        cp: int = 1,
        cp_rank: int = 0,
    ) -> list[tuple[torch.Tensor, ...]]:
        """This DP rank's micro-batches of ``step``: disjoint, contiguous slices of the global batch
        (inputs, targets and, packing documents, positions: :meth:`windows`); with ``cp > 1``, cp rank
        ``cp_rank``'s part of each sequence (``seq_len/cp`` tokens) of the inputs and targets; the
        positions stay whole (every cp rank builds the whole window's document mask)."""
        starts = self.offsets(step, global_batch, seed)
        per_rank = global_batch // dp
        mine = starts[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        mbs = [self.windows(mine[i : i + micro_batch]) for i in range(0, per_rank, micro_batch)]
        return [(cp_slice(mb[0], cp, cp_rank), cp_slice(mb[1], cp, cp_rank), *mb[2:]) for mb in mbs]


def batch_shortfalls(rc, seq_len: int) -> list[str]:
    """Warnings for the splits the run reads that hold fewer tokens than one global batch's windows
    (``train.global_batch × (seq_len + 1)``): such a run trains (windows are drawn anywhere in the
    split), but every batch repeats tokens. Reads file sizes only; a split that cannot be opened is
    :func:`recipes.training.preflight.check_data`'s to refuse."""
    d, t = rc.data, rc.train
    try:
        path = embedded_corpus(d.embedded_mb, d.val_fraction) if d.source == "embedded" else Path(d.path)
        meta = read_meta(path)
    except (DataError, OSError, TypeError):
        return []
    need = t.global_batch * window_tokens(seq_len)
    out = []
    for split in ["train", "val"] if t.eval_every else ["train"]:
        try:
            have = split_tokens(path, split, meta).size
        except (DataError, OSError):
            continue
        if have < need:
            out.append(
                f"the {split} split ({path / (split + '.bin')}) holds {have:,} tokens, fewer than one global batch "
                f"of train.global_batch {t.global_batch} × (model.seq_len {seq_len} + 1) = {need:,}: every batch "
                f"repeats tokens (its windows overlap); use more data, or a smaller train.global_batch or model.seq_len"
            )
    return out


def open_data(
    source: str,
    path: str | None,
    split: str,
    seq_len: int,
    embedded_mb: float = 4.0,
    val_fraction: float = 0.05,
    sampling: str = "auto",
    blend: str | None = None,
    packing: str = "concat",
) -> TokenDataset:
    """The dataset a recipe's ``data`` config names: ``blend`` (prepared corpora mixed by weight,
    :mod:`.blend`), else ``source``. ``sampling="auto"``: epochs for prepared data, random windows
    for the embedded corpus. ``packing="documents"``: windows carry their positions (needs the
    document index ``recipes.prepare`` writes)."""
    if sampling == "auto":
        sampling = "epoch" if source == "memmap" or blend else "random"
    if blend:
        from .blend import open_blend

        return open_blend(blend, split, seq_len, sampling, packing)
    if source == "embedded":
        path = embedded_corpus(embedded_mb, val_fraction)
    elif source != "memmap":
        raise DataError(f"unknown data.source {source!r}; expected 'embedded' or 'memmap'")
    return TokenDataset.open(path, split, seq_len, sampling, packing)
