"""A :class:`~parallel.zero.ZeroDataParallel`'s training state as global, resharding-ready pieces.

Every rank describes what it holds (through ZeRO's public
:meth:`~parallel.zero.ZeroDataParallel.shards`), without any communication and without
copying: for each parameter, the boxes of the global tensor that its ZeRO
shard covers (see :mod:`parallel.checkpoint.chunks`), each a *view* into the
fp32 master shard or into an optimizer state tensor. The keys are global::

    model/<name>               fp32 master weights     (global shape, padding cut)
    optim/<name>/<state>       per-element optimizer state (exp_avg, exp_avg_sq, momentum_buffer ...)
    optim/<name>/<scalar>      0-dim optimizer state (Adam's step), the same on every rank

``<name>`` is ``global_name(local name)``: the caller maps its module's names to
layout-independent ones (e.g. drops a pipeline-chunk prefix). A parameter
replicated over TP ranks, DP ranks (stage 0) or pipeline stages (a tied
embedding) gives identical boxes on each holder; the writer keeps one copy.
Saving reads the views; loading writes into them, then publishes the master
weights to the compute parameters — any dp, ZeRO stage, tp, pp and vpp loads
any other's checkpoint, because only global boxes are exchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..params import expert_shard, tp_shard_dim, vocab_rows
from .chunks import CheckpointError, Chunked, flat_range_boxes, to_global, tp_placement

if TYPE_CHECKING:
    from ..zero import ZeroDataParallel


def _tp_rank_size(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return torch.distributed.get_rank(tp_group), torch.distributed.get_world_size(tp_group)


def _per_element(value, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == master.shape


def zero_state_pieces(
    zdp: ZeroDataParallel, *, global_name: Callable[[str], str] = lambda n: n, tp_group=None, optimizer: bool = True
) -> dict[str, object]:
    """``{global key: Chunked | 0-dim tensor}`` over this rank's ZeRO shards (see module doc).

    Pure bookkeeping: no collective, no copy. Every optimizer state must be a
    tensor (torch's AdamW and SGD keep only tensors).
    """
    tp_rank, tp_size = _tp_rank_size(tp_group)
    out: dict[str, object] = {}
    for b in zdp.shards():
        state = zdp.shard_optimizer_state(b) if optimizer else {}
        for key, value in state.items():
            if not torch.is_tensor(value):
                raise CheckpointError(
                    f"optimizer state {key!r} is a {type(value).__name__}, not a tensor; "
                    f"only tensor state can be checkpointed"
                )
        sources = {"model": b.master.detach(), **{k: v for k, v in state.items() if _per_element(v, b.master)}}
        for slot, param in zip(b.slots, b.params):
            name = global_name(slot.name)
            ep = expert_shard(param)  # MoE experts: this ep rank's rows of the global [E, ...], like a TP dim-0 split
            dim, rank, size = (0, *ep) if ep else (tp_shard_dim(param), tp_rank, tp_size)
            place = tp_placement(slot.shape, dim, rank, size, rows=vocab_rows(param))
            for key, value in state.items():
                if not _per_element(value, b.master):
                    out[f"optim/{name}/{key}"] = value
            lo, hi = max(slot.offset, b.lo), min(slot.end, b.hi)
            if lo >= hi:
                continue
            boxes = flat_range_boxes(slot.shape, lo - slot.offset, hi - slot.offset)
            for src_key, flat in sources.items():
                key = "model/" + name if src_key == "model" else f"optim/{name}/{src_key}"
                pieces = out.setdefault(key, Chunked(place.global_shape, flat.dtype))
                start = lo - b.lo
                for box in boxes:
                    n = 1
                    for s in box[1]:
                        n *= s
                    global_box = to_global(box, place)
                    if global_box is not None:
                        view = flat[start : start + n].view(box[1])
                        pieces.add(global_box[0], view[tuple(slice(0, s) for s in global_box[1])])
                    start += n
    return {k: v for k, v in out.items() if not isinstance(v, Chunked) or v.pieces}


def whole_tensor_pieces(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, Chunked]:
    """``{prefix + name: Chunked}`` of tensors every rank holds whole and identical (e.g. the MoE
    routers' selection biases, ``[E]`` by global expert index): one piece each, a view that loading
    writes into; the writer keeps one copy, and any layout reads them back."""
    out = {}
    for name, t in tensors.items():
        out[prefix + name] = chunked = Chunked(tuple(t.shape), t.dtype)
        chunked.add((0,) * t.dim(), t)
    return out


def prepare_optimizer_state(
    zdp: ZeroDataParallel,
    saved_keys: dict[str, tuple[tuple[int, ...], torch.dtype]],
    global_name: Callable[[str], str] = lambda n: n,
) -> None:
    """Give every bucket the optimizer state tensors a checkpoint holds, so it can be read into.

    ``saved_keys``: ``{key: (global shape, dtype)}`` of the checkpoint. A fresh
    optimizer has no state until its first step; this creates zeros (per-element
    state like the master shard, 0-dim state as scalars) under the names the
    checkpoint uses for the bucket's first parameter.
    """
    for b in zdp.shards():
        prefix = f"optim/{global_name(b.slots[0].name)}/"
        wanted = {k[len(prefix) :]: v for k, v in saved_keys.items() if k.startswith(prefix)}
        if not wanted:
            continue
        state = zdp.shard_optimizer_state(b, create=True)
        for key, (shape, dtype) in wanted.items():
            if key not in state:
                state[key] = (
                    torch.zeros((), dtype=dtype, device=b.master.device)
                    if len(shape) == 0
                    else torch.zeros_like(b.master, dtype=dtype)
                )


def publish(zdp: ZeroDataParallel) -> None:
    """Copy freshly loaded master shards into the compute parameters (every stage)."""
    zdp.publish_masters()
