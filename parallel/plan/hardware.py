"""Hardware profiles: what one device computes, holds and moves per second. :data:`PROFILES` names the
usual ones and :func:`hardware_profile` looks one up, optionally changed, or defined by the user. FLOP/s
are dense tensor-core peaks; memory in bytes; bandwidths GB/s (10⁹ B/s) per device and per direction,
the rate one rank sends at in a ring; ``efficiency`` the fraction of peak large matmuls reach.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

GiB = 2**30


class PlanError(ValueError):
    """Input the planner cannot use; the message names the numbers and the fix."""


#: what a numeric field accepts beyond "a finite number": (lower bound, bound included, upper bound);
#: a time (``_us``) is ≥ 0, any other field > 0 unless named here
_RANGES = {
    "efficiency": (0.0, False, 1.0),
    "attention_efficiency": (0.0, False, 1.0),
    "colocated_slowdown": (0.0, True, math.inf),
    "overlap_fraction": (0.0, True, 1.0),
    "peak_tflops_8": (0.0, True, math.inf),  # 0: no fp8 kernels
}


def _check_field(profile: str, name: str, value) -> None:
    """Refuse a field that is not a finite number in its range (nan, ±inf, negative, a string),
    naming the profile, the field, the value and the fix."""
    where = f"hardware {profile!r}: {name}={value!r}"
    stock = globals().get("PROFILES", {}).get("a100_80gb")
    stock_value = getattr(stock.host or NO_HOST_COSTS, name) if name in HOST_FIELDS else getattr(stock, name, None)
    example = f" (the stock a100_80gb has {stock_value!r})" if stock else ""
    fix = f"fix plan.profiles.{profile}.{name} or the plan.* key that overrides it{example}"
    if name == "gpus_per_node":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{where} must be a positive integer; {fix}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"{where} must be a finite number; {fix}")
    lo, closed, hi = _RANGES.get(name, (0.0, name.endswith("_us"), math.inf))
    if value < lo or (value == lo and not closed) or value > hi:
        want = f"in {'[' if closed else '('}{lo:g}, {hi:g}]" if hi != math.inf else ("≥ 0" if closed else "> 0")
        raise PlanError(f"{where} must be {want}; {fix}")


@dataclass(frozen=True)
class HostCosts:
    """What a rank's host adds to its device's work where nothing queues ahead of the hardware (a CPU
    rank: every launch and wake-up is on the critical path); ``mode=calibrate`` measures them. A GPU
    profile has none (``Hardware.host`` is None): the defaults price nothing."""

    block_overhead_us: float = 0.0  # per block forward + backward beyond its work: launches, Python, autograd
    microbatch_overhead_us: float = 0.0  # per micro-batch beyond its blocks' and head's work: embedding, loss, loop
    step_overhead_us: float = 0.0  # per optimizer step beyond its memory-bound work: zero_grad, norm, launches
    collective_overhead_us: float = 0.0  # per collective or p2p message the rank waits on at issue, beyond latency
    colocated_slowdown: float = 0.0  # a busy rank's slowdown per other busy rank on its host (plan.compute.colocated)
    overlap_fraction: float = 1.0  # of the communication parallel.overlap hides behind compute, the share hidden
    ahead_call_us: float = 0.0  # a collective launched ahead of its wait: its fixed cost; 0: its ring latency steps
    tp_call_us: float = 0.0  # a TP collective inside the model's autograd, beyond collective_overhead_us
    all_gather_bw_scale: float = 1.0  # an all-gather's bandwidth over the ring's (the all-reduce's)
    reduce_scatter_bw_scale: float = 1.0  # a reduce-scatter's likewise

    def kind_scale(self, kind: str) -> float:
        """The bandwidth scale of a collective of ``kind`` (1 but for all-gathers and reduce-scatters)."""
        return {"all_gather": self.all_gather_bw_scale, "reduce_scatter": self.reduce_scatter_bw_scale}.get(kind, 1.0)


NO_HOST_COSTS = HostCosts()
HOST_FIELDS = tuple(f.name for f in dataclasses.fields(HostCosts))


def host_costs(hw: Hardware) -> HostCosts:
    """The one place the planner reads host costs from: ``hw.host``, or none (zeros) on a GPU profile."""
    return hw.host or NO_HOST_COSTS


def _nest_host(fields: dict) -> dict:
    """``fields`` of :class:`Hardware` (host costs nested under ``host`` or flat) as its keywords;
    host costs that are all the defaults become ``host=None``."""
    fields = dict(fields)
    host = fields.pop("host", None)
    host = dict(dataclasses.asdict(host) if isinstance(host, HostCosts) else host or {})
    host.update({k: fields.pop(k) for k in HOST_FIELDS if k in fields})
    unknown = set(host) - set(HOST_FIELDS)
    if unknown:
        raise TypeError(f"unknown host cost fields {sorted(unknown)}")
    nested = HostCosts(**host)
    fields["host"] = None if nested == NO_HOST_COSTS else nested
    return fields


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops_16: float  # bf16 / fp16 dense tensor-core peak
    peak_tflops_32: float  # fp32 (what an fp32 run gets)
    memory_bytes: float
    intra_node_gbps: float  # GB/s per device per direction (NVLink / shared memory)
    inter_node_gbps: float  # GB/s per device per direction (InfiniBand / Ethernet)
    gpus_per_node: int = 8
    efficiency: float = 0.5  # achieved / peak for large matmuls (plan.compute: small ones pay HBM time too)
    latency_us: float = 5.0  # per ring step of a collective or per p2p message
    hbm_gbps: float = 2000.0  # device memory bandwidth, GB/s: elementwise work, small GEMMs' operands
    attention_efficiency: float = 0.5  # achieved / peak of flash attention (SDPA), forward
    host_ram_gb: float = 1024.0  # GiB of host memory per node (ZeRO-Offload's state lives there)
    host_link_gbps: float = 25.0  # GB/s host <-> device per GPU per direction (PCIe)
    host_memory_gbps: float = 51.2  # GB/s host memory per GPU: bounds the host AdamW (plan.offload); DGX A100
    host: HostCosts | None = None  # a calibrated CPU's host costs; None on GPU profiles
    peak_tflops_8: float = 0.0  # fp8 dense tensor-core peak (torch._scaled_mm); 0: no fp8 kernels

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name not in ("name", "host"):
                _check_field(self.name, f.name, getattr(self, f.name))
        if self.host is not None:
            for k in HOST_FIELDS:
                _check_field(self.name, k, getattr(self.host, k))

    @classmethod
    def from_fields(cls, name: str, fields: dict) -> Hardware:
        """The profile ``name`` of ``fields``, its host costs nested under ``host`` or flat."""
        return cls(name=name, **_nest_host(fields))

    def fields(self) -> dict:
        """Every field but ``name``, flat: the host costs (their defaults on a GPU profile) among the others."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("name", "host")}
        return {**flat, **dataclasses.asdict(host_costs(self))}

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for ``precision`` (``fp32``, 16-bit ``bf16``/``fp16``, or an ``fp8`` GEMM: its
        own peak, or without fp8 kernels the fp32 one, since emulation multiplies in fp32)."""
        if precision == "fp8":
            return 1e12 * (self.peak_tflops_8 or self.peak_tflops_32)
        return 1e12 * (self.peak_tflops_32 if precision == "fp32" else self.peak_tflops_16)

    def bandwidth(self, crosses_node: bool, per_node: int = 1) -> float:
        """Bytes per second one rank sends at in a ring inside a node or across nodes. Across nodes, a
        ring group with ``per_node`` members on each node runs ``per_node`` rings (NCCL: a channel per
        NIC), each through its own member's NIC and crossing each node boundary once: a rank's bytes
        leave the node through ``per_node`` NICs at once, and no faster than its links inside the node
        (``intra_node_gbps``), which every ring's other hops cross."""
        if not crosses_node:
            return 1e9 * self.intra_node_gbps
        return 1e9 * min(self.intra_node_gbps, max(1, per_node) * self.inter_node_gbps)

    def kind_bandwidth(self, kind: str, crosses_node: bool, per_node: int = 1) -> float:
        """Bytes per second one rank sends at in a collective of ``kind`` (``per_node``: a ring's
        members on one node, :meth:`bandwidth`): the ring's, times the host's measured scale for its kind."""
        return self.bandwidth(crosses_node, per_node) * host_costs(self).kind_scale(kind)

    @property
    def hbm_bytes_per_s(self) -> float:
        return 1e9 * self.hbm_gbps

    def replace(self, **changes) -> Hardware:
        """This profile with ``changes``; host cost fields may be named flat (they go into ``host``)."""
        if not set(changes) & {"host", *HOST_FIELDS}:
            return dataclasses.replace(self, **changes)
        merged = {"host": self.host, **changes}
        return dataclasses.replace(self, **_nest_host(merged))

    def time_scaled(self, factor: float) -> Hardware:
        """This profile on a machine ``factor`` times slower (> 1) or faster (< 1): every rate divided
        by ``factor``, every fixed time multiplied by it (:data:`RATE_FIELDS`, :data:`TIME_FIELDS`), so every
        planned time is exactly ``factor`` times this profile's."""
        if isinstance(factor, bool) or not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise PlanError(f"hardware {self.name!r}: time scale factor={factor!r} must be a finite number > 0")
        values = self.fields()
        changes = {k: values[k] / factor for k in RATE_FIELDS}
        changes.update({k: values[k] * factor for k in TIME_FIELDS})
        return self.replace(**changes)


