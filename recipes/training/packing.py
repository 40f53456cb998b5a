"""``data.packing=documents``: where the documents of a packed window start, from the document index.

A window of ``seq_len`` inputs starting at token ``st`` reads tokens ``st … st+seq_len−1``; the
position of token ``t`` is ``t − max(st, start of t's document)``: it restarts at 0 at each document
start and at the window's first token (a document cut by the window start begins there). The
document index (``<split>.idx``, :mod:`recipes.tools.prepare_writer`) holds one past each document's
last token, so the starts are exact whatever the text holds: an end-of-document id that also occurs
inside a document (the bytes tokenizer's separator in binary-ish text, a literal ``<|endoftext|>``)
would split documents that the index keeps whole. The positions depend on the window starts alone,
so the batch stays a function of (seed, step).
"""

from __future__ import annotations

import numpy as np
import torch

PACKINGS = ("concat", "documents")  # data.packing: windows read straight | documents kept apart inside them


def window_positions(doc_ends: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """Positions ``[len(starts), seq_len]`` (int64) of the windows starting at ``starts``, in their
    documents (module docstring); ``doc_ends``: the ascending document ends (uint64)."""
    starts = np.asarray(starts, dtype=np.uint64)
    idx = starts[:, None] + np.arange(seq_len, dtype=np.uint64)[None, :]
    doc = np.searchsorted(doc_ends, idx, side="right")  # the document of each token: ends ≤ t before it
    begin = np.where(doc > 0, doc_ends[np.maximum(doc, 1) - 1], 0).astype(np.int64)
    return torch.from_numpy(idx.astype(np.int64) - np.maximum(begin, starts.astype(np.int64)[:, None]))
