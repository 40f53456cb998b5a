"""How a finished rank leaves: every collective completed, every process group destroyed.

A rank that returns from training with its process groups alive leaves their
threads and sockets to the interpreter's teardown; gloo's then race the peers
that are still tearing down theirs, which showed as an occasional SIGABRT
("terminate called without an active exception") after the last step, turning a
finished job into a failed one. :func:`finish_distributed` ends the job in order:
a real barrier (an all-reduce followed by a host read, so under NCCL too the host
waits until every rank has issued and completed every collective), then
``destroy_process_group`` on every rank.

The exit statuses a run ends with: 0 (done, or stopped by a signal with a checkpoint), 1 (a rank
failed: the launcher names it, :mod:`launch.failures`), 2 (bad input, refused before any worker),
:data:`EXIT_DIVERGED` (the divergence policy stopped it, :mod:`recipes.training.divergence`),
:data:`EXIT_ORPHANED` (a worker whose launcher died; nobody waits for that status).

:class:`LauncherWatch`: a worker whose launcher died (``kill -9`` of the self-spawning launcher,
or of torchrun's agent) stops at the end of its current step without saving again, instead of
training on (and publishing checkpoints) into a directory a new run may want.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys

import torch
import torch.distributed as dist

from parallel import comm


def finish_distributed(device: torch.device, *, owned: bool = True) -> bool:
    """Barrier, then destroy every process group, if this rank ``owned`` the default group.

    Collective over the world (every rank calls it once, at the end of a successful run).
    A group this rank did not create (a test harness's) is left to its creator. Returns
    whether groups were destroyed.
    """
    if not owned or not dist.is_initialized():
        return False
    if dist.get_world_size() > 1:
        done = torch.zeros(1, device=device)
        comm.all_reduce(done)
        done.item()  # host read: the collective completed on this rank, so every rank reached it
    dist.destroy_process_group()
    return True


def freeze_for_exit() -> None:
    """For a process whose work is done: move every object it holds out of the cyclic garbage
    collector's reach (``gc.freeze``), so the interpreter's collections at exit do not walk torch's
    heap again. Objects are still freed by their reference counts, atexit handlers still run; a cycle
    made before the call stays until the process is gone."""
    gc.freeze()


EXIT_DIVERGED = 3
EXIT_ORPHANED = 4
_PR_SET_PDEATHSIG = 1  # prctl(2), Linux


class LauncherWatch:
    """Notices that this worker's launcher (its parent process) is gone.

    Built at the start of training in a launched worker (``launched``: under the self-spawn or
    torchrun); elsewhere (a test harness's ranks) it never fires. It asks the kernel for SIGTERM when
    the parent dies (Linux ``PR_SET_PDEATHSIG``; the self-spawn's workers already get SIGINT from
    torch), which wakes a rank blocked in a collective through the pre-emption watchdog, and
    :meth:`gone` compares the parent pid with the one at start (a dead parent's children are
    re-parented): one ``getppid`` system call, no host read, no collective.
    """

    def __init__(self, launched: bool):
        self.parent = os.getppid() if launched else None
        if launched and sys.platform.startswith("linux"):
            try:
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            except (OSError, AttributeError):
                pass
            if os.getppid() != self.parent:  # it died before the request took effect
                self.parent = -1

    def gone(self) -> bool:
        return self.parent is not None and os.getppid() != self.parent

    def stop(self, rank: int, step: int) -> None:
        """Leave at once without saving or a final barrier (the launcher's store is gone with it):
        rank 0 says so in one line."""
        if rank == 0:
            print(
                f"error: the launcher (pid {self.parent}) is gone: every rank stops after step {step} without "
                f"saving; the last published checkpoint stays the newest",
                file=sys.stderr,
                flush=True,
            )
        sys.stdout.flush()
        os._exit(EXIT_ORPHANED)
