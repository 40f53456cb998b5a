"""Process-group creation for a :class:`~parallel.topology.Topology`.

Every rank calls :func:`init_distributed` (once per process) and then
:func:`build_groups` (once per topology), in the same order, and receives a
:class:`ParallelGroups` holding its own tensor-, pipeline-, data-, model- and
embedding-parallel groups. Nothing is stored in module globals: two topologies
can coexist in one process, and layers receive the groups they need as
arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm.gloo import transport
from .topology import Coords, Topology, TopologyError, world_size_mismatch

# creation order (every member creates its groups in this order); "dpcp", "ep" and
# "edp" are created only when they differ from a group already made (see ParallelGroups)
GROUP_AXES = ("tp", "cp", "dp", "dpcp", "ep", "edp", "pp", "mp", "embedding")


def default_backend() -> str:
    """NCCL when CUDA devices and NCCL are present, gloo otherwise."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def default_device(backend: str | None = None, local_rank: int | None = None) -> torch.device:
    """The device this rank computes on: its local GPU under NCCL, ``meta`` under torch's
    ``fake`` backend (a dry run: tensors hold no memory, collectives move nothing), else the CPU."""
    backend = backend or default_backend()
    if "fake" in backend:  # "fake" or "cpu:fake,meta:fake"
        return torch.device("meta")
    if backend == "nccl":
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_local_gpus(local_rank: int, local_world_size: int, gpus: int) -> None:
    """Refuse (``ValueError`` naming the numbers and the fix) when this node runs more ranks than it has GPUs.

    Under NCCL each local rank drives its own GPU ``cuda:LOCAL_RANK``; two ranks on
    one GPU would fail inside NCCL ("Duplicate GPU detected") or hang."""
    if local_rank < gpus and local_world_size <= gpus:
        return
    raise ValueError(
        f"this node runs {local_world_size} ranks (LOCAL_WORLD_SIZE={local_world_size}, this one LOCAL_RANK="
        f"{local_rank}) but sees {gpus} GPU(s) (torch.cuda.device_count()={gpus}; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): NCCL needs one GPU per rank. Launch at most {gpus} "
        f"processes per node (torchrun --nproc-per-node={gpus}, Slurm --ntasks-per-node={gpus}) and spread the "
        f"world over more nodes, or run on the CPU with parallel.backend=gloo"
    )


