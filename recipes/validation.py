"""The up-front validation of a recipe configuration (the schema is in :mod:`recipes.config`).

:func:`validate` checks the *relations* between keys (batch arithmetic, layout
against world size) and raises :class:`~recipes.config.ConfigError` naming the
numbers and the fix. It is pure and runs on every rank before any collective,
so a bad configuration is an error everywhere, never a hang. Also here: the
``CHOICES`` table, single-key ranges (:func:`check_values`), ``dp=auto`` and
alias resolution, and the refusal of unknown keys and ill-typed overrides
(:func:`check_keys`, :func:`check_overrides`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Iterable
from typing import Any

from parallel.dims import CP_IMPLS, LayoutError, ParallelDims, interleaved_problem, topk_ratio_problem
from parallel.layers.moe import CONTEXT_PARALLEL_CAPACITY_REFUSED, MoEConfigError
from parallel.pipeline.schedules import SCHEDULES, schedule_problem
from parallel.precision import PRECISIONS
from parallel.zero.compression import COMPRESSIONS
from parallel.zero.offload import MIN_STAGE as OFFLOAD_MIN_STAGE
from parallel.zero.offload import OFFLOAD_MODES
from parallel.zero.policy import ZERO_STAGES
from parallel.zero.theory import ZERO_ACCUMULATE, accumulate_applies

from .config import ConfigError, Layout, ParallelConfig, RecipeConfig, _show, bad, model_config
from .training.runlog import LR_SCHEDULES

# The typed choices of the config, each tuple imported from where the library defines the names.
# OmegaConf 2.3's structured configs refuse ``Literal`` annotations ("Unexpected type annotation"),
# so the fields stay ``str``/``int`` and this table is the one place they are validated
# (:func:`check_values`, for every mode).
CHOICES = {
    "mode": ("train", "plan", "recommend", "dryrun", "calibrate"),
    "parallel.pp_schedule": SCHEDULES,
    "train.precision": PRECISIONS,
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": LR_SCHEDULES,
    "comm.compression": COMPRESSIONS,
    "comm.dtype": (None, *PRECISIONS),
    "data.source": ("embedded", "memmap"),
    "logger.wandb": ("disabled", "offline", "online"),
    "parallel.zero": ZERO_STAGES,
    "parallel.offload": OFFLOAD_MODES,
    "parallel.zero_accumulate": ZERO_ACCUMULATE,
    "parallel.zero3_accumulate": (None, *ZERO_ACCUMULATE),
    "parallel.backend": (None, "nccl", "gloo"),
    "parallel.cp_impl": CP_IMPLS,
}


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_dp(parallel: ParallelConfig, world_size: int | None) -> int:
    """dp as an int: the configured value, or world_size / (pp·tp·cp) for ``auto``."""
    from parallel.topology import Topology, TopologyError

    dp = None if parallel.dp in (None, "auto") else parallel.dp
    if dp is None and world_size is None:
        return 1  # self-spawned single replica: dp=auto means 1
    try:
        return Topology(dp, parallel.pp, parallel.tp, parallel.cp, world_size=world_size).dp
    except TopologyError as e:
        raise ConfigError(f"{e}. (Try `mode=plan` to size a layout before launching.)") from None


def resolve_aliases(cfg: Any) -> None:
    """Fold old or alternative key names into their one key (idempotent): ``parallel.mp`` is another
    name for ``parallel.tp``; ``parallel.zero3_accumulate`` the old name of ``parallel.zero_accumulate``."""
    p = cfg.parallel
    old = p.zero3_accumulate
    if old in ZERO_ACCUMULATE:  # any other value is refused under its own name by check_values
        if p.zero_accumulate not in ("sharded", old):  # the default, or the same choice
            raise ConfigError(
                f"parallel.zero3_accumulate={old} and parallel.zero_accumulate={p.zero_accumulate} disagree "
                f"(zero3_accumulate is the old name of zero_accumulate); set parallel.zero_accumulate only"
            )
        p.zero_accumulate = old
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


# the recipe key of each ParallelDims field a LayoutError names
DIMS_KEYS = {
    "dp": "parallel.dp",
    "pp": "parallel.pp",
    "tp": "parallel.tp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "vpp": "parallel.vpp",
    "zero": "parallel.zero",
    "cp_impl": "parallel.cp_impl",
    "sequence_parallel": "parallel.sequence_parallel",
    "offload": "parallel.offload",
    "schedule": "parallel.pp_schedule",
    "compression": "comm.compression",
    "seq_len": "model.seq_len",
}


def parallel_dims(p: ParallelConfig, dp: int, mc: Any, compression: str = "none") -> ParallelDims:
    """The config's :class:`~parallel.dims.ParallelDims`: the library's own checks of the layout,
    its refusal raised as :class:`ConfigError` naming the recipe keys it involves."""
    try:
        return ParallelDims(
            dp=dp,
            pp=p.pp,
            tp=p.tp,
            cp=p.cp,
            ep=p.ep,
            zero=p.zero,
            cp_impl=p.cp_impl,
            sequence_parallel=bool(p.sequence_parallel),
            offload=p.offload,
            schedule=p.pp_schedule,
            vpp=p.vpp,
            compression=compression,
            seq_len=mc.seq_len,
            n_heads=mc.n_heads,
            n_kv_heads=mc.n_kv_heads,
            n_layers=mc.n_layers,
            d_ff=mc.d_ff,
            moe_experts=mc.moe_experts,
        )
    except LayoutError as e:
        keys = ", ".join(
            f"{DIMS_KEYS[k]}={str(v).lower() if isinstance(v, bool) else _show(v)}" for k, v in e.values.items()
        )
        raise ConfigError(f"{keys}: {e}" if keys else str(e)) from None


def _check_moe(p: Any, mc: Any, cfg: Any) -> None:
    """MoE: the layer's own rules (experts over ep); no fp16, nor what no test has verified it with
    (docs/moe.md). That ep divides dp and needs experts is the layout's rule (:func:`parallel_dims`)."""
    if not mc.moe_experts:
        return
    try:
        mc.moe_config().check(p.ep)
    except MoEConfigError as e:
        raise ConfigError(
            f"model.moe_experts={mc.moe_experts}, model.moe_top_k={mc.moe_top_k}, parallel.ep={p.ep}: {e}"
        ) from None
    if cfg.train.precision == "fp16":
        raise ConfigError(
            "train.precision=fp16 with an MoE model: the router losses are not loss-scaled; use bf16 or fp32"
        )
    unverified = {
        "parallel.sequence_parallel=true": p.sequence_parallel,  # the layer routes whole sequences' tokens
        f"parallel.offload={p.offload}": p.offload != "none",
        "parallel.pp_schedule=zb-h1": p.pp_schedule == "zb-h1",
    }
    if p.cp > 1 and mc.moe_capacity_factor is not None:
        raise ConfigError(
            f"parallel.cp={p.cp}, model.moe_capacity_factor={mc.moe_capacity_factor}: {CONTEXT_PARALLEL_CAPACITY_REFUSED}"
        )
    for what, on in unverified.items():
        if on:
            raise ConfigError(
                f"an MoE model (model.moe_experts={mc.moe_experts}) with {what}: this combination is not "
                "implemented/verified against one process; turn it off (MoE trains with dp, ep, tp without "
                "sequence parallelism, cp (dropless), pp with 1f1b/gpipe/interleaved, ZeRO 0-3)"
            )


