"""A small multi-process harness: run one function on N local gloo ranks.

    def check():
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(check, world_size=4) == [6.0] * 4

Each rank is a *forked* child of the calling process (torch is already
imported, so a rank starts in milliseconds, not seconds), rendezvous goes
through a ``FileStore`` in a private temporary directory (no ports to race
for), and the parent watches every child:

* a rank that raises fails the call at once with :class:`RankFailure` carrying
  *that rank's* traceback; the other ranks are killed, whatever they wait on;
* a rank that exits without answering (segfault, ``os._exit``, SIGKILL) fails
  it the same way, with its exit code;
* if the ranks have not all answered within ``timeout`` seconds, each hung
  rank's Python stack is dumped (faulthandler) and included in the error, and
  every child is killed: no stray processes stay behind.

``fn`` and its arguments need not be picklable (they are inherited through
fork); return values are pickled back to the parent.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable


class RankFailure(RuntimeError):
    """One rank raised, died or hung; the message holds its traceback or stack."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def _child(fn, args, kwargs, rank, world_size, store_path, stack_path, conn, threads, pg_timeout):
    # The child must never return into the parent's (pytest's) code: os._exit.
    code = 0
    try:
        import torch
        import torch.distributed as dist

        stack_file = open(stack_path, "w")
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(*args, **kwargs)
        # no rank leaves while a peer may still be connecting to it (gloo connects lazily
        # and per group; an early exit shows up in the peer as ConnectionRefused/Reset)
        if dist.is_initialized():
            dist.barrier()
        # Plain pickle, not Connection.send: torch registers multiprocessing reducers that
        # pass tensors as shared-memory file descriptors served by *this* process, which
        # exits right after sending, so the parent's fetch could meet a reset connection.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        code = 1
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except Exception:  # noqa: BLE001
            pass
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    Inside ``fn`` the default process group is initialised (``dist.get_rank()``
    works) and the torchrun variables ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` are set. Raises :class:`RankFailure` as described in the
    module docstring. ``threads`` caps each rank's intra-op threads (a 2-core
    machine running 8 ranks must not oversubscribe).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1, got {world_size}")
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="gridtrain-ranks-")
    store = os.path.join(tmp, "store")
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(
                    fn,
                    args,
                    kwargs,
                    rank,
                    world_size,
                    store,
                    os.path.join(tmp, f"stack{rank}"),
                    child_conn,
                    threads,
                    timeout,
                ),
                daemon=True,
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
        return _collect(procs, conns, tmp, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs, conns, tmp, timeout) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    pending = set(range(len(procs)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _hung(procs, sorted(pending), tmp, timeout)
        waitables = {conns[r]: r for r in pending}
        waitables.update({procs[r].sentinel: r for r in pending})
        for ready in wait(list(waitables), timeout=remaining):
            r = waitables[ready]
            if r not in pending:
                continue
            if ready is conns[r] or conns[r].poll():
                try:
                    status, payload = pickle.loads(conns[r].recv_bytes())
                except EOFError:
                    status, payload = "died", None
            else:
                status, payload = "died", None
            if status == "ok":
                results[r] = payload
                pending.discard(r)
            elif status == "error":
                raise RankFailure(r, f"rank {r} of {len(procs)} raised:\n{payload}")
            else:
                procs[r].join(timeout=1)
                raise RankFailure(r, f"rank {r} of {len(procs)} died without answering (exit code {procs[r].exitcode})")
    return [results[r] for r in range(len(procs))]


def _hung(procs, ranks, tmp, timeout) -> RankFailure:
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.2)
    stacks = []
    for r in ranks:
        try:
            with open(os.path.join(tmp, f"stack{r}")) as f:
                stacks.append(f"--- rank {r} stack ---\n{f.read().strip()}")
        except OSError:
            stacks.append(f"--- rank {r}: no stack ---")
    return RankFailure(
        ranks[0],
        f"ranks {ranks} of {len(procs)} did not finish within {timeout:g} s "
        f"(hung?); they were killed.\n" + "\n".join(stacks),
    )


class HostSyncCounter:
    """Counts the calls that read a tensor's value on the host (a device synchronisation on a GPU).

    While active (``with HostSyncCounter() as syncs: ...``) it wraps ``Tensor.item``,
    ``Tensor.tolist``, ``Tensor.nonzero`` / ``torch.nonzero``, and ``float``/``int``/``bool``
    of a tensor, and counts each call in ``syncs.calls`` (by name) — on CPU, where
    these cost nothing, so that a test can hold the GPU path to a number.
    Nested reads (``tolist`` calling ``item``) count once. Reads made by
    ``torch.optim`` itself are not counted: its non-capturable optimizers keep the
    ``step`` counter on the host on purpose (reading it is no device sync).
    """

    NAMES = ("item", "tolist", "nonzero", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._saved: list[tuple[object, str, object]] = []
        self._depth = 0

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
            if self._depth == 0 and "/torch/optim/" not in caller:
                self.calls[name] = self.calls.get(name, 0) + 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> HostSyncCounter:
        import torch

        for name in self.NAMES:
            self._saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        self._saved.append((torch, "nonzero", torch.nonzero))
        torch.nonzero = self._wrap("nonzero", torch.nonzero)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()


def procs_with(field: int, value: int, zombies: bool = True) -> list[int]:
    """Pids whose ``/proc/<pid>/stat`` field ``field`` (counted after the name: 0 = state, 1 = parent,
    3 = session) is ``value`` (Linux; ``zombies=False`` leaves out the dead not yet reaped)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value and (zombies or fields[0] != "Z"):
            out.append(int(stat.parent.name))
    return out
