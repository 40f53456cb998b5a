"""Context-parallel attention: the sequence is split over a ``cp`` group.

Layout (one home, :func:`cp_chunks`): the global sequence is cut into ``2·cp``
equal chunks and cp rank ``i`` holds chunks ``i`` and ``2·cp−1−i``, in that
order (Megatron-Core's load balancing). Under a causal mask every rank then has
the same amount of work: early chunks see few keys, late chunks many, and each
rank holds one of each. Data loading slices samples with :func:`cp_slice`;
rotary / learned positions use :func:`cp_positions`.

Two ways to attend over the whole sequence:

* :func:`ring_attention` — K and V (one packed ``[b, h_kv, s/cp, d + d_v]`` block; V
  may be narrower than Q and K, as multi-head latent attention's) travel around the cp ring, ``cp−1`` hops forward; each rank merges the
  partial results of its queries against every block with the log-sum-exp rule.
  The next block's transfer (``isend``/``irecv`` through :func:`parallel.comm.exchange`)
  is posted before the current block's compute and awaited after it
  (:data:`parallel.overlap.RING_ATTENTION`, which the planner prices). One kernel
  call per step (:func:`ring_block`): the causal mask's hidden quarters are never
  computed. Backward sends K/V around again (``cp−1`` hops) and the fp32 dK/dV
  accumulators with them (``cp−1`` hops: the owner keeps its own share and the rest
  comes home on the last hop). Per block (:mod:`.ring_kernels`, one dispatch for every device):
  a torch SDPA kernel that returns the log-sum-exp and whose backward takes the merged output
  and log-sum-exp — the CPU's flash kernel, on CUDA the flash kernel (fp16/bf16) or the
  memory-efficient one (fp32 too) — and an exact fp32 math kernel in query-row tiles for what
  they refuse (other devices, the dry run's meta tensors, head dims they do not take).
* :func:`~parallel.layers.ulysses.ulysses_attention` — DeepSpeed-Ulysses (:mod:`.ulysses`): an all-to-all turns
  ``[b, h, s/cp, d]`` into ``[b, h/cp, s, d]`` for q, k and v, SDPA runs on whole
  sequences of ``h/cp`` heads, and an all-to-all turns the output back. Needs
  the (TP-local) query and kv heads divisible by cp (:func:`check_ulysses_heads`).

Bytes sent per rank per layer (``KV`` = bytes of this rank's packed K and V,
``b·h_kv·(s/cp)·(d + d_v)·elt``; :func:`ring_bytes`, :func:`ulysses_bytes`):
ring forward ``(cp−1)·KV``, backward ``(cp−1)·(KV + KV_fp32)``; Ulysses
forward ``(cp−1)/cp·(Q+KV+O)``, backward the same.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..comm import traceable
from ..dims import CP_IMPLS, cp_seq_len_problem, ulysses_heads_problem
from . import ring_kernels
from .linear import LayerConfigError

# ---------------------------------------------------------------- layout (pure)


def cp_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2·cp``) that cp rank ``rank`` holds, in local order.

    >>> [cp_chunks(4, r) for r in range(4)]
    [(0, 7), (1, 6), (2, 5), (3, 4)]
    """
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside [0, {cp})")
    return rank, 2 * cp - 1 - rank


def check_cp_seq_len(seq_len: int, cp: int) -> None:
    """Refuse a sequence the load-balanced layout cannot split: it needs ``2·cp`` equal chunks
    (the rule and its words: :func:`parallel.dims.cp_seq_len_problem`)."""
    problem = cp_seq_len_problem(seq_len, cp)
    if problem:
        raise LayerConfigError(problem)


def cp_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (``int64``, length ``seq_len/cp``) of the tokens cp rank ``rank`` holds."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    check_cp_seq_len(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in cp_chunks(cp, rank)])


