"""The process grid: which rank holds which (data, pipeline, tensor, context) coordinate.

Pure arithmetic — nothing here touches ``torch.distributed`` — so a 17,920-rank
layout can be inspected, tested and planned on a laptop::

    >>> t = Topology(dp=2, pp=2, tp=2)
    >>> t.world_size
    8
    >>> t.coords(5)
    Coords(dp=0, pp=1, tp=1, cp=0)
    >>> t.rank(dp=1, pp=0, tp=1)
    3
    >>> t.groups("tp")
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> t.groups("dp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> t.groups("pp")
    [[0, 4], [1, 5], [2, 6], [3, 7]]

Rank order. By default tensor parallel varies fastest, then context, then data,
then pipeline (``order="tp-cp-dp-pp"``, fastest axis first, Megatron-Core's
convention)::

    rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx

so that the ranks of one TP group are adjacent and share a node (and its NVLink).
Any permutation of the four axes may be asked for (an order naming only dp, pp
and tp puts cp right after tp); every order satisfies the same properties
(coords/rank inverse, each axis's groups partition the world).

Context parallelism (``cp``) splits every sequence over cp ranks that hold the
same parameters and the same samples. Expert parallelism (``ep``) is not an axis
of its own: it divides the data-parallel axis (ep varies fastest inside it), so
``ep`` consecutive dp indices share one set of samples' experts::

    ep_idx = dp_idx % ep          # which slice of the experts this rank holds
    edp_idx = dp_idx // ep        # which copy of that slice (expert data parallel)

Derived groups: ``"dpcp"`` (dp × cp: the ranks that hold the same dense
parameters and average their gradients), ``"ep"`` (the ep ranks that exchange
tokens with all-to-all) and ``"edp"`` (dp/ep × cp ranks holding the same experts).

Creating the ``torch.distributed`` subgroups for a topology is a separate step,
:func:`parallel.groups.build_groups`.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from .dims import ep_mismatch, world_size_indivisible, world_size_mismatch

AXES = ("dp", "pp", "tp", "cp")
DEFAULT_ORDER = "tp-cp-dp-pp"
# groups derived from the axes (see the module docstring), besides one per axis
DERIVED_GROUPS = ("dpcp", "ep", "edp")


class TopologyError(ValueError):
    """A layout that cannot exist; the message names the numbers and the fix."""


@dataclass(frozen=True)
class Coords:
    """One rank's position in the grid."""

    dp: int
    pp: int
    tp: int
    cp: int = 0

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
    """The four axes, fastest first; an order naming only dp, pp and tp gets cp right after tp."""
    axes = tuple(order.split("-")) if isinstance(order, str) else tuple(order)
    if "cp" not in axes and sorted(axes) == sorted(a for a in AXES if a != "cp"):
        i = axes.index("tp")
        axes = axes[: i + 1] + ("cp",) + axes[i + 1 :]
    if sorted(axes) != sorted(AXES):
        raise TopologyError(
            "order must name each of dp, pp, tp (and optionally cp) exactly once "
            f"(fastest first, e.g. {DEFAULT_ORDER!r} or 'tp-dp-pp'), got {order!r}"
        )
    return axes


