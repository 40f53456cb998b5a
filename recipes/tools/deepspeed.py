"""Map a DeepSpeed-style JSON config onto a gridtrain recipe config.

``python -m recipes.gpt_tiny deepspeed=ds_config.json`` reads the file and
sets the recipe keys below; a key gridtrain cannot honour is an error that
lists it (nothing is silently ignored), and DeepSpeed's batch identity
``train_batch_size = micro_batch × gradient_accumulation_steps × dp`` is
checked with the numbers.

=========================================  ==================================
DeepSpeed key                               recipe key
=========================================  ==================================
train_batch_size                            train.global_batch
train_micro_batch_size_per_gpu              train.micro_batch
gradient_accumulation_steps                 (checked against the two above)
gradient_clipping                           train.grad_clip
steps_per_print                             train.log_every
optimizer.type (Adam, AdamW, SGD)           optim.name
optimizer.params.lr/betas/eps/weight_decay  optim.*
scheduler.params.warmup_num_steps           optim.warmup_steps
zero_optimization.stage                     parallel.zero
zero_optimization.overlap_comm              comm.overlap
zero_optimization.reduce_bucket_size        comm.bucket_mb (elements × 4 B)
zero_optimization.offload_optimizer.device  parallel.offload: cpu → optimizer
zero_optimization.offload_param.device      cpu (with offload_optimizer cpu) → optimizer+params
communication_data_type                     comm.dtype
fp16.enabled / bf16.enabled                 train.precision
=========================================  ==================================
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import ConfigError, bad

_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
_OPTIMS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}
# keys that only tune DeepSpeed internals and change nothing gridtrain computes
_HARMLESS = {
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.reduce_scatter",
    "zero_optimization.allgather_partitions",
    "fp16.loss_scale_window",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
    "fp16.initial_scale_power",
    "fp16.loss_scale",
    "scheduler.type",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.total_num_steps",
    "optimizer.params.torch_adam",
    "optimizer.params.adam_w_mode",
    # offload tuning: gridtrain pins host buffers whenever the device is a GPU and sizes its own copies
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.fast_init",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu",
}
_OFFLOAD_DEVICE = "zero_optimization.offload_{}.device"


def _offload_mode(flat: dict, unknown: list[str]) -> str | None:
    """parallel.offload from DeepSpeed's ``offload_optimizer``/``offload_param`` devices (None: not set)."""
    devices = {}
    for what in ("optimizer", "param"):
        key = _OFFLOAD_DEVICE.format(what)
        v = str(flat.get(key, "none")).lower()
        if v not in ("none", "cpu"):
            unknown.append(f"{key}={flat[key]!r} (supported: cpu, none; NVMe offload is not implemented)")
        devices[what] = v == "cpu"
    if devices["param"] and not devices["optimizer"]:
        unknown.append(
            f"{_OFFLOAD_DEVICE.format('param')}='cpu' without {_OFFLOAD_DEVICE.format('optimizer')}='cpu' "
            "(gridtrain offloads parameters only together with the optimizer: set both)"
        )
    if not any(_OFFLOAD_DEVICE.format(w) in flat for w in ("optimizer", "param")):
        return None
    return "optimizer+params" if devices["param"] else "optimizer" if devices["optimizer"] else "none"


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("betas",):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def deepspeed_overrides(ds: dict, dp: int) -> dict[str, Any]:
    """The recipe keys (dotted) that a DeepSpeed config dict sets, for a given dp.

    Raises :class:`ConfigError` for keys it cannot honour or an inconsistent batch.
    """
    flat = _flatten(ds)
    autos = [k for k, v in flat.items() if v == "auto"]
    if autos:
        raise ConfigError(
            "DeepSpeed config values 'auto' (filled in by the Hugging Face Trainer) cannot be honoured: "
            + ", ".join(autos)
            + "; write the numbers, or leave the keys out and set the recipe keys"
        )
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for key, v in flat.items():
        if key == "train_batch_size":
            out["train.global_batch"] = int(v)
        elif key == "train_micro_batch_size_per_gpu":
            out["train.micro_batch"] = int(v)
        elif key == "gradient_accumulation_steps":
            pass  # checked below
        elif key == "gradient_clipping":
            out["train.grad_clip"] = float(v)
        elif key == "steps_per_print":
            out["train.log_every"] = int(v)
        elif key == "optimizer.type":
            if str(v).lower() not in _OPTIMS:
                unknown.append(f"{key}={v!r} (supported: Adam, AdamW, SGD)")
            else:
                out["optim.name"] = _OPTIMS[str(v).lower()]
        elif key in ("optimizer.params.lr", "optimizer.params.eps", "optimizer.params.weight_decay"):
            out["optim." + key.rsplit(".", 1)[1]] = float(v)
        elif key == "optimizer.params.betas":
            out["optim.betas"] = [float(b) for b in v]
        elif key == "scheduler.params.warmup_num_steps":
            out["optim.warmup_steps"] = int(v)
        elif key == "zero_optimization.stage":
            out["parallel.zero"] = int(v)
        elif key == "zero_optimization.overlap_comm":
            out["comm.overlap"] = bool(v)
        elif key == "zero_optimization.reduce_bucket_size":
            out["comm.bucket_mb"] = float(v) * 4 / 2**20
        elif key in (_OFFLOAD_DEVICE.format("optimizer"), _OFFLOAD_DEVICE.format("param")):
            pass  # mapped below, together
        elif key == "communication_data_type":
            if str(v).lower() not in _DTYPES:
                unknown.append(f"{key}={v!r} (supported: fp32, fp16, bf16)")
            else:
                out["comm.dtype"] = _DTYPES[str(v).lower()]
        elif key in ("fp16.enabled", "bf16.enabled"):
            if v:
                out["train.precision"] = key.split(".")[0]
        elif key not in _HARMLESS:
            unknown.append(f"{key}={v!r}")
    offload = _offload_mode(flat, unknown)
    if offload is not None:
        out["parallel.offload"] = offload
    if flat.get("fp16.enabled") and flat.get("bf16.enabled"):
        raise ConfigError("DeepSpeed config enables both fp16 and bf16; choose one")
    if unknown:
        raise ConfigError(
            "DeepSpeed config keys gridtrain cannot honour: "
            + "; ".join(unknown)
            + ". Remove them or set the equivalent recipe keys (see recipes/tools/deepspeed.py)."
        )
    gb, mb = out.get("train.global_batch"), out.get("train.micro_batch")
    ga = flat.get("gradient_accumulation_steps")
    if gb is not None and mb is not None and ga is not None and gb != mb * int(ga) * dp:
        raise ConfigError(
            f"DeepSpeed train_batch_size {gb} ≠ train_micro_batch_size_per_gpu {mb} × "
            f"gradient_accumulation_steps {ga} × dp {dp} = {mb * int(ga) * dp}"
        )
    if gb is None and mb is not None and ga is not None:
        out["train.global_batch"] = mb * int(ga) * dp
    if gb is not None and mb is None and ga is not None:
        if gb % (int(ga) * dp):
            raise ConfigError(
                f"DeepSpeed train_batch_size {gb} is not divisible by gradient_accumulation_steps {ga} × dp {dp}"
            )
        out["train.micro_batch"] = gb // (int(ga) * dp)
    return out


