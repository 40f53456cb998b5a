"""The process grid: which rank holds which (data, pipeline, tensor) coordinate.

Pure arithmetic — nothing here touches ``torch.distributed`` — so a 17,920-rank
layout can be inspected, tested and planned on a laptop::

    >>> t = Topology(dp=2, pp=2, tp=2)
    >>> t.world_size
    8
    >>> t.coords(5)
    Coords(dp=0, pp=1, tp=1)
    >>> t.rank(dp=1, pp=0, tp=1)
    3
    >>> t.groups("tp")
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> t.groups("dp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> t.groups("pp")
    [[0, 4], [1, 5], [2, 6], [3, 7]]

Rank order. By default tensor parallel varies fastest, then data, then pipeline
(``order="tp-dp-pp"``, fastest axis first, Megatron-LM's convention)::

    rank = (pp_idx * dp + dp_idx) * tp + tp_idx

so that the ranks of one TP group are adjacent and share a node (and its NVLink).
Any permutation of the three axes may be asked for; every order satisfies the
same properties (coords/rank inverse, each axis's groups partition the world).

Creating the ``torch.distributed`` subgroups for a topology is a separate step,
:func:`parallel.groups.build_groups`.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

AXES = ("dp", "pp", "tp")
DEFAULT_ORDER = "tp-dp-pp"


def world_size_mismatch(world_size: int, dp: int, pp: int, tp: int) -> str:
    """The one message for a world that is not ``dp × pp × tp`` (topology, groups, planner)."""
    hint = f" (dp=auto would give dp={world_size // (pp * tp)})" if world_size % (pp * tp) == 0 else ""
    return (
        f"world size {world_size} ≠ dp {dp} × pp {pp} × tp {tp} = {dp * pp * tp}; "
        f"with pp={pp} tp={tp} the world must be a multiple of {pp * tp}{hint}"
    )


class TopologyError(ValueError):
    """A layout that cannot exist; the message names the numbers and the fix."""


@dataclass(frozen=True)
class Coords:
    """One rank's position in the grid."""

    dp: int
    pp: int
    tp: int

    def __getitem__(self, axis: str) -> int:
        return getattr(self, axis)


def _check_size(name: str, value: object) -> int:
    # bool is an int subclass; `parallel.tp=True` is a typo, not a size.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TopologyError(f"{name} must be a positive integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise TopologyError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _parse_order(order: str | Iterable[str]) -> tuple[str, ...]:
    axes = tuple(order.split("-")) if isinstance(order, str) else tuple(order)
    if sorted(axes) != sorted(AXES):
        raise TopologyError(
            f"order must name each of dp, pp, tp exactly once (fastest first, e.g. {DEFAULT_ORDER!r}), got {order!r}"
        )
    return axes


