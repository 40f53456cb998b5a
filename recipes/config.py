"""The typed recipe configuration: the schema every key a user types belongs to.

Every key a user types (``parallel.tp=2``, ``train.global_batch=64`` ...) is a
field of one of the dataclasses below; Hydra refuses unknown keys because the
schema is structured. This module holds the schema (the ``*Config`` /
``*Section`` dataclasses and :class:`RecipeConfig`), the resolved
:class:`Layout`, :func:`model_config`, and the one error type
(:class:`ConfigError`, built by :func:`bad`).

The checks live in :mod:`recipes.validation` (:func:`validate`, the ``CHOICES``
table, unknown-key and override checks); they are re-exported here, so
``from recipes.config import validate`` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from models.config import PRESETS, ModelConfig
from parallel.dims import ParallelDims


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
    ep: int = 1  # expert parallel (MoE models): splits dp, experts sharded over it (docs/moe.md)
    mp: Optional[int] = None  # alias of tp (Megatron's "model parallel" size)
    sequence_parallel: bool = False
    cp: int = 1  # context parallel: ranks that split each sequence (docs/cp.md)
    cp_impl: str = "ring"  # ring | alltoall (Ulysses: heads divisible by cp·tp)
    zero: int = 0  # 0-3
    offload: str = "none"  # none | optimizer (zero ≥ 1) | optimizer+params (zero=3): docs/offload.md
    zero_accumulate: str = "sharded"  # sharded | unsharded: ZeRO-2/3 keep full fp32 grads, 1 reduce-scatter/step
    zero3_accumulate: Optional[str] = None  # the old name of zero_accumulate (stage 3 only then): an alias
    pp_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved | zb-h1 (zero bubble)
    vpp: int = 1  # virtual stages per rank (interleaved)
    pp_layers: Optional[List[int]] = None  # explicit layers per stage
    order: str = "tp-dp-pp"  # rank order, fastest axis first
    gpus_per_node: int = 8  # for describe() and the planner
    timeout_s: float = 600.0  # every collective fails after this instead of hanging
    # a step with no progress for this long: dump the flight recorder, name the rank, end the job
    # (recipes/training/watchdog.py), from the run's second step. None: max(60 s, 5 × the median step); 0: off
    hang_s: Optional[float] = None
    backend: Optional[str] = None  # nccl | gloo; default: nccl with CUDA, else gloo
    oversubscribe: bool = False  # self-spawn more local workers than launch.local.local_capacity allows


@dataclass
class TrainConfig:
    global_batch: int = 32  # sequences per optimizer step, whatever the layout
    micro_batch: int = 4  # sequences per micro-batch per DP rank
    max_steps: int = 200
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8 (a bf16 run, its TP linears' GEMMs in fp8: docs/precision.md)
    fp8_recipe: str = "tensorwise"  # precision=fp8: tensorwise (e4m3/e5m2, a scale per tensor) | rowwise
    fp8_emulate: bool = False  # precision=fp8 without fp8 kernels (CPU, pre-Ada GPU): fp8 casts, fp32 matmul
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
    ckpt_async: bool = True  # stage to host memory, write in a background thread (docs/checkpoint.md)
    ckpt_on_error: str = "stop"  # a save the storage refuses (disk full, read-only): stop | continue without it
    fault: Optional[str] = None  # fault drill: "<kind>@<rank>:<step>" (kinds: recipes/training/drills.py)
    threads: int = 0  # intra-op threads per rank on CPU; 0: cores / local ranks
    # run faults (issue 28): divergence, the run lock (recipes/training/divergence.py, runlock.py)
    max_skipped_steps: int = 10  # more inf/NaN steps in a row than this: stop, exit 3 (0: never stop)
    lock_wait_s: float = 30.0  # a dead launcher's workers still running: wait this long for them to end
    # torch.compile (issue 30, docs/compile.md): each transformer block and the loss compiled, as torchtitan does
    compile: bool = False  # off until proven on a GPU; the executor, ZeRO and the schedules stay eager
    compile_backend: str = "inductor"  # inductor | aot_eager | eager (parallel.compile.COMPILE_BACKENDS)


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
    path: Optional[str] = None  # memmap: a directory recipes.prepare wrote (shards, index, meta.json)
    val_fraction: float = 0.05  # embedded corpus held out for validation
    embedded_mb: float = 4.0  # size of the embedded corpus
    blend: Optional[str] = None  # "0.7 data/a 0.3 data/b": prepared corpora mixed by weight (instead of source/path)
    sampling: str = "auto"  # epoch (each window once per epoch) | random | auto: epoch for memmap, else random
    # concat: windows read straight across documents | documents: document-causal attention, positions restart
    # at each document (needs the document index recipes.prepare writes)
    packing: str = "concat"


@dataclass
class LoggerConfig:
    progress: bool = True  # rank-0 progress bar
    wandb: str = "disabled"  # disabled | offline | online
    project: str = "gridtrain"
    peak_tflops: Optional[float] = None  # for MFU; default: measured (CPU) or device table
    timeline: bool = False  # record step 2 on every stage; write timeline.png (the pipeline's bubble)
    profile: Optional[list[int]] = None  # [first, last] step: torch.profiler traces (recipes/training/profiling.py)
    memory_snapshot: bool = False  # CUDA: record allocations; an out-of-memory error writes <run>/memory/rank<r>.pickle


@dataclass
class ModelSection:
    """``model.*`` keys: a named size (``preset``) and any field of
    :class:`models.config.ModelConfig` to change (None keeps the preset's)."""

    preset: str = "gpt_tiny"
    arch: Optional[str] = None
    # your own model: <module>:<function> returning parallel.pieces.ModelPieces (recipes/training/target_model.py)
    target: Optional[str] = None
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
    moe_experts: Optional[int] = None  # mixture of experts (docs/moe.md); 0: dense
    moe_top_k: Optional[int] = None
    moe_every: Optional[int] = None
    moe_d_ff: Optional[int] = None
    moe_shared_experts: Optional[int] = None
    moe_capacity_factor: Optional[float] = None
    moe_aux_loss_weight: Optional[float] = None
    moe_z_loss_weight: Optional[float] = None
    moe_first_dense: Optional[int] = None
    moe_normalize_top_k: Optional[bool] = None
    attn_head_dim: Optional[int] = None  # Llama 3.1+, Qwen2/3 (models/config.py)
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    mlp_bias: Optional[bool] = None
    qk_norm: Optional[bool] = None
    rope_type: Optional[str] = None
    rope_factor: Optional[float] = None
    rope_low_freq_factor: Optional[float] = None
    rope_high_freq_factor: Optional[float] = None
    rope_original_max_position: Optional[int] = None
    rope_beta_fast: Optional[float] = None  # YaRN (models/config.py)
    rope_beta_slow: Optional[float] = None
    rope_mscale: Optional[float] = None
    rope_mscale_all_dim: Optional[float] = None
    rope_attention_factor: Optional[float] = None
    rope_truncate: Optional[bool] = None
    kv_lora_rank: Optional[int] = None  # DeepSeek-V3's multi-head latent attention when > 0 (models/config.py)
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    rope_interleave: Optional[bool] = None
    moe_score: Optional[str] = None  # softmax | sigmoid (DeepSeek-V3's router)
    moe_groups: Optional[int] = None
    moe_topk_groups: Optional[int] = None
    moe_routed_scale: Optional[float] = None
    moe_bias_update_rate: Optional[float] = None  # aux-loss-free balancing's step per optimizer step
    moe_seq_aux_loss_weight: Optional[float] = None


#: ``model.*`` keys that are not fields of :class:`ModelConfig`
NOT_MODEL_FIELDS = ("preset", "target")


def model_config(section: Any) -> ModelConfig:
    """The :class:`ModelConfig` a ``model`` section describes (preset + changed fields)."""
    if section.preset not in PRESETS:
        raise ConfigError(f"model.preset={section.preset!r} is not one of {sorted(PRESETS)}")
    changes = {k: getattr(section, k) for k in vars(ModelSection()) if k not in NOT_MODEL_FIELDS}
    return PRESETS[section.preset].replace(**{k: v for k, v in changes.items() if v is not None})


# --- planner keys (added by the planner branch; see docs/planner.md) -------------
@dataclass
class PlanSection:
    """``plan.*`` keys for ``mode=plan`` / ``mode=recommend``; None keeps the profile's value."""

    hardware: str = "a100_80gb"  # a100_80gb | h100_80gb | h200 | cpu | a name under profiles | a .json file
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
    """``dryrun.*`` keys for ``mode=dryrun`` (see recipes/tools/dryrun.py)."""

    # None: the first rank, a middle stage's rank, the last rank; a list of ranks; or "classes": one rank
    # of every (stage, tp, cp, expert) class at the first and last DP replica, every group cross-checked
    ranks: Optional[Any] = None
    peers: bool = False  # also run each rank's TP, DP and PP neighbours and check their call sequences
    jobs: int = 2  # ranks run at once (one process each)


@dataclass
class RecipeConfig:
    mode: str = "train"  # train | plan | recommend | dryrun | calibrate
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


@dataclass(frozen=True)
class Layout:
    """The resolved layout and batch arithmetic of a run."""

    dp: int
    pp: int
    tp: int
    micro_batch: int
    grad_accum: int  # micro-batches per DP rank per step
    model: ModelConfig
    cp: int = 1  # context parallel ranks per sequence
    dims: ParallelDims | None = None  # the resolved layout (parallel.dims): what is on, local shapes, groups

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp


# The checks live in recipes.validation (which imports this module's dataclasses); every name stays
# importable from here through a lazy re-export, so importing either module first has no cycle.
_VALIDATION_NAMES = frozenset(
    {
        "CHOICES",
        "check_keys",
        "check_overrides",
        "check_values",
        "key_error",
        "resolve_aliases",
        "resolve_dp",
        "schema_keys",
        "unknown_keys",
        "validate",
    }
)


def __getattr__(name: str) -> Any:
    if name in _VALIDATION_NAMES:
        from . import validation

        return getattr(validation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _VALIDATION_NAMES)
