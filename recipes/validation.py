"""The up-front validation of a recipe configuration (the schema is in :mod:`recipes.config`).

:func:`validate` checks the *relations* between keys (batch arithmetic, the layout
against world size) and raises :class:`~recipes.config.ConfigError` naming the
numbers and the fix. The layout's own rules are the library's: :func:`parallel_dims`
builds the :class:`parallel.dims.ParallelDims` of the config, so a library user gets
the same refusals. It is pure and runs on every rank before any collective, so a bad
configuration is an error everywhere, never a hang. Also here: the ``CHOICES`` table,
``dp=auto`` and alias resolution; single keys, unknown keys and ill-typed overrides
are :mod:`recipes.keys`'s (re-exported here).
"""

from __future__ import annotations

import re
from typing import Any

from parallel.compile import COMPILE_BACKENDS
from parallel.dims import (
    CP_IMPLS,
    OFFLOAD_MODES,
    LayoutError,
    ParallelDims,
    accumulate_problem,
    interleaved_problem,
    offload_problem,
    topk_ratio_problem,
)
from parallel.layers.moe import (
    CONTEXT_PARALLEL_CAPACITY_REFUSED,
    CONTEXT_PARALLEL_SEQ_AUX_REFUSED,
    SEQUENCE_PARALLEL_CAPACITY_REFUSED,
    MoEConfigError,
)
from parallel.pipeline.schedules import SCHEDULES, schedule_problem, zero_bubble_problem
from parallel.precision import FP8_RECIPES, PRECISIONS, TRAIN_PRECISIONS
from parallel.zero.compression import COMPRESSIONS
from parallel.zero.policy import ZERO_STAGES
from parallel.zero.theory import ZERO_ACCUMULATE, accumulate_applies  # noqa: F401 (re-exported)

from .config import ConfigError, Layout, ParallelConfig, _show, bad, model_config
from .feature_checks import check_fp8, check_packing
from .keys import check_keys, check_overrides, check_values, key_error, schema_keys, unknown_keys
from .training.checkpointing import CKPT_ON_ERROR
from .training.packing import PACKINGS
from .training.runlog import LR_SCHEDULES
from .training.sampling import SAMPLINGS

