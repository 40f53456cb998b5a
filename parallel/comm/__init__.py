"""Communication: counted collectives, p2p, and the byte counter they report to.

Everything in gridtrain that moves bytes between ranks goes through this
package, so tests and benchmarks can compare traffic with theory
(:class:`CommCounter`) and the dry run can check the order of calls and the
devices of their tensors (:class:`CallRecorder`). What a backend needs differently (gloo)
is decided once per group in :mod:`.gloo` (:func:`transport`).
"""

from .autograd import (
    SplitError,
    all_gather_along,
    all_reduce_max,
    all_reduce_sum,
    all_to_all_chunks,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_along,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    split_along,
    tp_rank,
    tp_world_size,
)
from .collectives import (
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    device_for,
    exchange,
    group_label,
    group_size,
    recv,
    reduce_scatter,
    send,
)
from .counter import SENT_FRACTION, CommCounter, record
from .gloo import transport
from .late import late_completion, pending_count
from .recorder import Call, CallRecorder, compare_sequences, on_device

__all__ = [
    "Call",
    "CallRecorder",
    "CommCounter",
    "compare_sequences",
    "on_device",
    "ReduceOp",
    "SENT_FRACTION",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "device_for",
    "exchange",
    "group_label",
    "group_size",
    "late_completion",
    "pending_count",
    "record",
    "recv",
    "reduce_scatter",
    "send",
    "transport",
    # autograd-aware tensor-parallel regions
    "SplitError",
    "all_gather_along",
    "all_reduce_max",
    "all_reduce_sum",
    "all_to_all_chunks",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_along",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "split_along",
    "tp_rank",
    "tp_world_size",
]
