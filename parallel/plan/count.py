"""The planner's parameter counts from a real module, classed as ZeRO packs it (:mod:`parallel.zero.packing`)."""

from __future__ import annotations

from ..params import init_key, is_expert, is_shared_embedding, tp_shard_dim
from ..zero.packing import CLASSES, bucket_class, class_index
from .memory import StageParams


def count_module(module, tp: int, *, is_block: bool, sequence_parallel: bool = False) -> StageParams:
    """The :class:`StageParams` one TP rank of ``tp`` holds of ``module`` (built at tp = 1, any device), classed by
    ZeRO bucket class (experts apart), as one block (``is_block``) or the rest; ``sequence_parallel``: at tp > 1
    the replicated parameters are sequence-parallel."""
    numel = replicated = full = tied = shared = expert = 0
    groups: list[list[int]] = [[] for _ in CLASSES]  # ZeRO's bucket classes
    experts: list[list[int]] = [[] for _ in CLASSES]  # MoE experts: their own buckets (over edp)
    for p in module.parameters():
        n = p.numel()
        sharded = tp_shard_dim(p) is not None
        local = n // tp if sharded else n
        full += n
        numel += local
        replicated += 0 if sharded else n
        tied += n if init_key(p) is not None else 0  # the head's copy of a tied embedding
        shared += local if is_shared_embedding(p) else 0
        expert += local if is_expert(p) else 0
        # built at tp=1, the layers mark nothing sequence-parallel: what tp > 1 marks (packing.extra_reduce)
        kind = class_index(*bucket_class(p, sequence_parallel=sequence_parallel and tp > 1 and not sharded))
        (experts if is_expert(p) else groups)[kind].append(local)
    classes = tuple(map(tuple, groups))
    return StageParams(
        numel,
        replicated,
        full,
        tied,
        shared,
        blocks=(classes,) if is_block else (),
        root=((),) * len(CLASSES) if is_block else classes,
        expert=expert,
        expert_blocks=(tuple(map(tuple, experts)),) if expert else (),
    )