def init_distributed(
    backend: str | None = None,
    timeout_s: float = 600.0,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int]:
    """Initialise the default process group (idempotent); return (rank, world size).

    Reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``LOCAL_RANK``) unless ``init_method``/``rank``/``world_size``
    are given. ``timeout_s`` bounds every collective: a rank waiting on a dead
    peer fails after it instead of hanging.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        check_local_gpus(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)), torch.cuda.device_count())
        torch.cuda.set_device(default_device(backend, local_rank))
    kwargs = {}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    store = _per_attempt_store(timeout_s) if init_method is None else None
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    return dist.get_rank(), dist.get_world_size()


def _per_attempt_store(timeout_s: float):
    """The agent's store under a key prefix of this restart attempt, or None on the first attempt.

    A restarted torchelastic job (``--max-restarts``) reuses the agent's store;
    without a fresh prefix a rank may read the dead attempt's gloo addresses
    and fail with "Connection refused" (seen with torch 2.13's c10d rendezvous).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    tcp = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    return dist.PrefixStore(f"gridtrain/attempt_{attempt}", tcp)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's view of the grid: its coordinates and its process groups.

    ``tp``, ``pp``, ``dp``, ``cp``: the groups along each axis that contain this
    rank (a single-rank group where the axis is 1). ``dpcp``: dp × cp, the ranks
    holding the same dense parameters (their gradients are averaged over it) —
    the ``dp`` object itself when cp == 1. ``ep``: the ranks exchanging tokens
    between experts; ``edp``: the ranks holding the same experts — the ``dpcp``
    object itself when ep == 1. ``mp``: the pp × tp ranks of this model
    replica's sequence slice. ``embedding``: the first and last pipeline stages
    of this rank's pipeline (for tied embeddings); None on a middle stage, which
    belongs to no embedding group.
    """

    topology: Topology
    rank: int
    coords: Coords
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    mp: dist.ProcessGroup
    embedding: dist.ProcessGroup | None
    backend: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cp: dist.ProcessGroup | None = None
    dpcp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    edp: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        # Built by hand (tests, other launchers) without the new axes: they are 1, so the
        # derived groups are the ones that exist already.
        if self.dpcp is None:
            if self.topology.cp > 1:
                raise ValueError("ParallelGroups with cp > 1 needs its cp and dpcp groups (use build_groups)")
            object.__setattr__(self, "dpcp", self.dp)
        if self.edp is None:
            if self.topology.ep > 1:
                raise ValueError("ParallelGroups with ep > 1 needs its ep and edp groups (use build_groups)")
            object.__setattr__(self, "edp", self.dpcp)

    # sizes and indices along each axis
    @property
    def tp_size(self) -> int:
        return self.topology.tp

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def cp_size(self) -> int:
        return self.topology.cp

    @property
    def ep_size(self) -> int:
        return self.topology.ep

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def ep_rank(self) -> int:
        return self.topology.ep_index(self.rank)

    @property
    def edp_rank(self) -> int:
        return self.topology.edp_index(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.topology.pp - 1

    @property
    def next_rank(self) -> int | None:
        return self.topology.next_rank(self.rank)

    @property
    def prev_rank(self) -> int | None:
        return self.topology.prev_rank(self.rank)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The group named ``axis`` (one of :data:`GROUP_AXES`)."""
        if axis not in GROUP_AXES:
            raise ValueError(f"unknown group {axis!r}; expected one of {GROUP_AXES}")
        return getattr(self, axis)


# a derived group that equals another (cp == 1, ep == 1) is that group's object, not a new one
_ALIASES = {"dpcp": ("dp", lambda t: t.cp == 1), "edp": ("dpcp", lambda t: t.ep == 1)}


def my_group_ranks(topology: Topology, rank: int) -> dict[str, list[int]]:
    """The ranks of each group ``rank`` creates, by axis, in creation order (pure).

    Leaves out the groups that are another's object (``dpcp`` when cp == 1,
    ``edp`` when ep == 1) and the embedding group of a middle pipeline stage."""
    out = {
        axis: topology.group_of(axis, rank)
        for axis in GROUP_AXES
        if not (axis in _ALIASES and _ALIASES[axis][1](topology))
    }
    if rank not in out["embedding"]:  # a middle pipeline stage: no embedding group
        del out["embedding"]
    return out


def build_groups(
    topology: Topology,
    *,
    timeout_s: float | None = None,
    backend: str | None = None,
) -> ParallelGroups:
    """Create the torch.distributed subgroups of ``topology``; return this rank's.

    Every rank must call it with the same topology. The world size is checked
    first, on every rank, before any communication, so a mismatch is an error
    everywhere rather than a hang. Each group is created with ``group_desc`` set
    to its axis name, which is the label the byte counter files its traffic under.

    Cost per rank: one ``new_group`` per group *this rank belongs to* (at most
    nine, seven when cp == ep == 1), whatever the world size, instead of one per
    group in the world (3,608 at DP64×PP35×TP8). ``use_local_synchronization=True`` makes each creation a
    rendezvous of the group's members only (torch names such a group by a hash of
    its ranks, so members agree on it without the world); NCCL, gloo and the fake
    backend all accept it. Members create their groups in the same axis order
    (:data:`GROUP_AXES`), so the member-only rendezvous cannot wait in a cycle. Each group's
    transport (what gloo needs differently, :func:`parallel.comm.transport`) is chosen here.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed initialised: call init_distributed() first")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise TopologyError(world_size_mismatch(world, topology.dp, topology.pp, topology.tp, topology.cp))
    rank = dist.get_rank()
    backend = backend or dist.get_backend()
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    mine: dict[str, dist.ProcessGroup | None] = {"embedding": None}
    device = default_device(backend)
    for axis, ranks in my_group_ranks(topology, rank).items():
        mine[axis] = dist.new_group(
            ranks, timeout=timeout, backend=backend, group_desc=axis, use_local_synchronization=True
        )
        for d in {device.type, "cpu"}:  # the group's transports, decided once (parallel.comm.gloo)
            transport(mine[axis], d)
    for axis, (same, applies) in _ALIASES.items():
        if applies(topology):
            mine[axis] = mine[same]
    return ParallelGroups(
        topology=topology,
        rank=rank,
        coords=topology.coords(rank),
        backend=backend,
        device=device,
        **mine,
    )
