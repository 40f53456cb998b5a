"""The typed recipe configuration and its up-front validation.

Every key a user types (``parallel.tp=2``, ``train.global_batch=64`` ...) is a
field of one of the dataclasses below; Hydra refuses unknown keys because the
schema is structured. :func:`validate` then checks the *relations* between
keys (batch arithmetic, layout against world size) and raises
:class:`ConfigError` naming the numbers and the fix. It is pure and runs on
every rank before any collective, so a bad configuration is an error
everywhere, never a hang.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from models.config import PRESETS, ModelConfig


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the numbers and the fix."""


@dataclass
class ParallelConfig:
    dp: Any = "auto"  # int, or "auto": world_size / (pp·tp)
    pp: int = 1
    tp: int = 1
    mp: Optional[int] = None  # alias of tp (Megatron's "model parallel" size)
    sequence_parallel: bool = False
    zero: int = 0  # 0-3
    pp_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved
    vpp: int = 1  # virtual stages per rank (interleaved)
    pp_layers: Optional[List[int]] = None  # explicit layers per stage
    order: str = "tp-dp-pp"  # rank order, fastest axis first
    gpus_per_node: int = 8  # for describe() and the planner
    timeout_s: float = 600.0  # every collective fails after this instead of hanging
    backend: Optional[str] = None  # nccl | gloo; default: nccl with CUDA, else gloo
    oversubscribe: bool = False  # self-spawn more local workers than launch.local.local_capacity allows


@dataclass
class TrainConfig:
    global_batch: int = 32  # sequences per optimizer step, whatever the layout
    micro_batch: int = 4  # sequences per micro-batch per DP rank
    max_steps: int = 200
    precision: str = "fp32"  # fp32 | bf16 | fp16
    seed: int = 1234
    grad_clip: float = 1.0  # 0 disables
    log_every: int = 10
    eval_every: int = 50  # validation loss every N steps; 0 disables
    eval_batches: int = 4
    ckpt_every: int = 0  # 0: only at the end (if ckpt_at_end)
    ckpt_at_end: bool = False
    resume: Optional[str] = None  # auto (the run's checkpoints/latest, if any) | a checkpoint path
    sigterm_grace_s: float = 60.0  # after SIGTERM, a rank not at a step's end by then exits (143)
    ckpt_keep: int = 3  # published checkpoints kept (0: all)
    fault: Optional[str] = None  # fault drill: "<raise|kill|term|kill_in_save>@<rank>:<step>" (checkpointing.py)
    threads: int = 0  # intra-op threads per rank on CPU; 0: cores / local ranks


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | linear | constant


@dataclass
class CommConfig:
    dtype: Optional[str] = None  # gradient communication dtype; default: the compute dtype
    bucket_mb: float = 25.0
    overlap: bool = True
    compression: str = "none"  # none | topk
    topk_ratio: float = 0.01


@dataclass
class DataConfig:
    source: str = "embedded"  # embedded | memmap
    path: Optional[str] = None  # memmap: directory with train.bin / val.bin / meta.json
    val_fraction: float = 0.05  # embedded corpus held out for validation
    embedded_mb: float = 4.0  # size of the embedded corpus


@dataclass
class LoggerConfig:
    progress: bool = True  # rank-0 progress bar
    wandb: str = "disabled"  # disabled | offline | online
    project: str = "gridtrain"
    peak_tflops: Optional[float] = None  # for MFU; default: measured (CPU) or device table
    timeline: bool = False  # record step 2 on every stage; write timeline.png (the pipeline's bubble)


@dataclass
class ModelSection:
    """``model.*`` keys: a named size (``preset``) and any field of
    :class:`models.config.ModelConfig` to change (None keeps the preset's)."""

    preset: str = "gpt_tiny"
    arch: Optional[str] = None
    n_layers: Optional[int] = None
    d_model: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    tie_embeddings: Optional[bool] = None
    activation_checkpointing: Optional[str] = None
    norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    init_std: Optional[float] = None
    vocab_multiple: Optional[int] = None


