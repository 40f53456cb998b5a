"""Checks that read the machine and the files a run names, before any worker or collective.

:func:`recipes.validation.validate` checks the config's keys and their relations
(pure). :func:`preflight` checks what those keys point at: the backend against
the hardware, the run directory (writable, room for one checkpoint:
:mod:`recipes.training.storage`), the token files (header, sizes, vocabulary,
windows per split), the checkpoint to resume (exists, complete, intact, the same
model shape; ``auto``: the newest intact one, :mod:`recipes.training.resume`).
Both run in the launching process before it spawns workers, and again on every
rank under torchrun before ``init_distributed``, so a bad input is one
``error: <key>=<value>: <reason>; <fix>`` line everywhere (:class:`ConfigError`),
never a worker traceback or a hang.

The checks reuse the functions the run itself uses (``recipes.training.data.read_meta`` /
``split_tokens``, ``parallel.checkpoint``'s manifest and CRC verification):
one home per rule.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from models.config import ModelConfig
from parallel.params import init_key, vocab_rows

from ..config import ConfigError, Layout, bad


def check_backend(backend: str | None) -> None:
    """``parallel.backend=nccl`` needs CUDA and a PyTorch built with NCCL; under torchrun with NCCL
    (asked for, or the default on a CUDA machine) this node must have a GPU for each local rank."""
    import torch
    import torch.distributed as dist

    from parallel.groups import check_local_gpus, default_backend

    if (backend or default_backend()) == "nccl" and "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        try:
            check_local_gpus(
                int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
            )
        except ValueError as e:
            raise ConfigError(f"parallel.backend=nccl: {e}") from None
    if backend != "nccl":
        return

    if not torch.cuda.is_available():
        raise bad(
            "parallel.backend",
            backend,
            "this machine has no CUDA device (torch.cuda.is_available() is False)",
            "use parallel.backend=gloo, or leave it unset (nccl with CUDA, else gloo)",
        )
    if not dist.is_nccl_available():
        raise bad(
            "parallel.backend",
            backend,
            "this PyTorch build has no NCCL",
            "use parallel.backend=gloo, or a CUDA build of PyTorch",
        )


def _split(
    path: Path, split: str, meta: dict, key: str, value: Any, seq_len: int, vocab: int, packing: str = "concat"
) -> None:
    from .data import MAX_SCANNED_TOKENS, DataError, document_index, max_token, split_tokens, window_tokens

    try:
        tokens = split_tokens(path, split, meta)
    except DataError as e:
        reason, _, fix = str(e).partition("; ")
        raise bad(key, value, reason, fix or "write the data again with recipes.tools.prepare") from None
    if tokens.size < window_tokens(seq_len):
        raise bad(
            key,
            value,
            f"{path / (split + '.bin')} holds {tokens.size:,} tokens, fewer than one window "
            f"of model.seq_len {seq_len} + 1 = {window_tokens(seq_len):,}",
            "use more data (data.embedded_mb / data.val_fraction, or recipes.tools.prepare) or a smaller model.seq_len",
        )
    if tokens.size <= MAX_SCANNED_TOKENS and (top := max_token(tokens)) >= vocab:
        raise bad(
            key,
            value,
            f"{path / (split + '.bin')} holds token id {top}, ≥ model.vocab_size {vocab}",
            f"set model.vocab_size={top + 1} or more, or tokenise the data again",
        )
    if packing == "documents":
        try:
            document_index(path, split, meta, tokens.size)
        except DataError as e:
            reason, _, fix = str(e).partition("; ")
            raise bad(key, value, reason, fix) from None


def check_data(rc: Any, mc: ModelConfig) -> list[Path]:
    """The token directories the run reads (the embedded corpus is built and cached here; a
    ``data.blend`` names several): each a prepared directory with a sound header, non-empty splits
    of the recorded sizes, each holding one window of ``seq_len + 1`` tokens, ids and vocabulary
    within the model's."""
    from .blend import parse_blend
    from .data import DataError, embedded_corpus

    d = rc.data
    if d.blend:
        try:
            pairs = parse_blend(d.blend)
        except DataError as e:
            raise bad(
                "data.blend",
                d.blend,
                str(e).removeprefix("data.blend: "),
                "give pairs of weight > 0 and a prepared folder",
            ) from None
        return [_check_dir(rc, mc, "data.blend", d.blend, Path(p)) for _, p in pairs]
    if d.source == "embedded":
        key, value = "data.embedded_mb", d.embedded_mb
        try:
            path = embedded_corpus(d.embedded_mb, d.val_fraction)
        except DataError as e:
            reason, _, fix = str(e).partition("; ")
            raise bad(key, value, reason, fix or "use another data.embedded_mb") from None
        if d.embedded_mb >= type(d)().embedded_mb:  # a default-sized corpus: the window is what grew
            key, value = "model.seq_len", mc.seq_len
    else:
        key, value, path = "data.path", d.path, Path(d.path)
    return [_check_dir(rc, mc, key, value, path)]


