"""The next step's host batch, read in a background thread while this step computes."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """``get(step)`` returns ``read(step)``, then starts ``read(step + 1)`` on one background thread.

    Steps asked in order (a run, a resume) find their batch ready; any other step is read at once.
    ``read`` must be a pure function of the step (the trainer's batches are): a batch read ahead and
    never asked for is simply dropped. An exception in a read is raised by the ``get`` that asks for
    that step. Memory: one batch ahead."""

    def __init__(self, read: Callable[[int], T]):
        self._read = read
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gridtrain-data")
        self._ahead: tuple[int, Future] | None = None

    def get(self, step: int) -> T:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            out = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()
            out = self._read(step)
        self._ahead = (step + 1, self._pool.submit(self._read, step + 1))
        return out

    def close(self) -> None:
        """Stop the thread (a read in progress finishes first; its batch is dropped)."""
        self._ahead = None
        self._pool.shutdown(wait=True, cancel_futures=True)