def cp_slice(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of ``x`` along ``dim`` (the sequence): chunks ``rank`` and ``2·cp−1−rank``."""
    if cp == 1:
        return x
    check_cp_seq_len(x.shape[dim], cp)
    parts = x.chunk(2 * cp, dim=dim)
    return torch.cat([parts[i] for i in cp_chunks(cp, rank)], dim=dim)


def cp_unslice(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`cp_slice`: the whole sequence from every cp rank's part (in rank order)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=dim)
        i, j = cp_chunks(cp, r)
        chunks[i], chunks[j] = a, b
    return torch.cat(chunks, dim=dim)


def ring_block(cp: int, rank: int, src: int, causal: bool) -> tuple[str, str, bool]:
    """What rank ``rank`` computes against ``src``'s K/V block: ``(query rows, key rows, causal)``.

    Rows are ``"all"`` or one half (``"first"``, ``"second"``) of the local sequence. Under a
    causal mask: its own block with the causal mask over the local sequence (chunk ``i``
    never sees chunk ``2·cp−1−i``, which the local order puts after it, while chunk
    ``2·cp−1−i`` sees all of chunk ``i``: exactly the global mask); an earlier rank's block
    (``src < rank``): all queries against its first chunk, unmasked; a later rank's block:
    this rank's second chunk against both, unmasked. One kernel call per step, and every
    rank computes ``2·cp + 1`` (query half × key half) pairs in all: the load balance.

    >>> [ring_block(2, 1, src, True) for src in (1, 0)]
    [('all', 'all', True), ('all', 'first', False)]
    """
    if not causal:
        return "all", "all", False
    if src == rank:
        return "all", "all", True
    return ("all", "first", False) if src < rank else ("second", "all", False)


def _rows(t: torch.Tensor, which: str, dim: int = 2) -> torch.Tensor:
    if which == "all":
        return t
    half = t.shape[dim] // 2
    return t.narrow(dim, 0 if which == "first" else half, half)


def ring_bytes(
    batch: int, kv_heads: int, local_seq: int, head_dim: int, cp: int, elt: int, v_head_dim: int | None = None
) -> dict[str, float]:
    """Bytes one rank sends per ring-attention call (one layer): ``forward``, ``backward`` and ``kv`` (one block).

    Forward ``cp−1`` K/V hops; backward ``cp−1`` K/V hops and ``cp−1`` hops of the fp32 dK/dV
    accumulators (4 bytes an element; K/V travel in the input's ``elt``). ``v_head_dim``: V's width
    when it is not K's (multi-head latent attention)."""
    kv = batch * kv_heads * local_seq * (head_dim + (head_dim if v_head_dim is None else v_head_dim))
    if cp == 1:
        return {"kv": kv * elt, "forward": 0.0, "backward": 0.0}
    return {"kv": kv * elt, "forward": (cp - 1) * kv * elt, "backward": (cp - 1) * kv * (elt + 4)}


def ulysses_bytes(
    batch: int, heads: int, kv_heads: int, local_seq: int, head_dim: int, cp: int, elt: int, v_head_dim=None
) -> dict:
    """Bytes one rank sends per Ulysses attention call: all-to-alls of q, k, v and the output, each way
    (``v_head_dim``: the width of v and the output when it is not q's and k's, as in MLA)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    per = batch * local_seq * elt * (heads * (head_dim + dv) + kv_heads * (head_dim + dv))  # q + o + k + v
    sent = (cp - 1) / cp * per if cp > 1 else 0.0
    return {"forward": sent, "backward": sent}


def check_ulysses_heads(n_heads: int, n_kv_heads: int, cp: int, tp: int) -> None:
    """Refuse Ulysses when the heads cannot be spread over ``cp·tp`` ranks (:func:`parallel.dims.ulysses_heads_problem`)."""
    problem = ulysses_heads_problem(n_heads, n_kv_heads, cp, tp)
    if problem:
        raise LayerConfigError(problem)


def check_cp_impl(impl: str) -> None:
    if impl not in CP_IMPLS:
        raise LayerConfigError(f"cp_impl {impl!r} is not one of {', '.join(CP_IMPLS)}")


# ---------------------------------------------------------------- block kernel


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V ``[b, h_kv, s, d]`` repeated for grouped-query attention (query head i uses kv head i // g)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold_kv(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand_kv`: summed over each kv head's query group."""
    b, h, s, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _kind(q, k, v, causal: bool, mask) -> str:
    return "math" if mask is not None else ring_kernels.choose(q, k, v, causal)


def _attend(q, k, v, causal: bool, scale: float, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: ``(out, fp32 log-sum-exp [b, h, sq])``, by the kernel :func:`.ring_kernels.choose` picks
    for it (CPU: torch's flash kernel; CUDA: torch's flash or memory-efficient kernel; else exact math;
    a document ``mask``: exact math)."""
    return ring_kernels.attend(_kind(q, k, v, causal, mask), q, k, v, causal, scale, mask)


def _attend_backward(do, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """A block's ``dq, dk, dv`` given the *merged* output and log-sum-exp of all blocks (so that
    ``exp(S − lse)`` is this block's share of the softmax and ``rowsum(dO·O)`` the whole row's)."""
    kind = _kind(q, k, v, causal, mask)
    return ring_kernels.attend_backward(kind, do, q, k, v, out, lse, causal, scale, mask)


def _block_mask(ids, cp: int, rank: int, src: int, rows: str, cols: str):
    """Packed documents: which of this block's (query, key) pairs share a document, ``[b, 1, sq, sk]``,
    from the whole window's document ids ``[b, s]`` (every rank holds them: nothing travels); None
    without documents. The ring's causal structure is :func:`ring_block`'s, applied besides."""
    if ids is None:
        return None
    qi, ki = _rows(cp_slice(ids, cp, rank), rows, dim=1), _rows(cp_slice(ids, cp, src), cols, dim=1)
    return (qi[:, :, None] == ki[:, None, :])[:, None]


def _merge(acc, out, lse):
    """Log-sum-exp merge of a block's ``(out, lse)`` into the running fp32 ``acc`` (``None`` at first)."""
    if acc is None:
        return out.float(), lse
    o0, l0 = acc
    new = torch.logaddexp(l0, lse)
    return o0 * torch.exp(l0 - new).unsqueeze(-1) + out.float() * torch.exp(lse - new).unsqueeze(-1), new


# ---------------------------------------------------------------- ring


def _ring_peers(group) -> tuple[int, int, int, int]:
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp)
    return cp, r, nxt, prv


def _wait(works) -> None:
    for w in works:
        w.wait()


def ring_forward(q, k, v, group, causal: bool, scale: float, ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward: ``(out [b, h, s, d] stored as [b, s, h, d], fp32 lse [b, h, s])``; ``ids``:
    packed documents' ids of the whole window (document-causal blocks), or None."""
    cp, r, nxt, prv = _ring_peers(group)
    h, dk = q.shape[1], k.shape[-1]
    kv = torch.cat([k, v], dim=-1)  # one block per hop; v may be narrower than k (MLA)
    halves: list = [None, None]  # per query half: the fp32 running (output, log-sum-exp)
    for step in range(cp):
        src = (r - step) % cp
        works, nxt_kv = [], None
        if step < cp - 1:  # post the next block's transfer, then compute on this one
            nxt_kv = torch.empty_like(kv)
            works = comm.exchange(sends=[(kv, nxt)], recvs=[(nxt_kv, prv)], group=group)
        rows, cols, masked = ring_block(cp, r, src, causal)
        ks, vs = (_expand_kv(_rows(t, cols), h) for t in kv.split([dk, kv.shape[-1] - dk], dim=-1))
        mask = _block_mask(ids, cp, r, src, rows, cols)
        block_out, block_lse = _attend(_rows(q, rows), ks, vs, masked, scale, mask)
        if rows == "all":
            for i, (oh, lh) in enumerate(zip(block_out.chunk(2, 2), block_lse.chunk(2, 2))):
                halves[i] = _merge(halves[i], oh, lh)
        else:
            halves[1] = _merge(halves[1], block_out, block_lse)
        _wait(works)
        kv = nxt_kv
    out = torch.cat([halves[0][0], halves[1][0]], dim=2)
    lse = torch.cat([halves[0][1], halves[1][1]], dim=2)
    # stored [b, s, h, d] (as SDPA's kernels store it), so that the caller's [b, s, h·d] is a view
    return out.transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2), lse


def ring_backward(grad_out, q, k, v, out, lse, group, causal: bool, scale: float, ids=None) -> tuple[torch.Tensor, ...]:
    """The ring's backward: ``dq, dk, dv`` in the inputs' dtypes, from what :func:`ring_forward` saved."""
    hk, dk = k.shape[1], k.shape[-1]
    cp, r, nxt, prv = _ring_peers(group)
    h = q.shape[1]
    do = grad_out.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.cat([k, v], dim=-1)
    widths = [dk, kv.shape[-1] - dk]
    own = acc = None  # dK/dV of this rank's own block; the accumulator of the block held now
    for step in range(cp):
        # step 0: the own block (its gradient stays here); step t ≥ 1: rank r−t's block, whose
        # partial dK/dV arrive from upstream (t ≥ 2) and travel on: home after cp−1 hops
        src = (r - step) % cp
        sends, recvs, nxt_kv, got = [], [], None, None
        if step < cp - 1:
            nxt_kv = torch.empty_like(kv)
            sends.append((kv, nxt))
            recvs.append((nxt_kv, prv))
        if step >= 2:
            got = torch.empty(kv.shape, dtype=torch.float32, device=q.device)
            sends.append((acc, nxt))
            recvs.append((got, prv))
        works = comm.exchange(sends=sends, recvs=recvs, group=group)
        rows, cols, masked = ring_block(cp, r, src, causal)
        ks, vs = (_expand_kv(_rows(t, cols), h) for t in kv.split(widths, dim=-1))
        mask = _block_mask(ids, cp, r, src, rows, cols)
        gq, gk, gv = _attend_backward(
            _rows(do, rows), _rows(q, rows), ks, vs, _rows(out, rows), _rows(lse, rows), masked, scale, mask
        )
        _rows(dq, rows).add_(gq)
        part = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        part_k, part_v = part.split(widths, dim=-1)
        _rows(part_k, cols).add_(_fold_kv(gk, hk))
        _rows(part_v, cols).add_(_fold_kv(gv, hk))
        _wait(works)
        if step == 0:
            own = part
        else:
            acc = part if got is None else part.add_(got)
        kv = nxt_kv
    if cp > 1:  # the last hop brings each block's accumulated dK/dV home
        home = torch.empty_like(own)
        _wait(comm.exchange(sends=[(acc, nxt)], recvs=[(home, prv)], group=group))
        own = own.add_(home)
    own_k, own_v = own.split(widths, dim=-1)
    return dq.to(q.dtype), own_k.to(k.dtype), own_v.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, ids=None):
        out, lse = ring_forward(q, k, v, group, causal, scale, ids)
        ctx.save_for_backward(q, k, v, out, lse)  # what SDPA's flash kernels keep: q, k, v, out, fp32 LSE
        ctx.group, ctx.causal, ctx.scale, ctx.ids = group, causal, scale, ids
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = ring_backward(grad_out, *ctx.saved_tensors, ctx.group, ctx.causal, ctx.scale, ctx.ids)
        return *grads, None, None, None, None