class Topology:
    """A dp × pp × tp × cp grid of ranks, with ep dividing dp.

    Args:
        dp, pp, tp, cp: sizes of the data-, pipeline-, tensor- and
            context-parallel axes. ``dp=None`` (or ``"auto"``) derives dp from
            ``world_size``.
        ep: expert-parallel size; it divides dp (it is not a separate axis).
        world_size: the number of processes actually launched. When given, it is
            checked against dp·pp·tp·cp (or used to derive dp).
        order: axis order, fastest-varying first, e.g. ``"tp-cp-dp-pp"``
            (default) or ``"tp-pp-dp"`` (cp then goes right after tp).

    Raises:
        TopologyError: on non-integer or non-positive sizes, a world size that
            does not equal (or, for ``dp=auto``, is not a multiple of) pp·tp·cp,
            or an ep that does not divide dp.
    """

    def __init__(
        self,
        dp: int | str | None = None,
        pp: int = 1,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        *,
        world_size: int | None = None,
        order: str | Iterable[str] = DEFAULT_ORDER,
    ):
        pp = _check_size("pp", pp)
        tp = _check_size("tp", tp)
        cp = _check_size("cp", cp)
        ep = _check_size("ep", ep)
        if world_size is not None:
            world_size = _check_size("world size", world_size)
        per_replica = pp * tp * cp
        if dp is None or dp == "auto":
            if world_size is None:
                raise TopologyError("dp=auto needs the world size to derive dp from")
            if world_size % per_replica:
                raise TopologyError(world_size_indivisible(world_size, pp, tp, cp))
            dp = world_size // per_replica
        dp = _check_size("dp", dp)
        if world_size is not None and world_size != dp * per_replica:
            raise TopologyError(world_size_mismatch(world_size, dp, pp, tp, cp))
        if dp % ep:
            raise TopologyError(ep_mismatch(dp, ep))
        self.dp, self.pp, self.tp, self.cp, self.ep = dp, pp, tp, cp, ep
        self.order = _parse_order(order)
        self.world_size = dp * per_replica
        # stride of each axis in the flat rank: the fastest axis has stride 1
        stride, self._stride = 1, {}
        for axis in self.order:
            self._stride[axis] = stride
            stride *= self.size(axis)

    # ------------------------------------------------------------------ basics
    def size(self, axis: str) -> int:
        """Size of one axis or derived group: ``size("tp") == tp``, ``size("edp") == dp // ep * cp``."""
        if axis in AXES:
            return getattr(self, axis)
        derived = {"dpcp": self.dp * self.cp, "ep": self.ep, "edp": self.dp // self.ep * self.cp}
        if axis in derived:
            return derived[axis]
        raise TopologyError(f"unknown axis {axis!r}; expected one of {AXES + DERIVED_GROUPS}")

    def coords(self, rank: int) -> Coords:
        """The (dp, pp, tp, cp) coordinate of ``rank``."""
        self._check_rank(rank)
        return Coords(**{a: (rank // self._stride[a]) % getattr(self, a) for a in AXES})

    def ep_index(self, rank: int) -> int:
        """Which of the ep expert shards ``rank`` holds (``dp index % ep``)."""
        return self.coords(rank).dp % self.ep

    def edp_index(self, rank: int) -> int:
        """``rank``'s position in its expert-data-parallel group (``edp`` lists members in this order)."""
        c = self.coords(rank)
        return (c.dp // self.ep) * self.cp + c.cp

    def dpcp_index(self, rank: int) -> int:
        """``rank``'s position in its dp × cp group (``dpcp`` lists members in this order)."""
        c = self.coords(rank)
        return c.dp * self.cp + c.cp

    def rank(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The rank at a coordinate (inverse of :meth:`coords`)."""
        values = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
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

    def _derived_groups(self, axis: str) -> list[list[int]]:
        # each group once, from its lowest rank, its members as :meth:`group_of` lists them
        out, seen = [], set()
        for r in range(self.world_size):
            if r not in seen:
                out.append(self.group_of(axis, r))
                seen.update(out[-1])
        return out

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (an axis, or "dpcp", "ep", "edp"): a partition of the world.

        For an axis, each group holds the ranks whose coordinates differ only in
        ``axis``, listed in order of that axis's index; a derived group lists its
        members in order of their index in it (:meth:`ep_index`, :meth:`edp_index`,
        :meth:`dpcp_index`). Groups are ordered by their lowest rank.
        """
        self.size(axis)  # validates the name
        if axis in DERIVED_GROUPS:
            return self._derived_groups(axis)
        return [list(g) for g in self._axis_groups[axis]]

    @cached_property
    def model_parallel_groups(self) -> list[list[int]]:
        """One group per model replica's sequence slice: the pp × tp ranks sharing a dp and a cp index."""
        return self._groups_varying(("pp", "tp"))

    @cached_property
    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of every pipeline (for tied embeddings).

        With pp == 1 each group is the single rank holding both ends.
        """
        return [sorted({g[0], g[-1]}) for g in self._axis_groups["pp"]]

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group containing ``rank`` along ``axis``: an axis ("dp", "pp", "tp", "cp"),
        a derived group ("dpcp", "ep", "edp"), "mp" (model parallel: pp × tp of one
        replica's sequence slice) or "embedding"."""
        c = self.coords(rank)
        at = {"dp": c.dp, "pp": c.pp, "tp": c.tp, "cp": c.cp}
        if axis == "mp":
            return sorted(self.rank(**{**at, "pp": p, "tp": t}) for p in range(self.pp) for t in range(self.tp))
        if axis == "embedding":
            ends = {0, self.pp - 1}
            return sorted(self.rank(**{**at, "pp": p}) for p in ends)
        self.size(axis)
        if axis == "dpcp":
            return [self.rank(**{**at, "dp": d, "cp": k}) for d in range(self.dp) for k in range(self.cp)]
        if axis == "ep":
            base = c.dp - c.dp % self.ep
            return [self.rank(**{**at, "dp": base + e}) for e in range(self.ep)]
        if axis == "edp":
            e = c.dp % self.ep
            return [
                self.rank(**{**at, "dp": b * self.ep + e, "cp": k})
                for b in range(self.dp // self.ep)
                for k in range(self.cp)
            ]
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
        return self.rank(dp=c.dp, pp=c.pp + 1, tp=c.tp, cp=c.cp)

    def prev_rank(self, rank: int) -> int | None:
        """The rank holding the previous pipeline stage, or None on the first stage."""
        c = self.coords(rank)
        if c.pp == 0:
            return None
        return self.rank(dp=c.dp, pp=c.pp - 1, tp=c.tp, cp=c.cp)

    # ------------------------------------------------------------ presentation
    @property
    def _shown_order(self) -> tuple[str, ...]:
        # with cp == 1 where cp sits in the order changes no rank: leave it out
        return self.order if self.cp > 1 else tuple(a for a in self.order if a != "cp")

    def __repr__(self) -> str:
        extra = (f", cp={self.cp}" if self.cp > 1 else "") + (f", ep={self.ep}" if self.ep > 1 else "")
        return (
            f"Topology(dp={self.dp}, pp={self.pp}, tp={self.tp}{extra}, "
            f"order={'-'.join(self._shown_order)!r})  # world size {self.world_size}"
        )

    def _key(self) -> tuple:
        return (self.dp, self.pp, self.tp, self.cp, self.ep, self._shown_order)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

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
        if self.ep > 1:
            lines.append(
                f"ep={self.ep}: each group of {self.ep} consecutive dp indices shards the experts; "
                f"{self.dp // self.ep * self.cp} rank(s) hold each expert shard (edp)"
            )
        with_cp = self.cp > 1
        for node in shown:
            if node == -1:
                lines.append(f"  ... {n_nodes - 2 * half} more nodes ...")
                continue
            ranks = range(node * gpus_per_node, min((node + 1) * gpus_per_node, self.world_size))
            cells = []
            for r in ranks:
                c = self.coords(r)
                cells.append(f"{r}:({c.dp},{c.pp},{c.tp}" + (f",{c.cp})" if with_cp else ")"))
            lines.append(f"  node {node}: " + " ".join(cells))
        lines.append("  rank:(dp,pp,tp,cp)" if with_cp else "  rank:(dp,pp,tp)")
        return "\n".join(lines)
