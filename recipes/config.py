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

import dataclasses
import difflib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from models.config import PRESETS, ModelConfig
from parallel.pipeline.schedules import SCHEDULES, schedule_problem
from parallel.precision import PRECISIONS
from parallel.zero.compression import COMPRESSIONS
from parallel.zero.policy import ZERO_STAGES

from .runlog import LR_SCHEDULES


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the numbers and the fix."""


def bad(key: str, value: Any, reason: str, fix: str) -> ConfigError:
    """The one error format: ``<key>=<value>: <reason>; <fix>`` (the CLI prefixes ``error: ``)."""
    return ConfigError(f"{key}={_show(value)}: {reason}; {fix}")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value)


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
    dtype: Optional[str] = None  # gradient communication dtype; default fp32 (parallel.zero.theory.grad_comm_dtype)
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
    profile: Optional[list[int]] = None  # [first, last] step: torch.profiler traces (recipes/profiling.py)


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
class DryrunSection:
    """``dryrun.*`` keys for ``mode=dryrun`` (see recipes/dryrun.py)."""

    ranks: Optional[List[int]] = None  # None: the first rank, a middle stage's rank, the last rank
    peers: bool = False  # also run each rank's TP, DP and PP neighbours and check their call sequences
    jobs: int = 2  # ranks run at once (one process each)


@dataclass
class RecipeConfig:
    mode: str = "train"  # train | plan | recommend | dryrun
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    deepspeed: Optional[str] = None  # path to a DeepSpeed-style JSON mapped onto this config
    plan: PlanSection = field(default_factory=PlanSection)  # planner keys (mode=plan / recommend)
    dryrun: DryrunSection = field(default_factory=DryrunSection)  # mode=dryrun keys


# The typed choices of the config, each tuple imported from where the library defines the names.
# OmegaConf 2.3's structured configs refuse ``Literal`` annotations ("Unexpected type annotation"),
# so the fields stay ``str``/``int`` and this table is the one place they are validated
# (:func:`check_values`, for every mode).
CHOICES = {
    "mode": ("train", "plan", "recommend", "dryrun"),
    "parallel.pp_schedule": SCHEDULES,
    "train.precision": PRECISIONS,
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": LR_SCHEDULES,
    "comm.compression": COMPRESSIONS,
    "comm.dtype": (None, *PRECISIONS),
    "data.source": ("embedded", "memmap"),
    "logger.wandb": ("disabled", "offline", "online"),
    "parallel.zero": ZERO_STAGES,
    "parallel.backend": (None, "nccl", "gloo"),
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


def _number(
    key: str,
    v: Any,
    *,
    lo: float,
    lo_open: bool = False,
    hi: float = math.inf,
    hi_open: bool = False,
    integer: bool = False,
    fix: str,
) -> None:
    """Refuse ``key=v`` unless it is a finite number (an int if ``integer``) in the given range."""
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or (not integer and not math.isfinite(v)):
        raise bad(key, v, f"must be {kind}" + ("" if integer else " (finite)"), fix)
    if v < lo or (lo_open and v == lo) or v > hi or (hi_open and v == hi):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        if hi == math.inf:
            span = f"> {lo:g}" if lo_open else f"≥ {lo:g}"
        raise bad(key, v, f"must be {span}", fix)


def check_values(cfg: Any) -> None:
    """Every single-key range the trainer and its libraries rely on (a torch or NumPy error
    later would never name the key). Pure; raises :class:`ConfigError`."""
    o, t, c, d, p = cfg.optim, cfg.train, cfg.comm, cfg.data, cfg.parallel
    _number("optim.lr", o.lr, lo=0, lo_open=True, fix="a learning rate like optim.lr=1e-3")
    _number("optim.min_lr", o.min_lr, lo=0, fix="the schedule's floor, e.g. optim.min_lr=1e-4 (0 allowed)")
    if o.min_lr > o.lr:
        raise bad("optim.min_lr", o.min_lr, f"above optim.lr={o.lr:g}", "use optim.min_lr ≤ optim.lr")
    betas = list(o.betas) if isinstance(o.betas, (list, tuple)) else o.betas
    if not isinstance(betas, list) or len(betas) != 2:
        raise bad("optim.betas", betas, "must be two numbers [beta1,beta2]", "e.g. optim.betas=[0.9,0.95]")
    for b in betas:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
            raise bad("optim.betas", betas, "each beta must be in [0, 1)", "e.g. optim.betas=[0.9,0.95]")
    _number("optim.eps", o.eps, lo=0, lo_open=True, fix="e.g. optim.eps=1e-8")
    _number("optim.weight_decay", o.weight_decay, lo=0, fix="e.g. optim.weight_decay=0.1 (0 disables)")
    _number("optim.warmup_steps", o.warmup_steps, lo=0, integer=True, fix="e.g. optim.warmup_steps=20")
    _number(
        "train.eval_every",
        t.eval_every,
        lo=0,
        integer=True,
        fix="validation every N steps; train.eval_every=0 disables it",
    )
    _number(
        "train.threads",
        t.threads,
        lo=0,
        integer=True,
        fix="intra-op threads per rank; train.threads=0 picks cores / local ranks",
    )
    _number("train.grad_clip", t.grad_clip, lo=0, fix="a global-norm bound like train.grad_clip=1.0; 0 disables")
    _number("train.sigterm_grace_s", t.sigterm_grace_s, lo=0, lo_open=True, fix="e.g. train.sigterm_grace_s=60")
    _number("comm.bucket_mb", c.bucket_mb, lo=0, lo_open=True, fix="e.g. comm.bucket_mb=25")
    _number(
        "data.val_fraction",
        d.val_fraction,
        lo=0,
        lo_open=True,
        hi=1,
        hi_open=True,
        fix="the held-out share of the embedded corpus, e.g. data.val_fraction=0.05",
    )
    _number(
        "data.embedded_mb",
        d.embedded_mb,
        lo=0,
        lo_open=True,
        fix="the embedded corpus size in MiB, e.g. data.embedded_mb=4",
    )
    _number("parallel.gpus_per_node", p.gpus_per_node, lo=1, integer=True, fix="e.g. parallel.gpus_per_node=8")
    from parallel.topology import Topology, TopologyError

    try:
        Topology(1, 1, 1, order=p.order)
    except TopologyError:
        raise bad(
            "parallel.order",
            p.order,
            "must name each of tp, dp, pp once, fastest first",
            "e.g. parallel.order=tp-dp-pp",
        ) from None


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
    check_values(cfg)
    p, t = cfg.parallel, cfg.train
    for key in (
        "parallel.pp",
        "parallel.tp",
        "parallel.vpp",
        "train.global_batch",
        "train.micro_batch",
        "train.max_steps",
        "train.log_every",
    ):
        v = _get(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key} must be a positive integer, got {v!r}")
    if p.dp not in (None, "auto") and (isinstance(p.dp, bool) or not isinstance(p.dp, int) or p.dp < 1):
        raise ConfigError(f"parallel.dp must be a positive integer or 'auto', got {p.dp!r}")
    dp = resolve_dp(p, world_size)
    from models.config import ModelConfigError

    try:
        mc = model_config(cfg.model).validate(tp=p.tp)
    except ModelConfigError as e:  # name the keys this config set that the rule involves
        keys = [
            f"model.{k}={_show(v)}"
            for k, v in vars(cfg.model).items()
            if k != "preset" and v is not None and re.search(rf"\b{k}\b", str(e))
        ]
        if p.tp > 1 and re.search(r"\btp\b", str(e)):
            keys.append(f"parallel.tp={p.tp}")
        raise ConfigError(f"{', '.join(keys) or f'model.preset={cfg.model.preset}'}: {e}") from None
    per_replica = t.micro_batch * dp
    if t.global_batch % per_replica:
        lo = max(1, t.global_batch // per_replica) * per_replica
        raise ConfigError(
            f"train.global_batch {t.global_batch} is not a multiple of micro_batch {t.micro_batch} × "
            f"dp {dp} = {per_replica} (global_batch = micro_batch × grad_accum × dp); "
            f"use global_batch={lo} or {lo + per_replica}, or change micro_batch"
        )
    grad_accum = t.global_batch // per_replica
    problem = schedule_problem(p.pp_schedule, p.pp, p.vpp, prefix="parallel.")  # the library's own rule
    if problem:
        raise ConfigError(problem)
    if p.pp_schedule == "interleaved" and grad_accum % p.pp:
        raise ConfigError(
            f"the interleaved schedule needs the micro-batches per step (global_batch {t.global_batch} / "
            f"(micro_batch {t.micro_batch} × dp {dp}) = {grad_accum}) to be a multiple of pp {p.pp}; "
            f"use train.global_batch={(grad_accum // p.pp + 1) * p.pp * per_replica}"
        )
    if t.eval_every and t.eval_batches < 1:
        raise ConfigError(f"train.eval_batches must be ≥ 1 when train.eval_every={t.eval_every} (or set eval_every=0)")
    if p.pp_layers is not None:
        layers = list(p.pp_layers)
        if len(layers) != p.pp or sum(layers) != mc.n_layers or min(layers) < 1:
            raise ConfigError(
                f"parallel.pp_layers={layers} must list {p.pp} positive layer counts "
                f"(one per pipeline rank, pp {p.pp}) summing to model.n_layers {mc.n_layers}"
            )
    if p.pp * p.vpp > mc.n_layers:
        raise ConfigError(
            f"pp {p.pp} × vpp {p.vpp} = {p.pp * p.vpp} stages but the model has only "
            f"{mc.n_layers} layers; lower parallel.pp (or vpp)"
        )
    from parallel.plan.shape import ModelShape, layer_partition

    try:  # the trainer's own split (vpp must divide each rank's layers)
        layer_partition(ModelShape.of(mc), p.pp, p.vpp, p.pp_layers)
    except ValueError as e:
        raise bad(
            "parallel.vpp",
            p.vpp,
            str(e).split("; ")[0],
            f"use model.n_layers a multiple of pp·vpp = {p.pp * p.vpp}, or parallel.pp_layers "
            f"with multiples of {p.vpp}",
        ) from None
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    if p.sequence_parallel and mc.seq_len % p.tp:
        raise ConfigError(
            f"sequence parallelism splits model.seq_len {mc.seq_len} over tp {p.tp}: it must be divisible"
        )
    if not 0 < cfg.comm.topk_ratio <= 1:
        raise ConfigError(f"comm.topk_ratio must be in (0, 1], got {cfg.comm.topk_ratio}")
    if cfg.comm.compression != "none" and p.zero != 0:
        raise ConfigError("comm.compression=topk is implemented for parallel.zero=0 only")
    if cfg.data.source == "memmap" and not cfg.data.path:
        raise ConfigError("data.source=memmap needs data.path (a directory made by `python -m recipes.prepare`)")
    from .profiling import profile_steps  # logger.profile

    profile_steps(cfg.logger.profile, t.max_steps)
    if p.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {p.timeout_s}")
    if t.ckpt_every < 0 or t.ckpt_keep < 0:
        raise ConfigError(f"train.ckpt_every ({t.ckpt_every}) and train.ckpt_keep ({t.ckpt_keep}) must be ≥ 0")
    if t.fault is not None and not re.fullmatch(r"(raise|kill|term|kill_in_save)@\d+:\d+", t.fault):
        raise ConfigError(
            f"train.fault={t.fault!r} must look like <kind>@<rank>:<step> with kind raise, kill, term or kill_in_save"
        )
    return Layout(dp=dp, pp=p.pp, tp=p.tp, micro_batch=t.micro_batch, grad_accum=grad_accum, model=mc)


# --- unknown keys: refused in every form (plain, `+`, `++`, `~`) ---------------------------------------
def schema_keys(schema: Any = None, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of the recipe schema → True where the key is a free-form mapping
    (``plan.profiles``: user-named entries below it are allowed)."""
    schema = RecipeConfig() if schema is None else schema
    out: dict[str, bool] = {}
    for f in dataclasses.fields(schema):
        value, dotted = getattr(schema, f.name), prefix + f.name
        out[dotted] = isinstance(value, dict)
        if dataclasses.is_dataclass(value):
            out.update(schema_keys(value, dotted + "."))
    return out