def model_config(section: Any) -> ModelConfig:
    """The :class:`ModelConfig` a ``model`` section describes (preset + changed fields)."""
    if section.preset not in PRESETS:
        raise ConfigError(f"model.preset={section.preset!r} is not one of {sorted(PRESETS)}")
    changes = {k: getattr(section, k) for k in vars(ModelSection()) if k != "preset"}
    return PRESETS[section.preset].replace(**{k: v for k, v in changes.items() if v is not None})


# --- planner keys (added by the planner branch; see docs/planner.md) -------------
@dataclass
class PlanSection:
    """``plan.*`` keys for ``mode=plan`` / ``mode=recommend``; None keeps the profile's value."""

    hardware: str = "a100_80gb"  # a100_80gb | h100_80gb | h200 | cpu | a name under profiles
    world_size: Optional[int] = None  # devices: resolves dp=auto (plan) / the count to search (recommend)
    top: int = 5  # recommend: layouts shown
    gpus_per_node: Optional[int] = None
    intra_node_gbps: Optional[float] = None  # GB/s per device per direction
    inter_node_gbps: Optional[float] = None  # e.g. 12.5 for 100 Gb/s Ethernet
    efficiency: Optional[float] = None  # achieved / peak FLOP/s
    memory_gb: Optional[float] = None
    profiles: Dict[str, Any] = field(default_factory=dict)  # user hardware: name -> Hardware fields
# -------------------------------------------------------------------------------


@dataclass
class RecipeConfig:
    mode: str = "train"  # train | plan | recommend
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    deepspeed: Optional[str] = None  # path to a DeepSpeed-style JSON mapped onto this config
    plan: PlanSection = field(default_factory=PlanSection)  # planner keys (mode=plan / recommend)


