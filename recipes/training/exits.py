"""How a finished rank leaves: every collective completed, every process group destroyed.

A rank that returns from training with its process groups alive leaves their
threads and sockets to the interpreter's teardown; gloo's then race the peers
that are still tearing down theirs, which showed as an occasional SIGABRT
("terminate called without an active exception") after the last step, turning a
finished job into a failed one. :func:`finish_distributed` ends the job in order:
a real barrier (an all-reduce followed by a host read, so under NCCL too the host
waits until every rank has issued and completed every collective), then
``destroy_process_group`` on every rank.
"""

from __future__ import annotations

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
