"""Context-parallel attention: the sequence is split over a ``cp`` group.

Layout (one home, :func:`cp_chunks`): the global sequence is cut into ``2·cp``
equal chunks and cp rank ``i`` holds chunks ``i`` and ``2·cp−1−i``, in that
order (Megatron-Core's load balancing). Under a causal mask every rank then has
the same amount of work: early chunks see few keys, late chunks many, and each
rank holds one of each. Data loading slices samples with :func:`cp_slice`;
rotary / learned positions use :func:`cp_positions`.

Two ways to attend over the whole sequence:

* :func:`ring_attention` — K and V (one packed ``[2, b, h_kv, s/cp, d]`` block)
  travel around the cp ring, ``cp−1`` hops forward; each rank merges the
  partial results of its queries against every block with the log-sum-exp rule.
  The next block's transfer (``isend``/``irecv`` through :func:`parallel.comm.exchange`)
  is posted before the current block's compute and awaited after it. Backward
  sends K/V around again (``cp−1`` hops) and the dK/dV accumulators with them
  (``cp`` hops: the last hop brings each block's gradient home). Per block the
  compute is an explicit fp32 math kernel that returns the log-sum-exp (so fp32
  gradients are exact; a flash kernel with LSE output is the drop-in on GPU).
  Chunk pairs a causal mask hides entirely are skipped.
* :func:`ulysses_attention` — DeepSpeed-Ulysses: an all-to-all turns
  ``[b, h, s/cp, d]`` into ``[b, h/cp, s, d]`` for q, k and v, SDPA runs on whole
  sequences of ``h/cp`` heads, and an all-to-all turns the output back. Needs
  the (TP-local) query and kv heads divisible by cp (:func:`check_ulysses_heads`).

Bytes sent per rank per layer (``KV`` = bytes of this rank's packed K and V,
``2·b·h_kv·(s/cp)·d·elt``; :func:`ring_bytes`, :func:`ulysses_bytes`):
ring forward ``(cp−1)·KV``, backward ``(cp−1)·KV + cp·KV_fp32``; Ulysses
forward ``(cp−1)/cp·(Q+KV+O)``, backward the same.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from .linear import LayerConfigError

CP_IMPLS = ("ring", "alltoall")


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
    """Refuse a sequence the load-balanced layout cannot split: it needs ``2·cp`` equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        lo = seq_len // (2 * cp) * (2 * cp)
        raise LayerConfigError(
            f"seq_len {seq_len} is not divisible by 2·cp = {2 * cp}: context parallelism cuts each sample "
            f"into 2·cp equal chunks (rank i holds chunks i and 2·cp−1−i); use seq_len {lo or 2 * cp} or "
            f"{lo + 2 * cp}, or another cp"
        )


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


def block_pairs(cp: int, rank: int, src: int, causal: bool) -> list[tuple[int, int, bool]]:
    """Which (query half, key half) pairs rank ``rank`` computes against ``src``'s K/V block.

    Returns ``(q_half, kv_half, diagonal)`` for each pair a causal mask does not hide
    entirely (``diagonal``: the same chunk, so a triangular mask applies). Without
    a mask every pair is full. Each rank computes ``2·cp + 1`` half-pairs causal
    (``4·cp`` without a mask), whatever its rank: the load balance.

    >>> block_pairs(2, 0, 1, causal=True)
    [(1, 0, False), (1, 1, False)]
    """
    pairs = []
    for qh, qc in enumerate(cp_chunks(cp, rank)):
        for kh, kc in enumerate(cp_chunks(cp, src)):
            if not causal or qc > kc:
                pairs.append((qh, kh, False))
            elif qc == kc:
                pairs.append((qh, kh, True))
    return pairs


def ring_bytes(batch: int, kv_heads: int, local_seq: int, head_dim: int, cp: int, elt: int) -> dict[str, float]:
    """Bytes one rank sends per ring-attention call (one layer): ``forward``, ``backward`` and ``kv`` (one block).

    The dK/dV accumulators travel in fp32 (4 bytes), K/V in the input's ``elt``."""
    kv = 2 * batch * kv_heads * local_seq * head_dim
    if cp == 1:
        return {"kv": kv * elt, "forward": 0.0, "backward": 0.0}
    return {"kv": kv * elt, "forward": (cp - 1) * kv * elt, "backward": (cp - 1) * kv * elt + cp * kv * 4}


def ulysses_bytes(batch: int, heads: int, kv_heads: int, local_seq: int, head_dim: int, cp: int, elt: int) -> dict:
    """Bytes one rank sends per Ulysses attention call: all-to-alls of q, k, v and the output, each way."""
    per = batch * local_seq * head_dim * elt * (2 * heads + 2 * kv_heads)  # q + o + k + v
    sent = (cp - 1) / cp * per if cp > 1 else 0.0
    return {"forward": sent, "backward": sent}