#: every field's unit is in its name: rates (FLOP/s, bytes/s) end in ``_gbps`` or start with ``peak_tflops``,
#: fixed times end in ``_us``; the rest (sizes, fractions, counts) are scale-free. :meth:`Hardware.time_scaled`
#: divides the rates and multiplies the times.
_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware) if f.name not in ("name", "host")) + HOST_FIELDS
RATE_FIELDS = tuple(f for f in _FIELDS if f.endswith("_gbps") or f.startswith("peak_tflops"))
TIME_FIELDS = tuple(f for f in _FIELDS if f.endswith("_us"))
SCALE_FREE_FIELDS = tuple(f for f in _FIELDS if f not in RATE_FIELDS + TIME_FIELDS)


# The datasheets' dense peaks, memory bandwidth and links; ``efficiency`` and ``attention_efficiency``
# as docs/performance.md says where they come from. No profile here has host costs: mode=calibrate
# measures them for a CPU.
# H100 SXM5 80GB (DGX H100): NVLink4 900 GB/s both ways, NDR 400 Gb/s per GPU, 2 TB host, PCIe Gen5 pinned;
# fp8 dense 1979 TFLOP/s, twice bf16 (Hopper and Ada double the 16-bit rate; A100 has no fp8)
_H100_SXM = Hardware(
    "h100_80gb",
    989.0,
    67.0,
    80 * GiB,
    450.0,
    50.0,
    8,
    0.7,
    hbm_gbps=3350.0,
    attention_efficiency=0.4,
    host_ram_gb=2048,
    host_link_gbps=50,
    peak_tflops_8=2 * 989.0,
)
PROFILES: dict[str, Hardware] = {
    # A100 SXM4 80GB: NVLink3 600 GB/s both ways, one HDR 200 Gb/s NIC per GPU
    "a100_80gb": Hardware(
        "a100_80gb", 312.0, 19.5, 80 * GiB, 300.0, 25.0, 8, 0.78, hbm_gbps=2039.0, attention_efficiency=0.6
    ),
    "h100_80gb": _H100_SXM,
    # H100 PCIe 80GB: rings over PCIe Gen5 (an NVLink bridge joins pairs only), NDR 400 Gb/s per GPU
    "h100_pcie": Hardware(
        "h100_pcie",
        756.0,
        51.0,
        80 * GiB,
        64.0,
        50.0,
        8,
        0.7,
        hbm_gbps=2000.0,
        attention_efficiency=0.4,
        host_link_gbps=50,
        peak_tflops_8=2 * 756.0,
    ),
    # H200 SXM 141GB (DGX H200): the H100 SXM's compute and links, HBM3e 141 GB at 4.8 TB/s
    "h200": _H100_SXM.replace(name="h200", memory_bytes=141e9, hbm_gbps=4800.0),
    # one process per core group of a server CPU, gloo over shared memory / 10 GbE
    # ("host" and "device" are the same memory: host_ram_gb as memory_bytes, copies at memcpy speed)
    "cpu": Hardware(
        "cpu", 1.0, 1.0, 64 * GiB, 5.0, 1.25, 1, 0.5, latency_us=50.0, hbm_gbps=20.0, host_ram_gb=64, host_link_gbps=10
    ),
}
ALIASES = {
    "a100": "a100_80gb",
    "a100-80gb": "a100_80gb",
    "h100": "h100_80gb",
    "h100-80gb": "h100_80gb",
    "h100_sxm": "h100_80gb",
    "h100-sxm": "h100_80gb",
    "h100-pcie": "h100_pcie",
}


