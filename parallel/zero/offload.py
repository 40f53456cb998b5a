"""ZeRO-Offload: the optimizer (and, at stage 3, the parameter shards) in host memory.

``offload`` (one of :data:`OFFLOAD_MODES`) moves parts of a
:class:`~parallel.zero.ZeroDataParallel`'s model state off the device:

``"optimizer"`` (stages 1–3)
    The fp32 master shard and every per-element optimizer state (Adam's moments)
    live in host memory (page-locked when the device is a GPU, so copies are
    asynchronous DMA). Each bucket's reduced gradient shard is copied device → host
    as soon as :meth:`step` has finished it (divided, tied/sequence-parallel sums
    done), on a side stream, while the next buckets are finished and the gradient
    norm is reduced; the optimizer steps the host shards (torch's fused CPU AdamW:
    vectorised and multi-threaded); the updated parameters are copied host → device
    (non-blocking from pinned memory) and gathered as without offload.
``"optimizer+params"`` (stage 3)
    In addition the persistent parameter shard of every bucket lives on the host; a
    unit's gather first copies its shard host → device (non-blocking), then
    all-gathers it, and is launched ahead exactly like the gathers it replaces
    (the prefetch of :mod:`parallel.zero.units`). In fp32 the host shard *is* the
    master, so it is held once.

Bytes per parameter that leave the device (Ψ parameters, N-way sharded, ``b``
the compute dtype's bytes): the optimizer's ``4·[b≠4] + 8`` (AdamW: master +
two moments) per shard element; with params also ``b``. Host memory holds them
plus one fp32 gradient shard (4 bytes per shard element, the copy target).
:func:`host_state_bytes` is the one home of that count; the planner imports it
and a test compares it with :meth:`~parallel.zero.ZeroDataParallel.held_bytes`.

On a machine without a GPU "device" and "host" are both the CPU: the buffers are
still separate tensors and every copy still happens, so the tests run the whole path.
"""

from __future__ import annotations

import contextlib

import torch

from ..dims import OFFLOAD_MIN_STAGE, offload_problem
from ..dims import OFFLOAD_MODES as OFFLOAD_MODES  # re-exported: the names' one home is parallel.dims
from .layout import ZeroConfigError

MIN_STAGE = OFFLOAD_MIN_STAGE  # the names and the rule's one home: parallel.dims
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32, per shard element
MASTER_BYTES = 4
HOST_GRAD_BYTES = 4  # the fp32 gradient shard copied device → host


def check_offload(mode: str, stage: int) -> str:
    """Refuse an unknown mode or one the ZeRO ``stage`` cannot carry (same on every rank); return it."""
    mode = "none" if mode in (None, False) else mode
    problem = offload_problem(mode, stage)
    if problem:
        raise ZeroConfigError(problem)
    return mode


def host_state_bytes(
    shard_numel: int, param_bytes: int, mode: str, optimizer_state_bytes: int = ADAM_STATE_BYTES
) -> int:
    """Host bytes of model state for ``shard_numel`` elements of one rank's shards under ``mode``.

    fp32 master (one copy: in fp32 with params offloaded the host parameter shard is
    the master), the optimizer's per-element state, the fp32 gradient copy target,
    and with ``optimizer+params`` the compute-dtype parameter shard (unless fp32)."""
    if mode == "none":
        return 0
    per = MASTER_BYTES + optimizer_state_bytes + HOST_GRAD_BYTES
    if mode == "optimizer+params" and param_bytes != MASTER_BYTES:
        per += param_bytes
    return shard_numel * per


def host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new host tensor holding ``t``'s values (page-locked when ``t`` is on a GPU)."""
    if t.device.type == "meta":  # the dry run: no storage, the place is bookkeeping (held_bytes)
        return torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=t.is_cuda)
    out.copy_(t.detach())
    return out


def host_empty(numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised host buffer, page-locked when ``like`` lives on a GPU."""
    meta = like.device.type == "meta"
    return torch.empty(numel, dtype=dtype, device="meta" if meta else "cpu", pin_memory=like.is_cuda)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: a non-blocking copy from pinned memory, stream-ordered before what follows."""
    if host.device == device:  # a CPU run: still a separate buffer, as on a GPU
        return host.clone()
    return host.to(device, non_blocking=True)


class HostCopier:
    """Device → host copies on a side stream, waited for once, just before the host step.

    On a GPU each :meth:`copy` enqueues an asynchronous copy on ``stream`` after the
    work already queued on the current stream (the gradient's last reduction) and
    records an event; :meth:`wait` synchronises those events (the one host wait of the
    step, no per-bucket sync). On the CPU the copy is immediate.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.events: list = []

    def copy(self, host: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None:
            host.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
            src.record_stream(self.stream)  # its memory is not reused before the copy has read it
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events.append(event)

    def wait(self) -> None:
        for e in self.events:
            e.synchronize()
        self.events.clear()


@contextlib.contextmanager
def _host_work(host: torch.Tensor):
    """Run host-side work. In the dry run (``meta`` tensors) the host's tensors look like the
    device's: there the step runs outside any dispatch mode, so device-memory tracking
    (:class:`parallel.dryrun.LiveMemory`) sees neither the optimizer state nor its temporaries."""
    if host.device.type != "meta":
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def host_step(zdp, norm: torch.Tensor, found_inf: torch.Tensor, coef: torch.Tensor | None) -> dict:
    """:meth:`ZeroDataParallel.step` with the optimizer in host memory (``offload``): one host read of the
    skip flag and clip coefficient together, one wait for the gradient copies, the step
    on the host shards, the updated parameters copied back (see parallel/zero/offload.py)."""
    flags = torch.stack([found_inf.float(), coef if coef is not None else torch.ones_like(norm)])
    flags = flags.cpu() if flags.device.type != "meta" else torch.zeros(2)
    skipped = bool(flags[0])
    if zdp.scaler:
        zdp.scaler.update(skipped)
    zdp._host_copier.wait()
    if not skipped:
        for b in zdp.buckets:
            b.master.grad = b.host_grad.mul_(flags[1]) if coef is not None else b.host_grad
        with _host_work(zdp.buckets[0].master):
            zdp.optimizer.step()
        for b in zdp.buckets:
            b.publish_master()
            b.master.grad = None
    zdp.zero_grad()
    return {"grad_norm": norm, "skipped": found_inf, "loss_scale": zdp.loss_scale}
