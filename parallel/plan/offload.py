"""What ZeRO-Offload (:mod:`parallel.zero.offload`) costs and saves, for the planner.

Memory: :func:`parallel.zero.theory.model_state_bytes` with ``offload`` moves the
optimizer's bytes (and stage 3's parameter shard) from the device total to ``host``;
:func:`host_fits` checks the host bytes of the ranks of one node against the node's RAM
(``Hardware.host_ram_gb``).

Time, per step, added to the pipeline's makespan (nothing of it overlaps compute in
gridtrain's implementation, except stage 3's parameter pages, which ride the prefetch:
:data:`parallel.overlap.OFFLOAD_STEP`, :data:`~parallel.overlap.OFFLOAD_PARAM_PAGING`):

* the host AdamW over the rank's shard, at :func:`host_adam_params_per_s` per GPU (the profile's
  ``host_memory_gbps``; :data:`HOST_ADAM_PARAMS_PER_S` with its default);
* the reduced gradient shard device → host (4 B per shard element) and the updated
  parameters host → device (``b`` B per element), over ``Hardware.host_link_gbps``;
* ``optimizer+params``: each micro-batch's two gathers (forward, backward) first page
  the unit's shard in (``b`` B per element each); only what exceeds the micro-batch's
  compute is exposed.

Host AdamW rate. Fused AdamW reads parameter, gradient and both moments and writes
parameter and moments: :data:`HOST_ADAM_BYTES_PER_PARAM` = 28 B of host memory traffic
per element, so it is bound by host memory bandwidth, not cores: a DGX A100 has two AMD
EPYC 7742 with 8 channels of DDR4-3200 each (204.8 GB/s per socket), 409.6 GB/s for 8
GPUs, 51.2 GB/s per GPU → 1.83 G elements/s per GPU (``docs/performance.md``: the cores that takes).
"""

from __future__ import annotations

from ..overlap import OFFLOAD_PARAM_PAGING, OFFLOAD_STEP
from .hardware import GiB, Hardware

HOST_ADAM_BYTES_PER_PARAM = 28  # fp32 p, g, m, v read; p, m, v written
HOST_MEMORY_GBPS_PER_GPU = Hardware.host_memory_gbps  # the profile's default: DGX A100, 2 × 204.8 GB/s over 8 GPUs
HOST_ADAM_PARAMS_PER_S = HOST_MEMORY_GBPS_PER_GPU * 1e9 / HOST_ADAM_BYTES_PER_PARAM


def host_adam_params_per_s(hw: Hardware) -> float:
    """Elements per second the host AdamW updates per GPU: ``hw.host_memory_gbps`` over
    :data:`HOST_ADAM_BYTES_PER_PARAM` (a rate of the profile, so ``Hardware.time_scaled`` scales it)."""
    return hw.host_memory_gbps * 1e9 / HOST_ADAM_BYTES_PER_PARAM


def host_adam_seconds(shard_numel: int, hw: Hardware) -> float:
    """Seconds of the host AdamW step over ``shard_numel`` fp32 elements."""
    return shard_numel / host_adam_params_per_s(hw)


def offload_seconds(
    shard_numel: int, param_bytes: int, offload: str, hw: Hardware, micro_batches: int, fwd: float, bwd: float
) -> dict[str, float]:
    """``{"host_adam_s", "pcie_s", "exposed_s"}``: what offload adds to a step (module docstring)."""
    if offload == "none":
        return {"host_adam_s": 0.0, "pcie_s": 0.0, "exposed_s": 0.0}
    link = hw.host_link_gbps * 1e9
    step_copies = shard_numel * (4 + param_bytes) / link  # gradient out, parameters back
    paging = 2 * micro_batches * shard_numel * param_bytes / link if offload == "optimizer+params" else 0.0
    hidden = micro_batches * (fwd + bwd) if paging else 0.0
    adam = host_adam_seconds(shard_numel, hw)
    return {
        "host_adam_s": adam,
        "pcie_s": step_copies + paging,
        "exposed_s": OFFLOAD_STEP.exposed(adam + step_copies, 0.0) + OFFLOAD_PARAM_PAGING.exposed(paging, hidden),
    }


def host_fits(host_bytes_per_rank: float, ranks_per_node: int, hw: Hardware) -> bool:
    """Whether ``ranks_per_node`` ranks' host state fits the node's RAM."""
    return host_bytes_per_rank * ranks_per_node <= hw.host_ram_gb * GiB