def _check_dir(rc: Any, mc: ModelConfig, key: str, value: Any, path: Path) -> Path:
    from .data import DataError, read_meta

    try:
        meta = read_meta(path)
    except DataError as e:
        reason, _, fix = str(e).partition("; ")
        raise bad(key, value, reason, fix or "write the data again with recipes.tools.prepare") from None
    if meta["vocab_size"] > mc.vocab_size:
        raise bad(
            key,
            value,
            f"the data's vocabulary ({meta['vocab_size']:,}, meta.json) is larger than "
            f"model.vocab_size {mc.vocab_size:,}",
            f"set model.vocab_size={meta['vocab_size']}",
        )
    splits = ["train", "val"] if rc.train.eval_every else ["train"]
    for split in splits:
        _split(path, split, meta, key, value, mc.seq_len, mc.vocab_size, rc.data.packing)
    return path


def _expected_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``model/<global name>`` → global shape of every parameter (vocabulary padding cut), from
    the model built on the meta device (no memory, no communication)."""
    from models.transformer import build_model

    model = build_model(mc, device="meta")
    out = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if vocab_rows(p) is not None:
            shape = (p.vocab_size, *shape[1:])
        out["model/" + (init_key(p, name))] = shape
    return out


def check_resume(rc: Any, mc: ModelConfig, run_dir: str | Path, rank: int = 0, world: int = 1) -> Path | None:
    """``train.resume``: the checkpoint it names exists, is complete (manifest), intact (sizes of all
    files; CRC32s of every ``world``-th file from ``rank``, so ranks share the reading) and holds
    this model's parameters with this model's shapes. ``auto``: the newest intact one, each damaged
    one skipped with a warning (:mod:`recipes.training.resume`; under torchrun with several ranks
    the workers verify it together). The sums read here are not read again by the workers. Returns
    the checkpoint (None: start fresh)."""
    from parallel.checkpoint import CheckpointError, find_damage, resolve_checkpoint, saved_tensors

    from .resume import check_path, checkpoint_root, newest_intact, note_verified

    value = rc.train.resume
    fix = "give a checkpoint directory (…/checkpoints/step_N), its run directory, or train.resume=auto"
    if not value:
        return None
    try:
        if value == "auto":
            alone = world == 1  # several torchrun ranks must choose alike: the workers verify together
            warn = (lambda text: print(text, file=sys.stderr, flush=True)) if rank == 0 and alone else None
            ckpt = newest_intact(checkpoint_root(run_dir), together=False, say=warn or (lambda t: None), read=alone)
            if ckpt is None:
                return None
            if alone:
                note_verified(ckpt, hand_on=True)
        else:
            ckpt = resolve_checkpoint(check_path(value))
            problems = find_damage(ckpt, rank, world)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise bad(
                    "train.resume",
                    value,
                    f"checkpoint {ckpt} is damaged: {problems[0]}{more}",
                    "resume from an older checkpoint (its step_N directory), or delete this one and "
                    "point 'latest' at the previous (train.resume=auto skips damaged checkpoints)",
                )
            note_verified(ckpt, hand_on=True)  # every rank checked its share: the job read every byte
        saved = saved_tensors(ckpt)
    except CheckpointError as e:
        reason, _, own_fix = str(e).partition("; ")
        raise bad("train.resume", value, reason, own_fix if value == "auto" and own_fix else fix) from None
    except (OSError, EOFError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise bad("train.resume", value, f"cannot read the checkpoint ({type(e).__name__}: {e})", fix) from None
    want = _expected_shapes(mc)
    have = {k for k in saved if k.startswith("model/")}
    missing, extra = sorted(want.keys() - have), sorted(have - want.keys())
    wrong = sorted(k for k in want.keys() & have if tuple(saved[k][0]) != want[k])
    if missing or extra or wrong:
        if wrong:
            what = f"{wrong[0][6:]} is {tuple(saved[wrong[0]][0])} there but {want[wrong[0]]} in this model"
        elif missing:
            what = f"it lacks {len(missing)} of this model's parameters, e.g. {missing[0][6:]}"
        else:
            what = f"it holds {len(extra)} parameters this model lacks, e.g. {extra[0][6:]}"
        raise bad(
            "train.resume",
            value,
            f"checkpoint {ckpt} holds another model: {what}",
            "resume with the model.* keys it was saved with (its config is in checkpoint.json)",
        )
    return ckpt


def preflight(rc: Any, layout: Layout, run_dir: str | Path, rank: int = 0, world: int = 1) -> None:
    """Every check that reads the machine or files (see the module doc); raises :class:`ConfigError`.

    Call after :func:`recipes.validation.validate` (which gives ``layout``), in the launcher with
    ``rank=0, world=1`` and on each torchrun rank with its own, before any collective.
    """
    from .storage import check_space, check_writable

    check_backend(rc.parallel.backend)
    check_writable(run_dir)
    check_data(rc, layout.model)
    check_resume(rc, layout.model, run_dir, rank, world)
    check_space(rc, layout.model, run_dir, layout.world_size)