class Topology:
    """A dp × pp × tp grid of ranks.

    Args:
        dp, pp, tp: sizes of the data-, pipeline- and tensor-parallel axes.
            ``dp=None`` (or ``"auto"``) derives dp from ``world_size``.
        world_size: the number of processes actually launched. When given, it is
            checked against dp·pp·tp (or used to derive dp).
        order: axis order, fastest-varying first, e.g. ``"tp-dp-pp"`` (default)
            or ``"tp-pp-dp"``.

    Raises:
        TopologyError: on non-integer or non-positive sizes, or a world size that
            does not equal (or, for ``dp=auto``, is not a multiple of) pp·tp.
    """

    def __init__(
        self,
        dp: int | str | None = None,
        pp: int = 1,
        tp: int = 1,
        *,
        world_size: int | None = None,
        order: str | Iterable[str] = DEFAULT_ORDER,
    ):
        pp = _check_size("pp", pp)
        tp = _check_size("tp", tp)
        if world_size is not None:
            world_size = _check_size("world size", world_size)
        if dp is None or dp == "auto":
            if world_size is None:
                raise TopologyError("dp=auto needs the world size to derive dp from")
            if world_size % (pp * tp):
                raise TopologyError(
                    f"world size {world_size} is not divisible by pp {pp} × tp {tp} = "
                    f"{pp * tp}; with pp={pp} tp={tp} the world must be a multiple of "
                    f"{pp * tp} (e.g. {max(1, world_size // (pp * tp)) * pp * tp}), "
                    f"or change pp/tp"
                )
            dp = world_size // (pp * tp)
        dp = _check_size("dp", dp)
        if world_size is not None and world_size != dp * pp * tp:
            raise TopologyError(world_size_mismatch(world_size, dp, pp, tp))
        self.dp, self.pp, self.tp = dp, pp, tp
        self.order = _parse_order(order)
        self.world_size = dp * pp * tp
        # stride of each axis in the flat rank: the fastest axis has stride 1
        stride, self._stride = 1, {}
        for axis in self.order:
            self._stride[axis] = stride
            stride *= self.size(axis)

    # ------------------------------------------------------------------ basics
    def size(self, axis: str) -> int:
        """Size of one axis: ``size("tp") == tp``."""
        if axis not in AXES:
            raise TopologyError(f"unknown axis {axis!r}; expected one of {AXES}")
        return getattr(self, axis)

    def coords(self, rank: int) -> Coords:
        """The (dp, pp, tp) coordinate of ``rank``."""
        self._check_rank(rank)
        return Coords(**{a: (rank // self._stride[a]) % self.size(a) for a in AXES})

    def rank(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """The rank at a coordinate (inverse of :meth:`coords`)."""
        values = {"dp": dp, "pp": pp, "tp": tp}
        for axis, v in values.items():
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not (0 <= v < self.size(axis)):
                raise TopologyError(f"{axis} index {v!r} out of range for {axis} size {self.size(axis)}")
        return sum(values[a] * self._stride[a] for a in AXES)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not (0 <= rank < self.world_size):
            raise TopologyError(f"rank {rank!r} out of range for world size {self.world_size}")

    # ------------------------------------------------------------------ groups
    def _groups_varying(self, varying: tuple[str, ...]) -> list[list[int]]:
        """Rank lists in which the ``varying`` axes change and the others are fixed.

        Groups are ordered by the fixed coordinates (in rank order of their first
        member); members are sorted by rank.
        """
        fixed = [a for a in AXES if a not in varying]
        out = []
        for fixed_vals in itertools.product(*(range(self.size(a)) for a in fixed)):
            base = sum(v * self._stride[a] for a, v in zip(fixed, fixed_vals))
            members = [base]
            for axis in varying:
                s, n = self._stride[axis], self.size(axis)
                members = [m + i * s for m in members for i in range(n)]
            out.append(sorted(members))
        out.sort(key=lambda g: g[0])
        return out

    @cached_property
    def _axis_groups(self) -> dict[str, list[list[int]]]:
        return {a: self._groups_varying((a,)) for a in AXES}

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` ("dp", "pp" or "tp"): a partition of the world.

        Each group holds the ranks whose coordinates differ only in ``axis``,
        listed in order of that axis's index.
        """
        self.size(axis)  # validates the name
        return [list(g) for g in self._axis_groups[axis]]

    @cached_property
    def model_parallel_groups(self) -> list[list[int]]:
        """One group per model replica: the pp × tp ranks sharing a dp index."""
        return self._groups_varying(("pp", "tp"))

    @cached_property
    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of every pipeline (for tied embeddings).

        With pp == 1 each group is the single rank holding both ends.
        """
        return [sorted({g[0], g[-1]}) for g in self._axis_groups["pp"]]

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group containing ``rank`` along ``axis``: "dp", "pp", "tp", "mp"
        (model parallel: pp × tp of one replica) or "embedding"."""
        c = self.coords(rank)
        if axis == "mp":
            return sorted(self.rank(dp=c.dp, pp=p, tp=t) for p in range(self.pp) for t in range(self.tp))
        if axis == "embedding":
            ends = {0, self.pp - 1}
            return sorted(self.rank(dp=c.dp, pp=p, tp=c.tp) for p in ends)
        self.size(axis)
        at = {"dp": c.dp, "pp": c.pp, "tp": c.tp}
        return [self.rank(**{**at, axis: i}) for i in range(self.size(axis))]

    # ---------------------------------------------------------------- pipeline
    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == self.pp - 1

    def next_rank(self, rank: int) -> int | None:
        """The rank holding the next pipeline stage, or None on the last stage."""
        c = self.coords(rank)
        if c.pp == self.pp - 1:
            return None
        return self.rank(dp=c.dp, pp=c.pp + 1, tp=c.tp)

    def prev_rank(self, rank: int) -> int | None:
        """The rank holding the previous pipeline stage, or None on the first stage."""
        c = self.coords(rank)
        if c.pp == 0:
            return None
        return self.rank(dp=c.dp, pp=c.pp - 1, tp=c.tp)

    # ------------------------------------------------------------ presentation
    def __repr__(self) -> str:
        return (
            f"Topology(dp={self.dp}, pp={self.pp}, tp={self.tp}, "
            f"order={'-'.join(self.order)!r})  # world size {self.world_size}"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and (self.dp, self.pp, self.tp, self.order) == (
            other.dp,
            other.pp,
            other.tp,
            other.order,
        )

    def __hash__(self) -> int:
        return hash((self.dp, self.pp, self.tp, self.order))

    def describe(self, gpus_per_node: int = 8, max_nodes: int = 8, *, device: str = "cuda") -> str:
        """A readable map of the layout: per node, its ranks and their (dp, pp, tp).

        Also says whether each TP group stays inside a node (it should: TP
        traffic is per layer). Only the first and last ``max_nodes // 2`` nodes
        are listed for large worlds. ``device``: the ranks' device type; only
        ``"cuda"`` ranks are called GPUs (``gpus_per_node`` is then the ranks per
        node, e.g. ``"1 node(s) × 4 CPU processes"``).
        """
        gpus_per_node = _check_size("gpus_per_node", gpus_per_node)
        unit = "GPUs" if device == "cuda" else f"{device.upper()} processes"
        n_nodes = -(-self.world_size // gpus_per_node)
        tp_cross = sum(1 for g in self._axis_groups["tp"] if g[0] // gpus_per_node != g[-1] // gpus_per_node)
        lines = [
            f"{self!r}",
            f"{n_nodes} node(s) × {gpus_per_node} {unit}; "
            + (
                "every TP group stays inside one node"
                if tp_cross == 0
                else f"{tp_cross} of {len(self._axis_groups['tp'])} TP groups cross a node "
                f"boundary (TP traffic is per layer: keep tp ≤ {unit} per node and "
                "tp fastest in the order)"
            ),
        ]
        shown = list(range(n_nodes))
        if n_nodes > max_nodes:
            half = max(1, max_nodes // 2)
            shown = shown[:half] + [-1] + shown[-half:]
        for node in shown:
            if node == -1:
                lines.append(f"  ... {n_nodes - 2 * half} more nodes ...")
                continue
            ranks = range(node * gpus_per_node, min((node + 1) * gpus_per_node, self.world_size))
            cells = []
            for r in ranks:
                c = self.coords(r)
                cells.append(f"{r}:({c.dp},{c.pp},{c.tp})")
            lines.append(f"  node {node}: " + " ".join(cells))
        lines.append("  rank:(dp,pp,tp)")
        return "\n".join(lines)
