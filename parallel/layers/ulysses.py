"""DeepSpeed-Ulysses context-parallel attention: all-to-alls trade the sequence split for a head split.

An all-to-all over the ``cp`` group turns ``[b, h, s/cp, d]`` into ``[b, h/cp, s, d]`` for q, k and
v, SDPA (the device's best kernel) runs on whole sequences of ``h/cp`` heads, and an all-to-all turns
the output back. The (TP-local) query and kv heads must divide by cp
(:func:`~parallel.layers.ring_attention.check_ulysses_heads`). Bytes:
:func:`~parallel.layers.ring_attention.ulysses_bytes`. The sequence layout (which chunks a rank holds)
is :mod:`.ring_attention`'s, so both implementations take the same inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import comm
from ..comm.autograd import autograd_pair
from .documents import DocumentMask, document_attention
from .ring_attention import _check_qkv, check_ulysses_heads, cp_positions


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, h, s/cp, d]`` → ``[b, h/cp, s, d]`` (the sequence in rank order, not global order)."""
    cp = comm.group_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # chunk j: heads for rank j
    recv = comm.all_to_all_chunks(send, group)  # chunk i: my heads, rank i's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: ``[b, h/cp, s, d]`` → ``[b, h, s/cp, d]``."""
    cp = comm.group_size(group)
    b, hl, s, d = x.shape
    send = x.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk i: rank i's tokens
    recv = comm.all_to_all_chunks(send, group)  # chunk j: rank j's heads, my tokens
    # [b, s/cp, h, d] in memory (as SDPA's kernels store their output): [b, s/cp, h·d] is a view
    return recv.permute(1, 3, 0, 2, 4).reshape(b, s // cp, cp * hl, d).transpose(1, 2)


# the two all-to-alls are each other's adjoint
_SeqToHeads = autograd_pair("_SeqToHeads", _seq_to_heads, lambda grad, group: _heads_to_seq(grad.contiguous(), group))
_HeadsToSeq = autograd_pair("_HeadsToSeq", _heads_to_seq, lambda grad, group: _seq_to_heads(grad.contiguous(), group))


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    *,
    causal: bool = True,
    scale: float | None = None,
    documents: DocumentMask | None = None,
) -> torch.Tensor:
    """The same contract as :func:`ring_attention`, by all-to-all (DeepSpeed-Ulysses). ``documents``
    (the whole window's, :mod:`.documents`): document-causal attention over the gathered sequence.

    Four all-to-alls on ``group`` forward (q, k, v in; the output back) and four
    backward, each moving ``(cp−1)/cp`` of its tensor (:func:`ulysses_bytes`).
    Heads must divide by cp (:func:`check_ulysses_heads` refuses up front)."""
    _check_qkv(q, k, v, "ulysses_attention")
    cp = comm.group_size(group) if group is not None else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    gqa = q.shape[1] != k.shape[1]
    if cp == 1 and documents is not None:
        return document_attention(q, k, v, documents, scale=scale)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    check_ulysses_heads(q.shape[1], k.shape[1], cp, 1)
    s_local = q.shape[2]
    # rank order → global order: token j of the gathered sequence sits at global position order[j]
    order = torch.cat([cp_positions(s_local * cp, cp, r, device=q.device) for r in range(cp)])
    inverse = torch.argsort(order)
    qs, ks, vs = (_SeqToHeads.apply(t.contiguous(), group).index_select(2, inverse) for t in (q, k, v))
    if documents is not None:
        out = document_attention(qs, ks, vs, documents, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa)
    return _HeadsToSeq.apply(out.index_select(2, order).contiguous(), group)