CHOICES = {
    "mode": ("train", "plan", "recommend"),
    "parallel.pp_schedule": ("1f1b", "gpipe", "interleaved"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "comm.compression": ("none", "topk"),
    "comm.dtype": (None, "fp32", "bf16", "fp16"),
    "data.source": ("embedded", "memmap"),
    "logger.wandb": ("disabled", "offline", "online"),
    "parallel.zero": (0, 1, 2, 3),
}


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Layout:
    """The resolved layout and batch arithmetic of a run."""

    dp: int
    pp: int
    tp: int
    micro_batch: int
    grad_accum: int  # micro-batches per DP rank per step
    model: ModelConfig

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp


def resolve_dp(parallel: ParallelConfig, world_size: int | None) -> int:
    """dp as an int: the configured value, or world_size / (pp·tp) for ``auto``."""
    from parallel.topology import Topology, TopologyError

    dp = None if parallel.dp in (None, "auto") else parallel.dp
    if dp is None and world_size is None:
        return 1  # self-spawned single replica: dp=auto means 1
    try:
        return Topology(dp, parallel.pp, parallel.tp, world_size=world_size).dp
    except TopologyError as e:
        raise ConfigError(f"{e}. (Try `mode=plan` to size a layout before launching.)") from None


def resolve_aliases(cfg: Any) -> None:
    """``parallel.mp`` is another name for ``parallel.tp``: fold it in (idempotent)."""
    p = cfg.parallel
    if p.mp is None:
        return
    if p.tp not in (1, p.mp):
        raise ConfigError(f"parallel.mp={p.mp} and parallel.tp={p.tp} disagree (mp is an alias of tp); set one")
    p.tp = p.mp


def validate(cfg: Any, world_size: int | None = None) -> Layout:
    """Check every relation between keys; return the resolved :class:`Layout`.

    ``world_size`` is the number of launched processes (None when the recipe
    will spawn its own: dp=auto then means 1). Raises :class:`ConfigError`.
    """
    resolve_aliases(cfg)
    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{key}={v!r} is not one of {', '.join(map(repr, allowed))}")
    p, t = cfg.parallel, cfg.train
    for key in ("parallel.pp", "parallel.tp", "parallel.vpp", "train.global_batch",
                "train.micro_batch", "train.max_steps", "train.log_every"):
        v = _get(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key} must be a positive integer, got {v!r}")
    if p.dp not in (None, "auto") and (isinstance(p.dp, bool) or not isinstance(p.dp, int) or p.dp < 1):
        raise ConfigError(f"parallel.dp must be a positive integer or 'auto', got {p.dp!r}")
    dp = resolve_dp(p, world_size)
    from models.config import ModelConfigError

    try:
        mc = model_config(cfg.model).validate(tp=p.tp)
    except ModelConfigError as e:
        raise ConfigError(f"model: {e}") from None
    per_replica = t.micro_batch * dp
    if t.global_batch % per_replica:
        lo = max(1, t.global_batch // per_replica) * per_replica
        raise ConfigError(
            f"train.global_batch {t.global_batch} is not a multiple of micro_batch {t.micro_batch} × "
            f"dp {dp} = {per_replica} (global_batch = micro_batch × grad_accum × dp); "
            f"use global_batch={lo} or {lo + per_replica}, or change micro_batch"
        )
    grad_accum = t.global_batch // per_replica
    if p.pp_schedule == "interleaved" and p.vpp < 2:
        raise ConfigError("parallel.pp_schedule=interleaved needs parallel.vpp ≥ 2 virtual stages per rank")
    if p.pp_schedule == "interleaved" and p.pp < 2:
        raise ConfigError("parallel.pp_schedule=interleaved needs parallel.pp ≥ 2 (with pp=1 use 1f1b)")
    if p.pp_schedule == "interleaved" and grad_accum % p.pp:
        raise ConfigError(
            f"the interleaved schedule needs the micro-batches per step (global_batch {t.global_batch} / "
            f"(micro_batch {t.micro_batch} × dp {dp}) = {grad_accum}) to be a multiple of pp {p.pp}; "
            f"use train.global_batch={(grad_accum // p.pp + 1) * p.pp * per_replica}"
        )
    if t.eval_every and t.eval_batches < 1:
        raise ConfigError(f"train.eval_batches must be ≥ 1 when train.eval_every={t.eval_every} (or set eval_every=0)")
    if p.vpp > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"parallel.vpp={p.vpp} needs parallel.pp_schedule=interleaved")
    if p.pp_layers is not None:
        layers = list(p.pp_layers)
        if len(layers) != p.pp * p.vpp or sum(layers) != mc.n_layers or min(layers) < 1:
            raise ConfigError(
                f"parallel.pp_layers={layers} must list {p.pp * p.vpp} positive layer counts "
                f"(pp {p.pp} × vpp {p.vpp}) summing to model.n_layers {mc.n_layers}"
            )
    if p.pp * p.vpp > mc.n_layers:
        raise ConfigError(
            f"pp {p.pp} × vpp {p.vpp} = {p.pp * p.vpp} stages but the model has only "
            f"{mc.n_layers} layers; lower parallel.pp (or vpp)"
        )
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    if p.sequence_parallel and mc.seq_len % p.tp:
        raise ConfigError(
            f"sequence parallelism splits model.seq_len {mc.seq_len} over tp {p.tp}: "
            f"it must be divisible"
        )
    if not 0 < cfg.comm.topk_ratio <= 1:
        raise ConfigError(f"comm.topk_ratio must be in (0, 1], got {cfg.comm.topk_ratio}")
    if cfg.comm.compression != "none" and p.zero != 0:
        raise ConfigError("comm.compression=topk is implemented for parallel.zero=0 only")
    if cfg.data.source == "memmap" and not cfg.data.path:
        raise ConfigError("data.source=memmap needs data.path (a directory made by `python -m recipes.prepare`)")
    if p.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {p.timeout_s}")
    if t.ckpt_every < 0 or t.ckpt_keep < 0:
        raise ConfigError(f"train.ckpt_every ({t.ckpt_every}) and train.ckpt_keep ({t.ckpt_keep}) must be ≥ 0")
    if t.fault is not None and not re.fullmatch(r"(raise|kill|term|kill_in_save)@\d+:\d+", t.fault):
        raise ConfigError(f"train.fault={t.fault!r} must look like <kind>@<rank>:<step> with kind "
                          f"raise, kill, term or kill_in_save")
    return Layout(dp=dp, pp=p.pp, tp=p.tp, micro_batch=t.micro_batch, grad_accum=grad_accum, model=mc)