def _check_qkv(q, k, v, what: str) -> None:
    four = q.dim() == k.dim() == v.dim() == 4
    if not four or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise LayerConfigError(
            f"{what}: expected q, k [b, h|h_kv, s, d] and v [b, h_kv, s, d_v], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise LayerConfigError(f"{what}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool = True, scale: float | None = None,
    documents=None,
) -> torch.Tensor:  # fmt: skip
    """Attention of this rank's queries over the whole sequence, K/V circulating the cp ring.

    ``q`` ``[b, h, s/cp, d]``, ``k`` ``[b, h_kv, s/cp, d]``, ``v`` ``[b, h_kv, s/cp, d_v]`` (``h`` a
    multiple of ``h_kv``: grouped-query attention; ``d_v`` may differ from ``d``, as in multi-head latent
    attention), laid out as :func:`cp_slice` gives them. Returns ``[b, h, s/cp, d_v]`` in ``q``'s dtype, equal to this rank's slice of
    full-sequence SDPA. Sends per rank: see :func:`ring_bytes`; the transfers go
    through :func:`parallel.comm.exchange` on ``group`` (counted under its label).
    ``documents`` (:class:`~parallel.layers.documents.DocumentMask` of the whole window): document-causal;
    each block is masked by the document ids of its queries and keys, which every rank has (no extra
    bytes), and runs the exact math kernel (the fused ones take no mask).
    """
    _check_qkv(q, k, v, "ring_attention")
    cp = comm.group_size(group) if group is not None else 1
    if causal and cp > 1 and q.shape[2] % 2:
        raise LayerConfigError(f"ring_attention: local sequence {q.shape[2]} is odd; it must hold two equal chunks")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cp == 1 and documents is not None:
        from .documents import document_attention

        return document_attention(q, k, v, documents, scale=scale)
    if cp == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    if documents is not None and not causal:
        raise LayerConfigError("ring_attention: document masks are causal; call it with causal=True")
    ids = None if documents is None else documents.ids
    if traceable.tracing():  # under torch.compile: the ring as registered ops (.ring_traced)
        from .ring_traced import traced_ring_attention

        return traced_ring_attention(q, k, v, group, causal, scale, ids)
    return _RingAttention.apply(q, k, v, group, causal, scale, ids)


def context_parallel_attention(q, k, v, group, *, impl: str = "ring", causal: bool = True, scale=None, documents=None):
    """Dispatch to :func:`ring_attention` or :func:`ulysses_attention` (``impl`` in :data:`CP_IMPLS`);
    ``documents``: packed documents' mask of the whole window (document-causal attention)."""
    check_cp_impl(impl)
    from .ulysses import ulysses_attention  # it imports this module's layout helpers

    fn = ring_attention if impl == "ring" else ulysses_attention
    return fn(q, k, v, group, causal=causal, scale=scale, documents=documents)
