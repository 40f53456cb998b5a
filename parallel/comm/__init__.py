"""Communication: counted collectives, p2p, and the byte counter they report to.

Everything in gridtrain that moves bytes between ranks goes through this
package, so tests and benchmarks can compare traffic with theory.
"""

from .collectives import (
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    exchange,
    group_label,
    group_size,
    recv,
    reduce_scatter,
    send,
)
from .counter import SENT_FRACTION, CommCounter, record

__all__ = [
    "CommCounter",
    "ReduceOp",
    "SENT_FRACTION",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "exchange",
    "group_label",
    "group_size",
    "record",
    "recv",
    "reduce_scatter",
    "send",
]
