"""Which layers each pipeline stage holds: a balanced, contiguous split.

Pure arithmetic, no processes. The model is ``n_layers`` identical blocks plus
an embedding (on the first stage) and a head with its loss (on the last). Each
costs what the caller says (parameters, FLOPs, measured seconds; torchtitan
calls this counting them as "effective layers"). The split minimises the cost
of the most expensive stage, which is what sets the pipeline's step time::

    >>> partition_layers(7, 3)
    [range(0, 3), range(3, 5), range(5, 7)]
    >>> partition_layers(8, 4, embedding_cost=1.0, head_cost=1.0)
    [range(0, 2), range(2, 5), range(5, 7), range(7, 8)]
    >>> partition_layers(8, 2, vpp=2)            # virtual stages: rank 0 holds 0 and 2
    [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]

With ``vpp`` virtual stages per rank (interleaved schedules), rank ``s`` holds
virtual stages ``s, s + pp, s + 2·pp, ...`` (Megatron's layout), and each rank's
layers are split into ``vpp`` equal chunks: the count per rank must divide by
``vpp``.
"""

from __future__ import annotations

import heapq
import numbers
from typing import Sequence


class PartitionError(ValueError):
    """A split that cannot exist; the message names the numbers and the fix."""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PartitionError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _balanced_counts(n_layers: int, pp: int, layer_cost: float, extra: list[float]) -> list[int]:
    """Layers per stage minimising max(extra[s] + count[s]·layer_cost), every count ≥ 1.

    Identical unit jobs on machines that start at different times: handing each
    next layer to the stage that would finish it earliest is optimal (greedy
    exchange argument). Ties go to the earlier stage.
    """
    counts = [1] * pp
    heap = [(extra[s] + 2 * layer_cost, s) for s in range(pp)]
    heapq.heapify(heap)
    for _ in range(n_layers - pp):
        _, s = heapq.heappop(heap)
        counts[s] += 1
        heapq.heappush(heap, (extra[s] + (counts[s] + 1) * layer_cost, s))
    return counts


def _check_pp_layers(pp_layers: Sequence[int], n_layers: int, pp: int) -> list[int]:
    counts = list(pp_layers)
    if len(counts) != pp:
        raise PartitionError(
            f"pp_layers has {len(counts)} entries {counts} but pp={pp}: give one layer count per pipeline stage"
        )
    for s, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1:
            raise PartitionError(f"pp_layers[{s}] = {c!r}: every stage needs a positive number of layers")
    if sum(counts) != n_layers:
        raise PartitionError(
            f"pp_layers {counts} sums to {sum(counts)} but the model has {n_layers} layers; "
            f"make the counts add up to {n_layers}"
        )
    return [int(c) for c in counts]


def partition_layers(
    n_layers: int,
    pp: int,
    *,
    layer_cost: float = 1.0,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    pp_layers: Sequence[int] | None = None,
    vpp: int = 1,
) -> list[range]:
    """Contiguous layer ranges, one per stage (``vpp == 1``) or per virtual stage.

    Returns ``pp · vpp`` ranges in virtual-stage order (virtual stage ``v`` runs
    on rank ``v % pp`` as its chunk ``v // pp``) that together cover
    ``range(n_layers)`` in order. Without ``pp_layers`` the per-rank counts
    minimise the largest stage cost (:func:`stage_costs`); ``pp_layers`` (one
    count per rank) overrides them.

    Raises:
        PartitionError: pp (· vpp) greater than the layer count, a ``pp_layers``
            list of the wrong length or sum, or a per-rank count that ``vpp``
            does not divide.
    """
    n_layers = _positive_int("n_layers", n_layers)
    pp = _positive_int("pp", pp)
    vpp = _positive_int("vpp", vpp)
    if layer_cost <= 0 or embedding_cost < 0 or head_cost < 0:
        raise PartitionError(
            f"costs must be layer_cost > 0 and embedding/head ≥ 0, got layer_cost={layer_cost}, "
            f"embedding_cost={embedding_cost}, head_cost={head_cost}"
        )
    if pp * vpp > n_layers:
        raise PartitionError(
            f"pp {pp} × vpp {vpp} = {pp * vpp} (virtual) stages but only {n_layers} layers: "
            f"every stage needs at least one layer; use pp·vpp ≤ {n_layers}"
        )
    if pp_layers is not None:
        counts = _check_pp_layers(pp_layers, n_layers, pp)
    else:
        extra = [0.0] * pp
        extra[0] += embedding_cost
        extra[-1] += head_cost
        counts = _balanced_counts(n_layers, pp, layer_cost, extra)
    if vpp > 1:
        bad = [f"stage {s}: {c}" for s, c in enumerate(counts) if c % vpp]
        if bad:
            raise PartitionError(
                f"vpp={vpp} does not divide the layers per stage {counts} ({', '.join(bad)}); "
                f"each rank's layers are split into vpp equal chunks: pass pp_layers with "
                f"multiples of {vpp}, or use n_layers a multiple of pp·vpp = {pp * vpp}"
            )
    sizes = [counts[v % pp] // vpp for v in range(pp * vpp)]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_chunks(ranges: Sequence[range], pp: int, stage: int) -> list[range]:
    """The layer ranges rank ``stage`` builds, in chunk order (``ranges[stage + c·pp]``)."""
    if len(ranges) % pp:
        raise PartitionError(f"{len(ranges)} virtual stages do not split over pp={pp} ranks")
    if not 0 <= stage < pp:
        raise PartitionError(f"stage {stage} out of range for pp={pp}")
    return list(ranges[stage::pp])


def stage_costs(
    ranges: Sequence[range],
    pp: int | None = None,
    *,
    layer_cost: float = 1.0,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
) -> list[float]:
    """Cost of each rank: its layers, plus the embedding on the first virtual
    stage and the head on the last. ``pp`` (default: one range per rank) sums
    the virtual stages a rank holds."""
    pp = pp or len(ranges)
    costs = [0.0] * pp
    for v, r in enumerate(ranges):
        costs[v % pp] += len(r) * layer_cost
    costs[0] += embedding_cost
    costs[(len(ranges) - 1) % pp] += head_cost
    return costs