def check_ulysses_heads(n_heads: int, n_kv_heads: int, cp: int, tp: int) -> None:
    """Refuse Ulysses when the heads cannot be spread over ``cp·tp`` ranks."""
    for what, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if n % (cp * tp):
            raise LayerConfigError(
                f"parallel.cp_impl=alltoall (Ulysses) needs {what} {n} divisible by cp·tp = {cp}·{tp} = "
                f"{cp * tp}: each rank attends over whole sequences of {what}/(cp·tp) heads; "
                f"use parallel.cp_impl=ring, or a cp·tp that divides {n}"
            )


def check_cp_impl(impl: str) -> None:
    if impl not in CP_IMPLS:
        raise LayerConfigError(f"cp_impl {impl!r} is not one of {', '.join(CP_IMPLS)}")


# ---------------------------------------------------------------- block kernel


def _scores(q, k, scale, diagonal):
    """``q`` ``[b, hk, g, sq, d]``, ``k`` ``[b, hk, sk, d]`` (fp32) → masked scores ``[b, hk, g, sq, sk]``."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _block_forward(q, k, v, scale, diagonal):
    s = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2))
    return out, lse


def _merge(acc, out, lse):
    """Log-sum-exp merge of a block's ``(out, lse)`` into the running ``acc`` (``None`` at first)."""
    if acc is None:
        return out, lse
    o0, l0 = acc
    new = torch.logaddexp(l0, lse)
    return o0 * torch.exp(l0 - new).unsqueeze(-1) + out * torch.exp(lse - new).unsqueeze(-1), new


def _block_backward(q, k, v, do, lse, delta, scale, diagonal):
    """Gradients of one block given the *final* ``lse`` and ``delta = rowsum(dO·O)``."""
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))  # masked entries: exp(-inf) = 0
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(ds, k.unsqueeze(2))
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2)
    return dq, dk, dv


# ---------------------------------------------------------------- ring


def _ring_peers(group) -> tuple[int, int, int, int]:
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp)
    return cp, r, nxt, prv


