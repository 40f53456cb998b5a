"""One resolved layout: the sizes of every axis and the policies that shape a step, checked once.

:class:`ParallelDims` takes the sizes (dp, pp, tp, cp, ep), the ZeRO policy, the context-parallel
implementation, sequence parallelism, offload, the pipeline schedule and compression, plus the
few model facts the rules need (as plain numbers: ``parallel/`` never imports ``models/``).
Building one checks every rule between them, once, and raises :class:`LayoutError` naming the
numbers and the fix; after that its properties answer the derived questions (is cp on, what is
the local sequence, which group reduces the dense gradients) so no caller re-derives them::

    >>> d = ParallelDims(dp=2, tp=2, cp=2, seq_len=16, n_heads=4, n_kv_heads=4, sequence_parallel=True)
    >>> d.world_size, d.cp_enabled, d.local_seq_len, d.tp_seq_len
    (8, True, 8, 4)
    >>> d.dense_grad_group
    'dpcp'
    >>> ParallelDims(cp=2, seq_len=30)
    Traceback (most recent call last):
    ...
    parallel.dims.LayoutError: seq_len 30 is not divisible by 2·cp = 4: context parallelism cuts each \
sample into 2·cp equal chunks (rank i holds chunks i and 2·cp−1−i); use seq_len 28 or 32, or another cp

Each rule is also a small function that returns the message (or ``None``), so the libraries'
own guards (the layers, the ZeRO engine, the planner) raise their own error types with the same
words; this module is the one home of those words. Pure: no ``torch``, no process groups.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

CP_IMPLS = ("ring", "alltoall")  # context parallelism: ring attention | Ulysses all-to-all
OFFLOAD_MODES = ("none", "optimizer", "optimizer+params")  # config: parallel.offload (parallel/zero/offload.py)
OFFLOAD_MIN_STAGE = {"none": 0, "optimizer": 1, "optimizer+params": 3}  # the ZeRO stage that shards what moves


class LayoutError(ValueError):
    """A layout that cannot run. ``values``: the settings the rule involves (field name → value),
    so a front end can name them by its own keys (the recipes prefix ``parallel.cp=2: …``)."""

    def __init__(self, message: str, **values):
        super().__init__(message)
        self.values = values


# ---------------------------------------------------------------- the rules, one message each


def local_seq_len(seq_len: int, cp: int = 1) -> int:
    """Tokens of each sample one cp rank holds (its two load-balanced chunks)."""
    return seq_len // cp


def _replica(pp: int, tp: int, cp: int) -> tuple[str, str, int]:
    """``("pp 3 × tp 2", "pp=3 tp=2", 6)``: one replica's sizes as text (cp named only when it is not 1)."""
    text = f"pp {pp} × tp {tp}" + (f" × cp {cp}" if cp != 1 else "")
    return text, f"pp={pp} tp={tp}" + (f" cp={cp}" if cp != 1 else ""), pp * tp * cp


def world_size_indivisible(world_size: int, pp: int, tp: int, cp: int = 1) -> str:
    """The message for ``dp=auto`` on a world that one replica's ranks do not divide."""
    text, sizes, per_replica = _replica(pp, tp, cp)
    return (
        f"world size {world_size} is not divisible by {text} = {per_replica}; with {sizes} the world must "
        f"be a multiple of {per_replica} (e.g. {max(1, world_size // per_replica) * per_replica}), "
        f"or change {'pp/tp/cp' if cp != 1 else 'pp/tp'}"
    )


def world_size_mismatch(world_size: int, dp: int, pp: int, tp: int, cp: int = 1) -> str:
    """The one message for a world that is not ``dp × pp × tp × cp`` (topology, groups, planner)."""
    text, sizes, per_replica = _replica(pp, tp, cp)
    hint = f" (dp=auto would give dp={world_size // per_replica})" if world_size % per_replica == 0 else ""
    return (
        f"world size {world_size} ≠ dp {dp} × {text} = {dp * per_replica}; "
        f"with {sizes} the world must be a multiple of {per_replica}{hint}"
    )


