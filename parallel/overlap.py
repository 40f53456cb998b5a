"""What the engine overlaps with compute, and what it leaves exposed: one table, read by both.

Each :class:`Overlap` row names one kind of communication, the compute it runs under
(``hidden_behind``; empty: nothing, it sits on the critical path), whether that needs
``comm.overlap=True``, where the engine does it and how the planner prices it. The two
constants that drive the engine's behaviour live here and are imported by it:

* :data:`REDUCTIONS_IN_FLIGHT` — with overlap, ZeRO 2–3 keep at most this many bucket
  reduce-scatters (each from a temporary full gradient) in flight between launches: the engine
  launches a bucket's, then waits for the oldest beyond this many (``parallel.zero.engine``), so
  one more is pending right after a launch, and the planner counts this many + 1 buckets of
  communication buffer;
* :data:`ZERO3_PREFETCH_UNITS` — ZeRO-3 launches the all-gather of the unit this many units
  ahead of the one about to compute, in forward (``u + 1 …``) and backward (``u − 1 …``)
  (``parallel.zero.units``); the planner counts ``1 +`` that many gathered units of buffer.

The planner's exposed-time arithmetic (``parallel.plan.exposure.exposed_dp_time``, ring
attention in ``parallel.plan.cp``, offload in ``parallel.plan.offload``, TP in
``_stage_numbers``) asks the rows (:meth:`Overlap.exposed`) instead of assuming; flipping
a row changes the plan (``tests/parallel/test_overlap.py``). :func:`table_markdown` renders
the table for ``docs/planner.md`` ("What overlaps"), which a test keeps equal to it.
"""

from __future__ import annotations

from dataclasses import dataclass

REDUCTIONS_IN_FLIGHT = 2  # ZeRO 2-3 with overlap: bucket reduce-scatters (and their full-gradient temporaries) alive
ZERO3_PREFETCH_UNITS = 1  # ZeRO-3: gathers launched this many units ahead of the unit that computes


@dataclass(frozen=True)
class Overlap:
    """How one kind of communication meets compute in the engine (module docstring)."""

    name: str
    hidden_behind: str  # the compute it runs under; "" = none: exposed
    needs_overlap_flag: bool  # hidden only when comm.overlap=True
    engine: str  # where the engine does it
    planner: str  # how the planner prices it

    def hidden(self, overlap: bool = True) -> bool:
        """Whether it runs under compute in a run with ``comm.overlap=overlap``."""
        return bool(self.hidden_behind) and (overlap or not self.needs_overlap_flag)

    def exposed(self, comm_s: float, compute_s: float, overlap: bool = True) -> float:
        """Seconds of ``comm_s`` the step waits for: all of it when not hidden, else what
        exceeds the ``compute_s`` it hides behind."""
        return max(0.0, comm_s - compute_s) if self.hidden(overlap) else comm_s


def exposed_sharing(window_s: float, *parts: tuple[Overlap, float], overlap: bool = True) -> float:
    """Seconds the step waits for several communications that meet the same compute window
    (``window_s``): the hidden ones queue on one link and hide together behind it, the others
    are exposed whole. With one part this is :meth:`Overlap.exposed`."""
    hidden = sum(s for o, s in parts if o.hidden(overlap))
    return sum(s for o, s in parts if not o.hidden(overlap)) + max(0.0, hidden - window_s)


DP_REDUCTION = Overlap(
    "DP gradient reduction",
    "backward: stages 0-1 the step's last backward, stages 2-3 every micro-batch's",
    True,
    "zero/engine.py: a bucket's collective is launched from its last gradient's hook "
    f"(at most {REDUCTIONS_IN_FLIGHT} reduce-scatters in flight, + 1 just after a launch); overlap=false: after backward",
    "what exceeds that backward (shared with ZeRO-3's backward gathers)",
)
ZERO3_GATHER = Overlap(
    "ZeRO-3 unit all-gathers (forward and backward)",
    f"the compute of the unit(s) before it: prefetched {ZERO3_PREFETCH_UNITS} unit(s) ahead",
    False,
    "zero/units.py UnitGatherer (asynchronous, whatever comm.overlap)",
    "what exceeds the micro-batch's forward, resp. backward",
)
PARAM_GATHER_AFTER_STEP = Overlap(
    "parameter all-gather after the step (stages 1-2; stage 3's root unit)",
    "",
    False,
    "zero/engine.py step() / units.py root gather (blocking: the next forward needs them)",
    "exposed",
)
STEP_SCALARS = Overlap(
    "loss and gradient-norm scalars, tied-embedding gradient",
    "",
    False,
    "zero/engine.py step(), pipeline/executor.py after the last backward",
    "exposed",
)
PIPELINE_P2P = Overlap(
    "pipeline p2p (activations, gradients)",
    "",
    False,
    "pipeline/executor.py: a batch's receives are awaited before the next compute",
    "exposed: every transfer delays both ends (the simulator's p2p latency)",
)
TP_COLLECTIVES = Overlap(
    "TP collectives (all-reduce; sequence parallel's forward all-gather / reduce-scatter)",
    "",
    False,
    "layers/linear.py, comm/autograd.py: blocking",
    "exposed",
)
TP_SP_BACKWARD = Overlap(
    "sequence parallel's column-layer backward (input re-gather, input-gradient reduce-scatter)",
    "the column layers' input- and weight-gradient matmuls",
    False,
    "layers/linear.py _SequenceParallelColumns.backward (asynchronous)",
    "what exceeds the column layers' matmuls (per block; the head's are priced exposed)",
)
RING_ATTENTION = Overlap(
    "ring attention K/V (and dK/dV) hops",
    "one ring step's attention block: the next hop is posted before this block's compute",
    False,
    "layers/ring_attention.py; the last dK/dV hop has nothing left to hide behind",
    "what exceeds one block per hop; the last dK/dV hop exposed",
)
ULYSSES_ALL_TO_ALL = Overlap(
    "Ulysses all-to-alls", "", False, "layers/ulysses.py ulysses_attention: blocking", "exposed"
)
OFFLOAD_STEP = Overlap(
    "offload: gradient shard to host, host AdamW, parameters back",
    "",
    False,
    "zero/offload.py: follows backward (the copies run beside the other buckets' finishing)",
    "exposed",
)
OFFLOAD_PARAM_PAGING = Overlap(
    "offload optimizer+params: parameter shard paged in before each unit's gather",
    "the micro-batch's compute (rides ZeRO-3's prefetch)",
    False,
    "zero/bucket.py start_gather (non-blocking host -> device copy, then the gather)",
    "what exceeds the micro-batches' forward + backward",
)

TABLE: tuple[Overlap, ...] = (
    DP_REDUCTION,
    ZERO3_GATHER,
    PARAM_GATHER_AFTER_STEP,
    STEP_SCALARS,
    PIPELINE_P2P,
    TP_COLLECTIVES,
    TP_SP_BACKWARD,
    RING_ATTENTION,
    ULYSSES_ALL_TO_ALL,
    OFFLOAD_STEP,
    OFFLOAD_PARAM_PAGING,
)


def table_markdown() -> str:
    """The table as a Markdown table (``docs/planner.md``'s "What overlaps")."""
    rows = [
        "| communication | hidden behind | needs comm.overlap | engine | planner |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in TABLE:
        flag = "yes" if o.needs_overlap_flag else "no"
        rows.append(f"| {o.name} | {o.hidden_behind or '— (exposed)'} | {flag} | {o.engine} | {o.planner} |")
    return "\n".join(rows)