_POSITIVE = (
    "parallel.pp",
    "parallel.tp",
    "parallel.cp",
    "parallel.vpp",
    "train.global_batch",
    "train.micro_batch",
    "train.max_steps",
    "train.log_every",
)


def _check_types(cfg: Any) -> None:
    """Choices, single-key ranges and the positive integers, before any relation is looked at."""
    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{key}={v!r} is not one of {', '.join(map(repr, allowed))}")
    check_values(cfg)
    for key in _POSITIVE:
        v = _get(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key} must be a positive integer, got {v!r}")
    p = cfg.parallel
    if p.dp not in (None, "auto") and (isinstance(p.dp, bool) or not isinstance(p.dp, int) or p.dp < 1):
        raise ConfigError(f"parallel.dp must be a positive integer or 'auto', got {p.dp!r}")
    if isinstance(p.ep, bool) or not isinstance(p.ep, int) or p.ep < 1:
        raise ConfigError(f"parallel.ep must be a positive integer, got {p.ep!r}")


def _model(cfg: Any, tp: int) -> Any:
    """The model config, checked at ``tp``; its refusal names the keys this config set."""
    from models.config import ModelConfigError

    try:
        return model_config(cfg.model).validate(tp=tp)
    except ModelConfigError as e:  # name the keys this config set that the rule involves
        keys = [
            f"model.{k}={_show(v)}"
            for k, v in vars(cfg.model).items()
            if k != "preset" and v is not None and re.search(rf"\b({k}|{k.removeprefix('moe_')})\b", str(e))
        ]
        if tp > 1 and re.search(r"\btp\b", str(e)):
            keys.append(f"parallel.tp={tp}")
        raise ConfigError(f"{', '.join(keys) or f'model.preset={cfg.model.preset}'}: {e}") from None