def ep_mismatch(dp: int, ep: int) -> str:
    """The one message for an ``ep`` that does not divide ``dp`` (topology, validation, planner)."""
    fits = [d for d in range(1, dp + 1) if dp % d == 0]
    return (
        f"ep {ep} does not divide dp {dp}: expert parallelism splits the data-parallel group into dp/ep "
        f"copies of ep expert shards; choose ep among the divisors of dp {dp}: {fits}, or change dp"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d <= 64]


def tp_split_problem(n_heads: int, n_kv_heads: int, d_ff: int | None, tp: int) -> str | None:
    """Why ``tp`` cannot split the heads, the kv heads (never replicated) or the MLP width."""
    if n_heads % tp:
        return f"n_heads {n_heads} is not divisible by tp {tp}; choose tp among the divisors of {n_heads}: {_divisors(n_heads)}"
    if n_kv_heads < tp or n_kv_heads % tp:
        return (
            f"n_kv_heads {n_kv_heads} cannot be split over tp {tp} (kv heads are not replicated); "
            f"use a tp that divides {n_kv_heads}: {_divisors(n_kv_heads)}"
        )
    if d_ff is not None and d_ff % tp:
        return f"d_ff {d_ff} is not divisible by tp {tp}; choose tp among {_divisors(d_ff)}"
    return None


def cp_seq_len_problem(seq_len: int, cp: int) -> str | None:
    """Why the load-balanced layout cannot split ``seq_len`` over ``cp``: it needs ``2·cp`` equal chunks."""
    if cp == 1 or seq_len % (2 * cp) == 0:
        return None
    lo = seq_len // (2 * cp) * (2 * cp)
    return (
        f"seq_len {seq_len} is not divisible by 2·cp = {2 * cp}: context parallelism cuts each sample "
        f"into 2·cp equal chunks (rank i holds chunks i and 2·cp−1−i); use seq_len {lo or 2 * cp} or "
        f"{lo + 2 * cp}, or another cp"
    )


def ulysses_heads_problem(n_heads: int, n_kv_heads: int, cp: int, tp: int) -> str | None:
    """Why Ulysses cannot spread the heads over ``cp·tp`` ranks."""
    for what, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if n % (cp * tp):
            return (
                f"parallel.cp_impl=alltoall (Ulysses) needs {what} {n} divisible by cp·tp = {cp}·{tp} = "
                f"{cp * tp}: each rank attends over whole sequences of {what}/(cp·tp) heads; "
                f"use parallel.cp_impl=ring, or a cp·tp that divides {n}"
            )
    return None


def sequence_parallel_problem(tp: int) -> str | None:
    """Why sequence parallelism cannot be on at this ``tp``."""
    if tp == 1:
        return "sequence parallelism needs tp > 1 (it splits the sequence over the tensor-parallel ranks); set tp ≥ 2 or turn it off"
    return None


def sequence_split_problem(seq_len: int, tp: int, cp: int = 1) -> str | None:
    """Why sequence parallelism cannot split each cp rank's ``seq_len/cp`` tokens over ``tp``."""
    local = local_seq_len(seq_len, cp)
    if local % tp == 0:
        return None
    if cp == 1:
        return f"sequence parallelism splits the sequence over tp {tp}: length {seq_len} is not divisible; use a multiple of {tp}"
    return (
        f"sequence parallelism splits each cp rank's {local} tokens (seq_len {seq_len} / cp {cp}) over tp {tp}: "
        f"it must be divisible; use a seq_len divisible by cp·tp = {cp * tp} and 2·cp = {2 * cp}"
    )


def stages_problem(pp: int, vpp: int, n_layers: int) -> str | None:
    """Why ``pp × vpp`` virtual stages cannot be made of ``n_layers`` layers."""
    if pp * vpp <= n_layers:
        return None
    return f"pp {pp} × vpp {vpp} = {pp * vpp} stages but the model has {n_layers} layers; use pp·vpp ≤ {n_layers}"


def interleaved_problem(schedule: str, pp: int, global_batch: int, micro_batch: int, dp: int) -> str | None:
    """Why the interleaved schedule cannot run this step's micro-batches (a multiple of pp)."""
    per_replica = micro_batch * dp
    m = global_batch // per_replica
    if schedule != "interleaved" or m % pp == 0:
        return None
    return (
        f"the interleaved schedule needs the micro-batches per step (global_batch {global_batch} / "
        f"(micro_batch {micro_batch} × dp {dp}) = {m}) to be a multiple of pp {pp}; "
        f"use global_batch={(m // pp + 1) * pp * per_replica}"
    )