# The typed choices of the config, each tuple imported from where the library defines the names.
# OmegaConf 2.3's structured configs refuse ``Literal`` annotations ("Unexpected type annotation"),
# so the fields stay ``str``/``int`` and this table is the one place they are validated
# (:func:`check_values`, for every mode).
CHOICES = {
    "mode": ("train", "plan", "recommend", "dryrun", "calibrate"),
    "parallel.pp_schedule": SCHEDULES,
    "train.precision": TRAIN_PRECISIONS,
    "train.fp8_recipe": FP8_RECIPES,
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": LR_SCHEDULES,
    "comm.compression": COMPRESSIONS,
    "comm.dtype": (None, *PRECISIONS),
    "data.source": ("embedded", "memmap"),
    "data.sampling": ("auto", *SAMPLINGS),
    "data.packing": PACKINGS,
    "logger.wandb": ("disabled", "offline", "online"),
    "parallel.zero": ZERO_STAGES,
    "parallel.offload": OFFLOAD_MODES,
    "parallel.zero_accumulate": ZERO_ACCUMULATE,
    "parallel.zero3_accumulate": (None, *ZERO_ACCUMULATE),
    "parallel.backend": (None, "nccl", "gloo"),
    "parallel.cp_impl": CP_IMPLS,
    "train.ckpt_on_error": CKPT_ON_ERROR,
    "train.compile_backend": COMPILE_BACKENDS,
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


# the recipe key of each ParallelDims field a LayoutError names
DIMS_KEYS = {
    "dp": "parallel.dp",
    "pp": "parallel.pp",
    "tp": "parallel.tp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "vpp": "parallel.vpp",
    "zero": "parallel.zero",
    "accumulate": "parallel.zero_accumulate",
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
            accumulate=p.zero_accumulate,
            cp_impl=p.cp_impl,
            sequence_parallel=bool(p.sequence_parallel),
            offload=p.offload,
            schedule=p.pp_schedule,
            vpp=p.vpp,
            compression=compression,
            seq_len=mc.seq_len,
            n_heads=mc.n_heads,
            n_kv_heads=mc.n_heads if mc.mla else mc.n_kv_heads,  # MLA's k carries every head
            n_layers=mc.n_layers,
            d_ff=mc.d_ff,
            moe_experts=mc.moe_experts,
        )
    except LayoutError as e:
        keys = ", ".join(
            f"{DIMS_KEYS[k]}={str(v).lower() if isinstance(v, bool) else _show(v)}" for k, v in e.values.items()
        )
        raise ConfigError(f"{keys}: {e}" if keys else str(e)) from None


def _check_moe(p: Any, dims: ParallelDims, mc: Any, cfg: Any) -> None:
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
        f"parallel.offload={p.offload}": p.offload != "none",
        "parallel.pp_schedule=zb-h1": p.pp_schedule == "zb-h1",
    }
    if dims.cp_enabled and mc.moe_capacity_factor is not None:
        raise ConfigError(
            f"parallel.cp={p.cp}, model.moe_capacity_factor={mc.moe_capacity_factor}: {CONTEXT_PARALLEL_CAPACITY_REFUSED}"
        )
    if dims.cp_enabled and mc.moe_seq_aux_loss_weight:
        raise ConfigError(
            f"parallel.cp={p.cp}, model.moe_seq_aux_loss_weight={mc.moe_seq_aux_loss_weight}: "
            f"{CONTEXT_PARALLEL_SEQ_AUX_REFUSED}"
        )
    if dims.sp_enabled and mc.moe_capacity_factor is not None:
        raise ConfigError(
            f"parallel.sequence_parallel=true, model.moe_capacity_factor={mc.moe_capacity_factor}: "
            f"{SEQUENCE_PARALLEL_CAPACITY_REFUSED}"
        )
    for what, on in unverified.items():
        if on:
            raise ConfigError(
                f"an MoE model (model.moe_experts={mc.moe_experts}) with {what}: this combination is not "
                "implemented/verified against one process; turn it off (MoE trains with dp, ep, tp with or without "
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
    problem = zero_bubble_problem(p.pp_schedule, mc.activation_checkpointing, p.zero)
    if problem:
        raise ConfigError(problem)
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
    """Top-K's ratio; unsharded accumulation against offload (the stage rules: :func:`validate`)."""
    if topk_ratio_problem(comm.topk_ratio):
        raise ConfigError(f"comm.{topk_ratio_problem(comm.topk_ratio)}")
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
    if cfg.data.blend and cfg.data.path:
        raise ConfigError("data.blend names its corpora itself: leave data.path unset (or drop data.blend)")
    if cfg.data.source == "memmap" and not cfg.data.path and not cfg.data.blend:
        raise ConfigError("data.source=memmap needs data.path (a directory made by `python -m recipes.prepare`)")
    check_packing(cfg)
    from .training.profiling import profile_steps  # logger.profile

    profile_steps(cfg.logger.profile, t.max_steps)
    if p.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {p.timeout_s}")
    if t.ckpt_every < 0 or t.ckpt_keep < 0:
        raise ConfigError(f"train.ckpt_every ({t.ckpt_every}) and train.ckpt_keep ({t.ckpt_keep}) must be ≥ 0")
    from .training.drills import FAULT_KINDS

    if t.fault is not None and not re.fullmatch(rf"({'|'.join(FAULT_KINDS)})@\d+:\d+", t.fault):
        raise ConfigError(
            f"train.fault={t.fault!r} must look like <kind>@<rank>:<step> with kind {', '.join(FAULT_KINDS[:-1])} or {FAULT_KINDS[-1]}"
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
    # the library's rules that name their keys: asked with the config's section first
    problem = (
        schedule_problem(p.pp_schedule, p.pp, p.vpp, prefix="parallel.")
        or offload_problem(p.offload, p.zero, prefix="parallel.")
        or accumulate_problem(p.zero_accumulate, p.zero, key="parallel.zero_accumulate", stage_key="parallel.zero")
    )
    if problem:
        raise ConfigError(problem)
    dims = parallel_dims(p, dp, mc, cfg.comm.compression)
    _check_moe(p, dims, mc, cfg)
    grad_accum = _grad_accum(t, dims)
    _check_pipeline(p, mc)
    _check_zero(p, cfg.comm)
    check_fp8(cfg, dims)
    _check_run(cfg)
    if cfg.model.target:  # your own model: the features it does not get, its builder run on meta
        from .training.target_model import check_target

        check_target(cfg, mc)
    return Layout(
        dp=dp, pp=p.pp, tp=p.tp, micro_batch=t.micro_batch, grad_accum=grad_accum, model=mc, cp=p.cp, dims=dims
    )


__all__ = [
    "CHOICES",
    "check_keys",
    "check_overrides",
    "check_values",
    "key_error",
    "parallel_dims",
    "resolve_aliases",
    "resolve_dp",
    "schema_keys",
    "unknown_keys",
    "validate",
]