def _wait(works) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        cp, r, nxt, prv = _ring_peers(group)
        b, h, s, d = q.shape
        hk = k.shape[1]
        qf = q.float().reshape(b, hk, h // hk, s, d)
        kv = torch.stack([k, v]).contiguous()
        halves = lambda t, dim: t.chunk(2, dim=dim)  # noqa: E731
        qh = halves(qf, 3)
        acc = [None, None]
        for step in range(cp):
            src = (r - step) % cp
            works, nxt_kv = [], None
            if step < cp - 1:
                nxt_kv = torch.empty_like(kv)
                works = comm.exchange(sends=[(kv, nxt)], recvs=[(nxt_kv, prv)], group=group)
            kh, vh = halves(kv[0].float(), 2), halves(kv[1].float(), 2)
            for qi, ki, diag in block_pairs(cp, r, src, causal):
                acc[qi] = _merge(acc[qi], *_block_forward(qh[qi], kh[ki], vh[ki], scale, diag))
            _wait(works)
            kv = nxt_kv
        out = torch.cat([acc[0][0], acc[1][0]], dim=3).reshape(b, h, s, d)
        # stored [b, s, h, d] (as SDPA's kernels store it), so that the caller's [b, s, h·d] is a view
        out = out.transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=3)
        ctx.save_for_backward(q, k, v, out, lse)  # what SDPA's flash kernels keep: q, k, v, out, fp32 LSE
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, r, nxt, prv = _ring_peers(group)
        b, h, s, d = q.shape
        hk = k.shape[1]
        g = h // hk
        qf = q.float().reshape(b, hk, g, s, d)
        do = grad_out.float().reshape(b, hk, g, s, d)
        delta = (do * out.float().reshape(b, hk, g, s, d)).sum(-1)
        qh, doh, lseh, deltah = qf.chunk(2, 3), do.chunk(2, 3), lse.chunk(2, 3), delta.chunk(2, 3)
        dq = [torch.zeros_like(qh[0]), torch.zeros_like(qh[1])]
        kv = torch.stack([k, v]).contiguous()
        dkv = None  # the accumulated dK/dV of the block this rank held last step
        for step in range(cp):
            src = (r - step) % cp
            sends, recvs, nxt_kv, got = [], [], None, None
            if step < cp - 1:
                nxt_kv = torch.empty_like(kv)
                sends.append((kv, nxt))
                recvs.append((nxt_kv, prv))
            if step > 0:  # pass the previous block's dK/dV on; receive this block's from upstream
                got = torch.empty(2, b, hk, s, d, dtype=torch.float32, device=q.device)
                sends.append((dkv, nxt))
                recvs.append((got, prv))
            works = comm.exchange(sends=sends, recvs=recvs, group=group)
            kh, vh = kv[0].float().chunk(2, 2), kv[1].float().chunk(2, 2)
            local = torch.zeros(2, b, hk, s, d, dtype=torch.float32, device=q.device)
            dkh, dvh = local[0].chunk(2, 2), local[1].chunk(2, 2)
            for qi, ki, diag in block_pairs(cp, r, src, causal):
                gq, gk, gv = _block_backward(qh[qi], kh[ki], vh[ki], doh[qi], lseh[qi], deltah[qi], scale, diag)
                dq[qi] += gq
                dkh[ki].add_(gk)
                dvh[ki].add_(gv)
            _wait(works)
            dkv = local if got is None else local.add_(got)
            kv = nxt_kv
        if cp > 1:  # the last hop brings every block's gradient home
            home = torch.empty_like(dkv)
            _wait(comm.exchange(sends=[(dkv, nxt)], recvs=[(home, prv)], group=group))
            dkv = home
        dq = torch.cat(dq, dim=3).reshape(b, h, s, d).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _check_qkv(q, k, v, what: str) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise LayerConfigError(
            f"{what}: expected q [b, h, s, d] and k, v [b, h_kv, s, d], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise LayerConfigError(f"{what}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, K/V circulating the cp ring.

    ``q`` ``[b, h, s/cp, d]``, ``k``/``v`` ``[b, h_kv, s/cp, d]`` (``h`` a multiple of
    ``h_kv``: grouped-query attention), laid out as :func:`cp_slice` gives them.
    Returns ``[b, h, s/cp, d]`` in ``q``'s dtype, equal to this rank's slice of
    full-sequence SDPA. Sends per rank: see :func:`ring_bytes`; the transfers go
    through :func:`parallel.comm.exchange` on ``group`` (counted under its label).
    """
    _check_qkv(q, k, v, "ring_attention")
    cp = comm.group_size(group) if group is not None else 1
    if causal and cp > 1 and q.shape[2] % 2:
        raise LayerConfigError(f"ring_attention: local sequence {q.shape[2]} is odd; it must hold two equal chunks")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cp == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return _RingAttention.apply(q, k, v, group, causal, scale)


# ---------------------------------------------------------------- Ulysses


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, h, s/cp, d]`` → ``[b, h/cp, s, d]`` (the sequence in rank order, not global order)."""
    cp = comm.group_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # chunk j: heads for rank j
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)  # chunk i: my heads, rank i's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: ``[b, h/cp, s, d]`` → ``[b, h, s/cp, d]``."""
    cp = comm.group_size(group)
    b, hl, s, d = x.shape
    send = x.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk i: rank i's tokens
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)  # chunk j: rank j's heads, my tokens
    # [b, s/cp, h, d] in memory (as SDPA's kernels store their output): [b, s/cp, h·d] is a view
    return recv.permute(1, 3, 0, 2, 4).reshape(b, s // cp, cp * hl, d).transpose(1, 2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """The same contract as :func:`ring_attention`, by all-to-all (DeepSpeed-Ulysses).

    Four all-to-alls on ``group`` forward (q, k, v in; the output back) and four
    backward, each moving ``(cp−1)/cp`` of its tensor (:func:`ulysses_bytes`).
    Heads must divide by cp (:func:`check_ulysses_heads` refuses up front)."""
    _check_qkv(q, k, v, "ulysses_attention")
    cp = comm.group_size(group) if group is not None else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    gqa = q.shape[1] != k.shape[1]
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    check_ulysses_heads(q.shape[1], k.shape[1], cp, 1)
    s_local = q.shape[2]
    # rank order → global order: token j of the gathered sequence sits at global position order[j]
    order = torch.cat([cp_positions(s_local * cp, cp, r, device=q.device) for r in range(cp)])
    inverse = torch.argsort(order)
    qs, ks, vs = (_SeqToHeads.apply(t.contiguous(), group).index_select(2, inverse) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa)
    return _HeadsToSeq.apply(out.index_select(2, order).contiguous(), group)


def context_parallel_attention(q, k, v, group, *, impl: str = "ring", causal: bool = True, scale=None):
    """Dispatch to :func:`ring_attention` or :func:`ulysses_attention` (``impl`` in :data:`CP_IMPLS`)."""
    check_cp_impl(impl)
    fn = ring_attention if impl == "ring" else ulysses_attention
    return fn(q, k, v, group, causal=causal, scale=scale)
