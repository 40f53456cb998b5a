"""A test mode in which blocking collectives complete late, as NCCL's do for the host.

Under NCCL a "blocking" collective on a CUDA tensor returns once it is
*queued*: the host has not waited for any peer. Code that then reads a file
another rank wrote, or checks ``.exists()``, because "everyone passed the
all-reduce" races. gloo hides this (its blocking calls do wait), so CPU tests
never saw it. Inside :func:`late_completion` they do::

    with comm.late_completion():
        comm.all_reduce(t)      # returns at once, like NCCL: peers may not have arrived
        open(peer_file)         # races (what the mode exists to expose)
        t.item()                # a host read: waits, then returns the reduced value

A blocking collective issued through :mod:`parallel.comm` is started
asynchronously and left *pending*. It completes (this rank waits for its
peers) only when the caller synchronises with it, in the way NCCL semantics
guarantee:

* any torch operation touching the tensor's storage (``.item()``, ``.tolist()``,
  ``.cpu()``, arithmetic: on a GPU the stream orders them after the collective,
  and host reads wait for it) — so correct code computes the same values;
* :func:`parallel.comm.barrier` (a host-synchronising barrier) or leaving the
  context, which complete everything pending.

Host code that touches neither (file reads, ``os.path.exists``, decisions on
unrelated Python state) runs before the peers have arrived: the bug class.

Approximations: a device op on the result also makes the host wait here (NCCL
would not), so the mode catches host code that ignores the result entirely,
which is the barrier pattern; collectives issued inside autograd's backward
complete at once (the C++ engine reads gradients without torch-function
dispatch, so they cannot be deferred safely); asynchronous calls
(``async_op=True``) and p2p keep their own handles and are not deferred.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

# tensor metadata is known to the host without waiting for the device
_METADATA = frozenset(
    {
        "__get__",
        "size",
        "dim",
        "numel",
        "stride",
        "element_size",
        "is_contiguous",
        "data_ptr",
        "untyped_storage",
        "storage_offset",
        "get_device",
        "is_floating_point",
        "__len__",
        "__hash__",
    }
)


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, fake)
        return 0


class _Pending:
    def __init__(self, work, tensors: tuple[torch.Tensor, ...], what: str):
        self.work, self.what = work, what
        self.keys = {k for k in map(_storage_key, tensors) if k}


class _LateMode(TorchFunctionMode):
    """Completes a pending collective before any torch operation that touches its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[_Pending] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.pending and getattr(func, "__name__", "") not in _METADATA:
            keys = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if any(p.keys & keys for p in self.pending):
                self.complete(keys)
        return func(*args, **kwargs)

    def complete(self, keys: set[int] | None = None) -> None:
        """Wait for the pending collectives touching ``keys`` (all when None), in issue order.

        Earlier collectives are waited for too: on one stream they finished first."""
        last = max((i for i, p in enumerate(self.pending) if keys is None or p.keys & keys), default=-1)
        done, self.pending = self.pending[: last + 1], self.pending[last + 1 :]
        for p in done:
            p.work.wait()


_MODES: list[_LateMode] = []


def late_active() -> bool:
    """True inside :func:`late_completion` (and not inside autograd's backward)."""
    return bool(_MODES) and torch._C._current_graph_task_id() == -1


def defer(work, *tensors: torch.Tensor, what: str = "") -> None:
    """Leave the started collective ``work`` pending on ``tensors`` (see module docstring)."""
    _MODES[-1].pending.append(_Pending(work, tensors, what))


def complete_pending() -> None:
    """Wait for every pending collective (a host-synchronising point)."""
    for mode in _MODES:
        mode.complete()


def pending_count() -> int:
    """How many collectives are issued but not yet completed (0 outside the mode)."""
    return sum(len(m.pending) for m in _MODES)


@contextlib.contextmanager
def late_completion() -> Iterator[None]:
    """Inside: blocking collectives of :mod:`parallel.comm` complete late (module docstring).

    Everything still pending completes when the block ends."""
    mode = _LateMode()
    _MODES.append(mode)
    try:
        with mode:
            yield
            mode.complete()
    finally:
        _MODES.remove(mode)
