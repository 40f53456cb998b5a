"""Where prepared tokens go: per split, token shards and a document index, appended as they come.

``<split>-NNNNN.bin`` hold the token ids (``dtype``), each at most ``shard_tokens`` long unless one
document alone is longer; a document never straddles two shards. ``<split>.idx`` holds, per document,
the uint64 offset one past its last token in the split's concatenated stream (document ``i`` spans
``idx[i-1]:idx[i]``). Memory: one document at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

INDEX_DTYPE = np.uint64


def shard_name(split: str, i: int) -> str:
    return f"{split}-{i:05d}.bin"


class SplitWriter:
    """Appends one split's documents to ``folder`` (see the module docstring)."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = Path(folder), split, np.dtype(dtype), shard_tokens
        self.shards: list[str] = []
        self.tokens = self.documents = self._in_shard = 0
        self._bin = None
        self._idx = open(self.folder / f"{split}.idx", "wb")  # noqa: SIM115 - closed by close()
        self._last = None  # (shard file, start within it) of the last document, for pop_last

    def _new_shard(self) -> None:
        if self._bin is not None:
            self._bin.close()
        self.shards.append(shard_name(self.split, len(self.shards)))
        self._bin = open(self.folder / self.shards[-1], "wb")  # noqa: SIM115
        self._in_shard = 0

    def add(self, ids: np.ndarray) -> None:
        """Append one document's ids."""
        if self._bin is None or (self._in_shard and self._in_shard + ids.size > self.shard_tokens):
            self._new_shard()
        self._last = (self.shards[-1], self._in_shard, ids.size)
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._in_shard += ids.size
        self.tokens += ids.size
        self.documents += 1
        self._idx.write(np.asarray([self.tokens], dtype=INDEX_DTYPE).tobytes())

    def pop_last(self) -> np.ndarray:
        """Remove the document added last and return its ids (once; the one before stays)."""
        name, start, n = self._last
        self._bin.flush()
        path = self.folder / name
        ids = np.fromfile(path, dtype=self.dtype, offset=start * self.dtype.itemsize, count=n)
        if start == 0:  # it opened its shard: the shard goes with it
            self._bin.close()
            path.unlink()
            self.shards.pop()
            self._bin = None
        else:
            self._bin.truncate(start * self.dtype.itemsize)
            self._bin.seek(0, os.SEEK_END)
        self._idx.flush()
        self._idx.truncate((self.documents - 1) * np.dtype(INDEX_DTYPE).itemsize)
        self._idx.seek(0, os.SEEK_END)
        self._in_shard, self.tokens, self.documents, self._last = start, self.tokens - n, self.documents - 1, None
        return ids

    def close(self) -> dict:
        """Flush and close; the split's record for ``meta.json``."""
        for f in (self._bin, self._idx):
            if f is not None:
                f.close()
        return {"shards": self.shards, "index": f"{self.split}.idx", "tokens": self.tokens, "documents": self.documents}