def _grad_accum(t: Any, dims: ParallelDims) -> int:
    """Micro-batches per DP rank per step (global_batch = micro_batch × grad_accum × dp)."""
    per_replica = t.micro_batch * dims.dp
    if t.global_batch % per_replica:
        lo = max(1, t.global_batch // per_replica) * per_replica
        raise ConfigError(
            f"train.global_batch {t.global_batch} is not a multiple of micro_batch {t.micro_batch} × "
            f"dp {dims.dp} = {per_replica} (global_batch = micro_batch × grad_accum × dp); "
            f"use global_batch={lo} or {lo + per_replica}, or change micro_batch"
        )
    problem = interleaved_problem(dims.schedule, dims.pp, t.global_batch, t.micro_batch, dims.dp)
    if problem:
        raise ConfigError(f"parallel.pp_schedule=interleaved, parallel.pp={dims.pp}: {problem}")
    return t.global_batch // per_replica


def _check_pipeline(p: Any, mc: Any) -> None:
    """The schedule against the rest of the run, and the layer split (pp_layers, vpp)."""
    if p.pp_schedule == "zb-h1" and mc.activation_checkpointing != "none":
        raise ConfigError(
            f"parallel.pp_schedule=zb-h1 with model.activation_checkpointing={mc.activation_checkpointing}: "
            "zero bubble runs each micro-batch's backward in two autograd passes (input gradient, then weight "
            "gradient), and recomputed blocks would be recomputed again in each (with their collectives); "
            "set model.activation_checkpointing=none, or parallel.pp_schedule=1f1b to keep recomputation"
        )
    if p.pp_schedule == "zb-h1" and p.zero == 3:
        raise ConfigError(
            "parallel.pp_schedule=zb-h1 with parallel.zero=3: the weight-gradient pass (W) runs after ZeRO-3 "
            "has freed the block's gathered parameters, and some of its kernels (norms) read them; use "
            "parallel.zero ≤ 2 with zb-h1, or parallel.pp_schedule=1f1b with zero=3"
        )
    if p.pp_layers is not None:
        layers = list(p.pp_layers)
        if len(layers) != p.pp or sum(layers) != mc.n_layers or min(layers) < 1:
            raise ConfigError(
                f"parallel.pp_layers={layers} must list {p.pp} positive layer counts "
                f"(one per pipeline rank, pp {p.pp}) summing to model.n_layers {mc.n_layers}"
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


def _check_zero(p: Any, comm: Any) -> None:
    """Top-K's ratio; what offload and unsharded accumulation need of the ZeRO stage."""
    if topk_ratio_problem(comm.topk_ratio):
        raise ConfigError(f"comm.{topk_ratio_problem(comm.topk_ratio)}")
    if p.zero < OFFLOAD_MIN_STAGE[p.offload]:
        need = OFFLOAD_MIN_STAGE[p.offload]
        raise ConfigError(
            f"parallel.offload={p.offload} needs parallel.zero ≥ {need} (what it offloads is each rank's "
            f"shard), got parallel.zero={p.zero}; set parallel.zero={need}"
            + ("" if need == 3 else " (or 2, 3)")
            + " or parallel.offload=none"
        )
    if p.zero_accumulate == "unsharded" and not accumulate_applies(p.zero):
        raise ConfigError(
            f"parallel.zero_accumulate=unsharded keeps ZeRO-2/3's full gradients across micro-batches; "
            f"parallel.zero is {p.zero} (stages 0-1 keep them anyway): set parallel.zero=2 or 3, or "
            f"parallel.zero_accumulate=sharded"
        )
    if p.zero_accumulate == "unsharded" and p.offload != "none":
        raise ConfigError(
            f"parallel.zero_accumulate=unsharded keeps the full fp32 gradients on the device across "
            f"micro-batches, which undoes parallel.offload={p.offload} (it exists to free device memory): "
            f"set parallel.zero_accumulate=sharded or parallel.offload=none"
        )


def _check_run(cfg: Any) -> None:
    """The run's own keys: data files, profiling, timeouts, checkpoints, injected faults."""
    t, p = cfg.train, cfg.parallel
    if t.eval_every and t.eval_batches < 1:
        raise ConfigError(f"train.eval_batches must be ≥ 1 when train.eval_every={t.eval_every} (or set eval_every=0)")
    if cfg.data.source == "memmap" and not cfg.data.path:
        raise ConfigError("data.source=memmap needs data.path (a directory made by `python -m recipes.prepare`)")
    from .training.profiling import profile_steps  # logger.profile

    profile_steps(cfg.logger.profile, t.max_steps)
    if p.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {p.timeout_s}")
    if t.ckpt_every < 0 or t.ckpt_keep < 0:
        raise ConfigError(f"train.ckpt_every ({t.ckpt_every}) and train.ckpt_keep ({t.ckpt_keep}) must be ≥ 0")
    if t.fault is not None and not re.fullmatch(r"(raise|kill|term|kill_in_save|raise_in_save)@\d+:\d+", t.fault):
        raise ConfigError(
            f"train.fault={t.fault!r} must look like <kind>@<rank>:<step> with kind raise, kill, term, kill_in_save or raise_in_save"
        )


def validate(cfg: Any, world_size: int | None = None) -> Layout:
    """Check every relation between keys; return the resolved :class:`Layout`.

    ``world_size`` is the number of launched processes (None when the recipe will spawn its
    own: dp=auto then means 1). The layout's rules are the library's (:func:`parallel_dims`,
    :class:`parallel.dims.ParallelDims`); the rest is about the config itself. Raises :class:`ConfigError`.
    """
    resolve_aliases(cfg)
    _check_types(cfg)
    p, t = cfg.parallel, cfg.train
    dp = resolve_dp(p, world_size)
    mc = _model(cfg, p.tp)
    problem = schedule_problem(p.pp_schedule, p.pp, p.vpp, prefix="parallel.")  # the library's own rule
    if problem:
        raise ConfigError(problem)
    dims = parallel_dims(p, dp, mc, cfg.comm.compression)
    _check_moe(p, mc, cfg)
    grad_accum = _grad_accum(t, dims)
    _check_pipeline(p, mc)
    _check_zero(p, cfg.comm)
    _check_run(cfg)
    return Layout(
        dp=dp, pp=p.pp, tp=p.tp, micro_batch=t.micro_batch, grad_accum=grad_accum, model=mc, cp=p.cp, dims=dims
    )


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