def load_deepspeed_json(path: str | Path, dp: int) -> dict[str, Any]:
    """The recipe keys a DeepSpeed JSON file sets; :class:`ConfigError` (naming ``deepspeed=``)
    if the path is not a readable file holding one JSON object."""
    path = Path(path)
    fix = "give the path of a DeepSpeed JSON file (e.g. deepspeed=examples/ds_config.json)"
    if not path.exists():
        raise bad("deepspeed", path, "no such file", fix)
    if path.is_dir():
        raise bad("deepspeed", path, "a directory, not a file", fix)
    try:
        ds = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise bad("deepspeed", path, f"cannot be read ({type(e).__name__}: {e})", fix) from None
    except json.JSONDecodeError as e:
        raise bad("deepspeed", path, f"not valid JSON ({e})", "fix the file") from None
    if not isinstance(ds, dict):
        raise bad("deepspeed", path, f"holds a JSON {type(ds).__name__}, not an object", 'write {"key": value, ...}')
    try:
        return deepspeed_overrides(ds, dp)
    except ConfigError as e:
        raise ConfigError(f"deepspeed={path}: {e}") from None


def apply_deepspeed(rc, path: str | Path, dp: int) -> dict[str, Any]:
    """Set the recipe keys a DeepSpeed JSON file names on ``rc`` (in place); return them."""
    overrides = load_deepspeed_json(path, dp)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(rc, section), name, value)
    return overrides