def compression_problem(compression: str | None, stage: int) -> str | None:
    """Why gradient compression cannot run at ZeRO ``stage``: Top-K replaces stage 0's all-reduce."""
    if compression in (None, "none") or stage == 0:
        return None
    return (
        f"Top-K compression needs ZeRO stage 0 (it replaces stage 0's gradient all-reduce), got stage {stage}; "
        "use stage=0 or compression=none"
    )


def offload_problem(mode: str, stage: int, *, prefix: str = "") -> str | None:
    """Why ZeRO ``stage`` cannot carry offload ``mode``: what moves to the host is each rank's shard.
    ``prefix`` qualifies the key names (the config passes ``"parallel."``)."""
    if mode not in OFFLOAD_MODES:
        return f"{prefix}offload must be one of {OFFLOAD_MODES}, got {mode!r}"
    need = OFFLOAD_MIN_STAGE[mode]
    if stage >= need:
        return None
    return (
        f"{prefix}offload={mode} needs {prefix}zero ≥ {need} (what it offloads is each rank's shard), "
        f"got {prefix}zero={stage}; set {prefix}zero={need}"
        + ("" if need == 3 else " (or 2, 3)")
        + f" or {prefix}offload=none"
    )


def accumulate_problem(accumulate: str, stage: int, *, key: str = "accumulate", stage_key: str = "stage") -> str | None:
    """Why ``accumulate='unsharded'`` means nothing at ``stage``: only stages 2-3 reduce every micro-batch.
    ``key``/``stage_key`` name the settings as the caller's users type them (the config: ``parallel.…``)."""
    from .zero.theory import accumulate_applies  # which stages reduce every micro-batch: the ZeRO policy's fact

    if accumulate != "unsharded" or accumulate_applies(stage):
        return None
    return (
        f"{key}=unsharded keeps ZeRO-2/3's full gradients across micro-batches, a choice of stages 2-3 "
        f"(stages 0-1 keep them and reduce once per step anyway), got {stage_key}={stage}; set "
        f"{stage_key}=2 or 3, or {key}=sharded"
    )


def topk_ratio_problem(ratio: float) -> str | None:
    """Why ``ratio`` is not a share of a gradient Top-K can keep."""
    return None if 0 < ratio <= 1 else f"topk_ratio must be in (0, 1], got {ratio}"


def _size(name: str, value: object) -> int:
    # bool is an int subclass; `tp=True` is a typo, not a size.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LayoutError(f"{name} must be a positive integer, got {value!r}", **{name: value})
    return int(value)


# ---------------------------------------------------------------- the resolved layout