# substrings of torch.cuda.get_device_name() (upper-cased) → profile, most specific first; None: no profile
# (the H100 NVL's 835 TFLOP/s dense differs from both H100 profiles)
DEVICE_NAMES = (
    ("H100 NVL", None),
    ("H100 PCIE", "h100_pcie"),
    ("H100", "h100_80gb"),
    ("H200", "h200"),
    ("A100", "a100_80gb"),
)


def profile_for_device(device_name: str) -> Hardware | None:
    """The profile of a GPU called ``device_name`` (``"NVIDIA H100 PCIe"``), or None if none fits."""
    upper = device_name.upper()
    for key, profile in DEVICE_NAMES:
        if key in upper:
            return PROFILES[profile] if profile else None
    return None


def hardware_profile(name: str, custom: dict[str, dict] | None = None, **overrides) -> Hardware:
    """The profile ``name`` (case-insensitive; ``custom`` first, names to :class:`Hardware`'s fields; a ``.json``
    file as ``mode=calibrate`` writes) with ``overrides``; :class:`PlanError` for an unknown name or field."""
    if name.endswith(".json"):  # a profile file (mode=calibrate writes one): its fields, named by its stem
        try:
            with open(name) as f:
                fields_in_file = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanError(f"hardware profile file {name!r}: {e}; run mode=calibrate to write one") from None
        if not isinstance(fields_in_file, dict):
            raise PlanError(f"hardware profile file {name!r} must hold an object of Hardware fields")
        stem = os.path.splitext(os.path.basename(name))[0]
        return hardware_profile(stem, {stem: fields_in_file}, **overrides)
    key = name.lower()
    custom = {k.lower(): v for k, v in (custom or {}).items()}
    fields = ({f.name for f in dataclasses.fields(Hardware)} | set(HOST_FIELDS)) - {"name"}
    if key in custom:
        host = custom[key].get("host") or {}
        unknown = (set(custom[key]) - fields) | (set(host) - set(HOST_FIELDS) if isinstance(host, dict) else set())
        if unknown:
            raise PlanError(f"hardware profile {name!r}: unknown fields {sorted(unknown)}; known: {sorted(fields)}")
        missing = {f.name for f in dataclasses.fields(Hardware) if f.default is dataclasses.MISSING} - {"name"}
        missing -= set(custom[key])
        if missing:
            raise PlanError(f"hardware profile {name!r}: missing fields {sorted(missing)}")
        hw = Hardware.from_fields(key, custom[key])
    else:
        key = ALIASES.get(key, key)
        if key not in PROFILES:
            raise PlanError(
                f"unknown hardware profile {name!r}; known: {sorted(PROFILES) + sorted(custom)} "
                f"(or define your own under plan.profiles)"
            )
        hw = PROFILES[key]
    unknown = set(overrides) - fields
    if unknown:
        raise PlanError(f"unknown hardware fields {sorted(unknown)}; known: {sorted(fields)}")
    return hw.replace(**{k: v for k, v in overrides.items() if v is not None})