def key_error(key: str, value: Any = None) -> ConfigError | None:
    """None if ``key`` (dotted) is in the schema or under a free-form mapping; else the error
    naming the closest valid key."""
    keys = schema_keys()
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        head = ".".join(parts[:i])
        if head not in keys:
            break
        if keys[head] or i == len(parts):
            return None
    leaves = [k for k in keys if not any(o.startswith(k + ".") for o in keys)]
    close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
    if not close:  # a typo in the section name: compare the last part within every section
        by_name = {k.rsplit(".", 1)[-1]: k for k in leaves}
        close = [by_name[m] for m in difflib.get_close_matches(parts[-1], list(by_name), n=1, cutoff=0.8)]
    fix = f"did you mean {close[0]}?" if close else "`--cfg job` lists every key"
    reason = "no such key in the recipe schema (recipes/config.py)"
    return bad(key, value, reason, fix) if value is not None else ConfigError(f"{key}: {reason}; {fix}")


def unknown_keys(cfg: dict, schema: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every entry of a composed config (a plain dict, e.g.
    ``OmegaConf.to_container(cfg)``) that the schema does not define. Hydra's ``+key=value``
    adds keys to a structured config on purpose, so the composed config is checked here."""
    schema = RecipeConfig() if schema is None else schema
    out = []
    for key, value in cfg.items():
        dotted = prefix + str(key)
        if not hasattr(schema, str(key)):
            out.append((dotted, value))
        elif dataclasses.is_dataclass(getattr(schema, key)) and isinstance(value, dict):
            out.extend(unknown_keys(value, getattr(schema, key), dotted + "."))
    return out


def check_keys(cfg: dict) -> None:
    """Raise :class:`ConfigError` for the first key of a composed config the schema lacks."""
    for key, value in unknown_keys(cfg):
        err = key_error(key, value)
        if err is not None:
            raise err


def _override_values(ov: Any) -> list | None:
    """The values an override sets (each of a sweep's), or None where only Hydra can expand them."""
    try:
        return list(ov.sweep_iterator()) if ov.is_sweep_override() else [ov.value()]
    except Exception:  # noqa: BLE001 - glob / interval sweeps need the config: Hydra checks them
        return None


def check_overrides(overrides: Iterable[str]) -> None:
    """Refuse command-line overrides of keys the schema lacks, or of values its types reject,
    before Hydra composes (Hydra's own message is a multi-line exit 1 that suggests ``+key``).

    Left to Hydra / :func:`check_keys`: ``hydra.*`` keys, config groups (``hydra/launcher=...``),
    the ``+``/``++`` append forms (a ``+group=option`` may be a user's config group; what it adds
    is checked after composition) and sweep values that are not plain lists.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return  # a syntax error: Hydra's own message shows where
    schema = None
    for ov in parsed:
        key = ov.key_or_group
        if key == "hydra" or key.startswith("hydra.") or "/" in key or ov.package is not None:
            continue
        if ov.type in (OverrideType.ADD, OverrideType.FORCE_ADD):
            continue
        text = ov.input_line.split("=", 1)[1] if "=" in ov.input_line else None
        err = key_error(key, text)
        if err is not None:
            raise err
        if ov.type == OverrideType.DEL:
            continue
        values = _override_values(ov)
        if values is None:
            continue
        schema = OmegaConf.structured(RecipeConfig) if schema is None else schema
        for v in values:
            try:
                OmegaConf.update(schema, key, v, merge=True)
            except OmegaConfBaseException as e:
                default = OmegaConf.select(OmegaConf.structured(RecipeConfig), key)
                reason = str(e).splitlines()[0].rstrip(".")
                raise bad(key, v, reason, f"the default is {key}={_show(default)}") from None
