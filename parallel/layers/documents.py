"""Document-causal attention for packed windows (``data.packing=documents``).

A packed window holds several documents back to back. Its **positions** ``[b, s]`` (int64) restart at
0 where each document starts (and at the window's first token, which may sit inside a document);
everything else follows from them: the document id of a token is the number of restarts up to it,
and a query attends to a key only if both share a document and the key is not later
(:func:`document_ids`, :class:`DocumentMask`).

Kernels, picked once per device type (:func:`document_kernel`):

- ``flex`` (CUDA): ``torch.nn.attention.flex_attention`` under ``torch.compile`` with a block mask
  built from the document ids, so fully masked blocks are skipped (torch 2.13; its CPU build has no
  backward, hence CUDA only);
- ``sdpa`` (elsewhere, and the reference): ``F.scaled_dot_product_attention`` with a boolean
  ``[b, 1, s, s]`` mask, memory ``b·s²`` bytes.

Context parallelism: every cp rank holds the whole window's positions (tiny next to its
activations), so no rank needs another's document ids; its own tokens' positions (rotary, learned)
are ``local`` (:func:`~parallel.layers.ring_attention.cp_slice` of them); Ulysses attends over the
whole window with this mask, the ring masks each K/V block by :attr:`DocumentMask.ids` of its
queries and keys. No communication: the mask is built locally.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

DOCUMENT_KERNELS = ("flex", "sdpa")


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """The document index of every token ``[b, s]``: 0 for the window's first document, +1 at each
    position that restarts at 0."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=-1) - 1


@functools.cache
def document_kernel(device_type: str, head_dim: int = 64) -> str:
    """``flex`` on CUDA when torch has flex attention and the head dim is a power of two ≥ 16 (what its
    Triton kernels tile without padding), else ``sdpa``; decided once per (device type, head dim)."""
    if device_type != "cuda" or head_dim < 16 or head_dim & (head_dim - 1):
        return "sdpa"
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flex"


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention, dynamic=False), create_block_mask


class DocumentMask:
    """The attention pattern of packed windows, from their ``positions`` ``[b, s]`` (module doc).

    Built once per micro-batch and shared by every attention layer of a stage: each kernel's mask
    is made on first use and kept (``sdpa``: a boolean ``[b, 1, s, s]``; ``flex``: a block mask).
    ``local``: the positions of the tokens this rank holds (its cp part; default: all of them)."""

    def __init__(self, positions: torch.Tensor, local: torch.Tensor | None = None):
        if positions.dim() != 2:
            raise ValueError(f"positions must be [batch, seq], got shape {tuple(positions.shape)}")
        self.positions = positions
        self.local = positions if local is None else local
        self.ids = document_ids(positions)
        self._masks: dict[str, object] = {}
        self.kernel: str | None = None  # set by prepare(): the kernel attention uses

    def prepare(self, kernel: str) -> DocumentMask:
        """Build ``kernel``'s mask now (``flex`` / ``sdpa``), before the blocks run: a mask first made
        inside a compiled or checkpointed region would be a side effect of its trace (an error under
        ``torch.compile``'s selective recomputation). Returns ``self``."""
        if kernel not in DOCUMENT_KERNELS:
            raise ValueError(f"document attention kernel {kernel!r} not in {DOCUMENT_KERNELS}")
        self.block_mask() if kernel == "flex" else self.dense()
        self.kernel = kernel
        return self

    def dense(self) -> torch.Tensor:
        """``True`` where query ``i`` may attend to key ``j``: same document and ``j ≤ i``; ``[b, 1, s, s]``."""
        if "sdpa" not in self._masks:
            s = self.ids.shape[-1]
            causal = torch.ones(s, s, dtype=torch.bool, device=self.ids.device).tril()
            self._masks["sdpa"] = (self.ids[:, None, :, None] == self.ids[:, None, None, :]) & causal
        return self._masks["sdpa"]

    def block_mask(self):
        """flex attention's block mask of the same pattern (built by ``create_block_mask``)."""
        if "flex" not in self._masks:
            _, create_block_mask = _flex()
            ids = self.ids

            def same_document_causal(b, h, q, k):
                return (ids[b, q] == ids[b, k]) & (q >= k)

            b, s = ids.shape
            self._masks["flex"] = create_block_mask(same_document_causal, b, None, s, s, device=ids.device)
        return self._masks["flex"]


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    *,
    scale: float | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Document-causal attention of ``q`` ``[b, h, s, hd]`` over ``k``, ``v`` ``[b, h_kv, s, hd]``
    (grouped-query when ``h_kv < h``; ``scale`` default ``1/√hd``); ``kernel`` (``flex``/``sdpa``)
    overrides the mask's prepared kernel, which overrides the device's pick."""
    kernel = kernel or mask.kernel or document_kernel(q.device.type, q.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    if kernel == "flex":
        flex, _ = _flex()
        return flex(q, k, v, block_mask=mask.block_mask(), scale=scale, enable_gqa=gqa)
    if kernel != "sdpa":
        raise ValueError(f"document attention kernel {kernel!r} not in {DOCUMENT_KERNELS}")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), scale=scale, enable_gqa=gqa)
