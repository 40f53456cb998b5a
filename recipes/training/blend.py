"""Several prepared corpora trained as one, in fixed proportions (``data.blend``, Megatron's blend).

``data.blend="0.7 data/web 0.3 data/code"``: weights (normalised to sum 1) and prepared folders. The
mix is exact, not drawn: after ``s`` steps of ``B`` windows, corpus ``c`` has given
``⌊s·B·W_c⌋ − ⌊s·B·W_{c−1}⌋`` windows, ``W_c`` the cumulative weight up to ``c`` (so the counts always
add up to ``s·B``, each within one window of its share). Each corpus walks its own windows, by epochs
or at random (``data.sampling``); a step's windows are shuffled together by a seeded permutation, so
every DP rank gets the mix. All of it a function of (seed, step, global batch): any layout reads the
same batches, and a resume in another layout continues them.
"""

from __future__ import annotations

import numpy as np

from .data import DataError, ShardedTokens, TokenDataset
from .sampling import epoch_walk, permute


def parse_blend(spec: str) -> list[tuple[float, str]]:
    """``"w1 path1 w2 path2 …"`` as ``[(w1, path1), …]``; :class:`DataError` on a bad spec."""
    parts = spec.split()
    if not parts or len(parts) % 2:
        raise DataError(f'data.blend must be pairs of "weight path", got {spec!r}')
    out = []
    for w, path in zip(parts[::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataError(f"data.blend: weight {w!r} (before {path}) is not a number") from None
        if not weight > 0:
            raise DataError(f"data.blend: weight {w} of {path} must be > 0")
        out.append((weight, path))
    return out


class BlendedDataset(TokenDataset):
    """The corpora ``parts`` (same vocabulary and ``seq_len``) mixed by ``weights`` (module docstring)."""

    def __init__(self, parts: list[TokenDataset], weights: list[float], names: list[str]):
        vocab = {p.vocab_size for p in parts}
        if len(vocab) > 1:
            raise DataError(
                f"data.blend: the corpora have different vocabularies {sorted(vocab)}; prepare them with one tokenizer"
            )
        flat = [t for p in parts for t in (p.tokens.parts if isinstance(p.tokens, ShardedTokens) else [p.tokens])]
        super().__init__(ShardedTokens(flat), parts[0].vocab_size, parts[0].seq_len, parts[0].sampling)
        self.parts, self.names = parts, names
        self.bases = np.cumsum([0] + [p.tokens.size for p in parts])[:-1]
        if parts[0].doc_ends is not None:  # packing=documents: the corpora's document ends, in the joined stream
            self.doc_ends = np.concatenate([p.doc_ends + np.uint64(b) for p, b in zip(parts, self.bases)])
        w = np.asarray(weights, dtype=np.float64)
        self.cumulative = np.cumsum(w / w.sum())
        self.cumulative[-1] = 1.0

    def counts(self, steps: int, global_batch: int) -> np.ndarray:
        """Windows each corpus has given after ``steps`` steps (they sum to ``steps·global_batch``)."""
        quota = np.floor(steps * global_batch * self.cumulative + 1e-9).astype(np.int64)
        quota[-1] = steps * global_batch
        return np.diff(quota, prepend=0)

    def offsets(self, step: int, count: int, seed: int) -> np.ndarray:
        before, after = self.counts(step, count), self.counts(step + 1, count)
        starts = []
        for c, part in enumerate(self.parts):
            n = int(after[c] - before[c])
            if self.sampling == "epoch":
                walk = epoch_walk(int(before[c]), n, part.n_windows(), (seed, c)) * part.seq_len
            else:
                walk = part.offsets(step, n, seed * 1_000_003 + c) if n else np.empty(0, dtype=np.int64)
            starts.append(walk + self.bases[c])
        mixed = np.concatenate(starts)
        return mixed[permute(np.arange(count), count, (seed, step, len(self.parts)))]

    def n_windows(self) -> int:
        return sum(p.n_windows() for p in self.parts)

    def metrics(self, steps: int, global_batch: int) -> dict:
        """Per corpus (in ``data.blend``'s order): the realised fraction of windows and, by epochs, the epochs read."""
        counts = self.counts(steps, global_batch)
        out = {f"blend{c}_frac": float(counts[c] / max(1, counts.sum())) for c in range(len(self.parts))}
        if self.sampling == "epoch":
            out.update({f"blend{c}_epoch": float(counts[c] / p.n_windows()) for c, p in enumerate(self.parts)})
        return out


def open_blend(spec: str, split: str, seq_len: int, sampling: str, packing: str = "concat") -> BlendedDataset:
    """The blend ``spec`` names (:func:`parse_blend`), its corpora opened at ``split``."""
    pairs = parse_blend(spec)
    parts = []
    for _, path in pairs:
        try:
            parts.append(TokenDataset.open(path, split, seq_len, sampling, packing))
        except DataError as e:
            raise DataError(f"data.blend corpus {e}") from None  # TokenDataset.open names the path
    return BlendedDataset(parts, [w for w, _ in pairs], [p for _, p in pairs])