@dataclass(frozen=True)
class ParallelDims:
    """Sizes, policies and model facts of one run, checked once at construction.

    Model facts left ``None`` skip the rules that need them (a library user who builds a grid
    without a model); the properties that need them raise :class:`LayoutError`.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # divides dp (expert parallelism lives inside the data-parallel group)
    zero: int = 0  # ZeRO stage
    accumulate: str = "sharded"  # ZeRO-2/3 gradient accumulation: sharded | unsharded (parallel.zero.theory)
    cp_impl: str = "ring"
    sequence_parallel: bool = False
    offload: str = "none"
    schedule: str = "1f1b"
    vpp: int = 1
    compression: str = "none"
    # model facts, plain numbers
    seq_len: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    n_layers: int | None = None
    d_ff: int | None = None
    moe_experts: int = 0

    def __post_init__(self):
        from .pipeline.schedules import schedule_problem  # here: parallel.pipeline imports the topology

        for name in ("dp", "pp", "tp", "cp", "ep", "vpp"):
            _size(name, getattr(self, name))
        self._check(schedule_problem(self.schedule, self.pp, self.vpp), schedule=self.schedule, vpp=self.vpp)
        if self.n_layers is not None:
            self._check(stages_problem(self.pp, self.vpp, self.n_layers), pp=self.pp, vpp=self.vpp)
        if self.n_heads is not None:
            kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
            self._check(tp_split_problem(self.n_heads, kv, self.d_ff, self.tp), tp=self.tp)
        if self.dp % self.ep:
            raise LayoutError(ep_mismatch(self.dp, self.ep), ep=self.ep)
        if self.ep > 1 and not self.moe_experts:
            raise LayoutError(f"ep={self.ep} needs an MoE model (moe_experts > 0); use ep=1", ep=self.ep)
        self._check_cp()
        if self.sequence_parallel:
            self._check(sequence_parallel_problem(self.tp), sequence_parallel=True, tp=self.tp)
            if self.seq_len is not None:
                self._check(sequence_split_problem(self.seq_len, self.tp, self.cp), sequence_parallel=True)
        self._check(compression_problem(self.compression, self.zero), compression=self.compression, zero=self.zero)
        self._check(offload_problem(self.offload, self.zero), offload=self.offload, zero=self.zero)
        if self.accumulate != "sharded":
            self._check(accumulate_problem(self.accumulate, self.zero), accumulate=self.accumulate, zero=self.zero)

    def _check_cp(self) -> None:
        if self.cp_impl not in CP_IMPLS:
            raise LayoutError(f"cp_impl {self.cp_impl!r} is not one of {', '.join(CP_IMPLS)}", cp_impl=self.cp_impl)
        if self.seq_len is not None:  # (no rule at cp = 1)
            self._check(cp_seq_len_problem(self.seq_len, self.cp), cp=self.cp)
        if self.ulysses and self.n_heads is not None:
            kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
            self._check(ulysses_heads_problem(self.n_heads, kv, self.cp, self.tp), cp=self.cp)

    @staticmethod
    def _check(problem: str | None, **values) -> None:
        if problem:
            raise LayoutError(problem, **values)

    # --- sizes and switches
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one replica (pp × tp × cp): the world divided by dp."""
        return self.pp * self.tp * self.cp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ulysses(self) -> bool:
        """Context parallelism by all-to-all (heads split over cp·tp) rather than the K/V ring."""
        return self.cp_enabled and self.cp_impl == "alltoall"

    @property
    def ring(self) -> bool:
        return self.cp_enabled and self.cp_impl == "ring"

    @property
    def sp_enabled(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def compression_enabled(self) -> bool:
        return self.compression not in (None, "none")

    # --- the sequence and activations
    def _need(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise LayoutError(f"ParallelDims was built without {name}; pass {name}= to ask this", **{name: None})
        return value

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sample on one cp rank (seq_len / cp)."""
        return local_seq_len(self._need("seq_len"), self.cp)

    @property
    def tp_seq_len(self) -> int:
        """Tokens of each sample one TP rank holds between blocks: local_seq_len / tp under SP."""
        return self.local_seq_len // (self.tp if self.sp_enabled else 1)

    def activation_shape(self, micro_batch: int, d_model: int) -> tuple[int, int, int]:
        """``[batch, seq, d_model]`` of the hidden state a pipeline stage sends (and a block takes)."""
        return (micro_batch, self.tp_seq_len, d_model)

    # --- which group reduces what (names of :meth:`parallel.topology.Topology.groups`)
    @property
    def dense_grad_group(self) -> str:
        """Dense gradients and the loss are averaged over dp × cp: the mean over all tokens."""
        return "dpcp" if self.cp_enabled else "dp"

    @property
    def expert_grad_group(self) -> str:
        """Expert gradients are averaged over the ranks holding the same experts (dp/ep × cp)."""
        return "edp" if self.ep_enabled else self.dense_grad_group

    def group_size(self, name: str) -> int:
        """Ranks in one group called ``name`` (an axis, or ``dpcp``, ``ep``, ``edp``: :meth:`~parallel.topology.Topology.size`)."""
        from .topology import Topology

        return Topology(self.dp, self.pp, self.tp, self.cp, self.ep).size(name)


__all__ = [
    "CP_IMPLS",
    "OFFLOAD_MIN_STAGE",
    "OFFLOAD_MODES",
    "LayoutError",
    "ParallelDims",
    "accumulate_problem",
    "compression_problem",
    "cp_seq_len_problem",
    "ep_mismatch",
    "interleaved_problem",
    "local_seq_len",
    "offload_problem",
    "sequence_parallel_problem",
    "sequence_split_problem",
    "stages_problem",
    "topk_ratio_problem",
    "tp_split_problem",
    "ulysses_heads_problem",
    "world_size_indivisible",
    "world_size_mismatch",
]
