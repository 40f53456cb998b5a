"""How many bytes a checkpoint takes on disk, and how many a file system has free.

A checkpoint stores every global tensor once, whatever the layout (DCP writes one copy of
replicated chunks), each chunk as ``torch.save`` frames a tensor, plus DCP's index
(``.metadata``) and the manifest::

    bytes = Σ over chunks (data + frame + index entry)

The data is exact (``numel × element size`` of every tensor the caller lists); the frame is
measured here, once (``torch.save`` of an empty tensor: its zip headers; the 64-byte alignment
of the data is not counted); the index entry is DCP's pickled chunk record, about
:data:`INDEX_PER_CHUNK` bytes plus the key. One chunk per tensor is the least a save writes: a
ZeRO shard boundary inside a tensor cuts it into a few more, so the result is a lower bound,
within a few per cent of a real save for small models and within a fraction of one for large
ones (``tests/recipes/test_storage_faults.py`` compares it with real saves).
"""

from __future__ import annotations

import io
import math
import os
from functools import cache
from pathlib import Path

import torch

INDEX_PER_CHUNK = 200  # bytes of .metadata per chunk besides its key (torch 2.13: ≈ 206)


@cache
def _frame_bytes() -> int:
    buf = io.BytesIO()
    torch.save(torch.empty(0), buf)
    return len(buf.getvalue())


def checkpoint_bytes(tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes on disk of a checkpoint holding ``tensors`` (``{key: (global shape, dtype)}``), at least."""
    frame = _frame_bytes()
    total = 0
    for key, (shape, dtype) in tensors.items():
        total += math.prod(shape) * torch.empty((), dtype=dtype).element_size() + frame + INDEX_PER_CHUNK + len(key)
    return total


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path`` (or its
    nearest existing parent); None if it cannot be asked."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def format_bytes(n: int | None) -> str:
    """``10.6 MB`` (decimal units, as ``df -H`` and disk vendors count), or ``?``."""
    if n is None:
        return "?"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
