"""The config's own keys and values: unknown keys refused in every form, ill-typed overrides
refused before Hydra composes, and each single key's range. Pure; raises
:class:`~recipes.config.ConfigError`. The relations between keys are :mod:`recipes.validation`'s
(and the layout's, :mod:`parallel.dims`)."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from typing import Any

from .config import ConfigError, RecipeConfig, _show, bad


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
    _number(
        "train.max_skipped_steps",
        t.max_skipped_steps,
        lo=0,
        integer=True,
        fix="inf/NaN steps in a row before the run stops, e.g. train.max_skipped_steps=10; 0 never stops",
    )
    _number("train.lock_wait_s", t.lock_wait_s, lo=0, fix="e.g. train.lock_wait_s=30 (0: do not wait)")
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
    if p.hang_s is not None:  # unset: the watchdog's own default (recipes/training/watchdog.py)
        _number(
            "parallel.hang_s",
            p.hang_s,
            lo=0,
            fix="e.g. parallel.hang_s=600; 0: no watchdog; unset: 5 × the median step, ≥ 60 s",
        )
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
