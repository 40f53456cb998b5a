"""How a split's windows are ordered across steps: the seeded permutation behind epoch sampling."""

from __future__ import annotations

import numpy as np

SAMPLINGS = ("random", "epoch")
_MASK64 = np.uint64(2**64 - 1)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit avalanche mix (splitmix64's finaliser) of uint64 ``x``."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
    """A pseudorandom permutation of ``range(n)`` seeded by ``key``, applied to ``index`` (values in
    ``range(n)``): a 4-round Feistel network on the smallest even-bit domain ≥ ``n``, walked until the
    value falls in range. O(1) memory whatever ``n``: no table of ``n`` entries is built."""
    if n < 1 or np.any((index < 0) | (index >= n)):
        raise ValueError(f"indices must lie in range({n})")
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    seed = np.uint64(0)
    for k in key:
        seed = _mix(np.asarray(seed ^ np.uint64(k & (2**64 - 1)), dtype=np.uint64))
    rounds = [_mix(np.asarray(seed + np.uint64(r + 1), dtype=np.uint64)) for r in range(4)]
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        v = x[todo]
        left, right = v >> np.uint64(half), v & low
        for r in rounds:
            left, right = right, left ^ (_mix(right ^ r) & low)
        x[todo] = (left << np.uint64(half)) | right
        todo[todo] = x[todo] >= np.uint64(n)
    return x.astype(np.int64)


def epoch_walk(first: int, count: int, n: int, key: tuple[int, ...]) -> np.ndarray:
    """Entries ``first … first + count − 1`` of the walk through ``range(n)`` that visits each index
    once per epoch, epoch ``e`` in the order ``permute(·, n, key + (e,))``."""
    walk = np.arange(first, first + count, dtype=np.int64)
    epoch, pos = walk // n, walk % n
    out = np.empty(count, dtype=np.int64)
    for e in np.unique(epoch):
        mine = epoch == e
        out[mine] = permute(pos[mine], n, (*key, int(e)))
    return out
