"""What ZeRO-Offload (:mod:`parallel.zero.offload`) costs and saves: the host bytes against one node's
RAM (:func:`host_fits`), and per step (exposed as :data:`parallel.overlap.OFFLOAD_STEP` and
``OFFLOAD_PARAM_PAGING`` say) the host AdamW, bound by host memory bandwidth, the shard copies over
``host_link_gbps``, and with ``optimizer+params`` each micro-batch's paging beyond its compute.
"""

from __future__ import annotations

from ..overlap import OFFLOAD_PARAM_PAGING, OFFLOAD_STEP
from .hardware import GiB, Hardware

HOST_ADAM_BYTES_PER_PARAM = 28  # fp32 p, g, m, v read; p, m, v written


def host_adam_seconds(shard_numel: int, hw: Hardware) -> float:
    """Seconds of the host AdamW step over ``shard_numel`` fp32 elements (memory-bound)."""
    return shard_numel / (hw.host_memory_gbps * 1e9 / HOST_ADAM_BYTES_PER_PARAM)


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
