"""``python -m recipes.inspect_checkpoint <dir>``: what a checkpoint holds, and exports.

Prints the step, the layout and config it was saved with, and every tensor
(global shape, dtype, size) from the manifest and DCP's index only — no model
is built, no shard is read. ``<dir>`` may be a checkpoint, a checkpoint root
(its ``latest``) or a run directory.

Exports (one process, no torch.distributed): ``--consolidated FILE`` writes
every weight, whole, into one safetensors file under our global names;
``--hf FOLDER`` writes a Hugging Face ``model.safetensors`` (``models/hf.py``'s
names and layouts) for inference.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from parallel.checkpoint import (
    CheckpointError,
    LoadPlanner,
    SafeFileSystemReader,
    read_manifest,
    resolve_checkpoint,
    saved_tensors,
    verify_checkpoint,
)

from ..config import RecipeConfig, model_config


def describe(ckpt: Path) -> str:
    """A human-readable listing of ``ckpt`` (manifest + tensor index)."""
    manifest = verify_checkpoint(ckpt)
    tensors = saved_tensors(ckpt)
    meta = manifest["meta"]
    lay = meta.get("layout", {})
    lines = [
        f"checkpoint {ckpt}",
        f"step {manifest['step']}, saved by {manifest['world_size']} ranks",
        "layout " + " ".join(f"{k}={v}" for k, v in lay.items()),
        f"files {len(manifest['files'])}, {sum(f['bytes'] for f in manifest['files'].values()) / 2**20:.2f} MiB",
    ]
    width = max(len(k) for k in tensors)
    total = {}
    for key, (shape, dtype) in sorted(tensors.items()):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        group = key.split("/")[0]
        total[group] = total.get(group, 0) + nbytes
        lines.append(
            f"  {key:<{width}}  {str(list(shape)):<14} {str(dtype).removeprefix('torch.'):<8} "
            f"{nbytes / 2**10:10.1f} KiB"
        )
    lines.append("totals: " + ", ".join(f"{g} {b / 2**20:.2f} MiB" for g, b in sorted(total.items())))
    return "\n".join(lines)


def consolidated_weights(ckpt: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every ``model/<name>`` tensor whole, by ``<name>`` (one process reads all shards; ``verify``:
    check the sums first, unless the caller just did)."""
    if verify:
        verify_checkpoint(ckpt)
    state = {
        k: torch.empty(shape, dtype=dtype)
        for k, (shape, dtype) in saved_tensors(ckpt).items()
        if k.startswith("model/")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=LoadPlanner(), no_dist=True)
    return {k.removeprefix("model/"): v for k, v in state.items()}


def saved_model_config(ckpt: Path):
    """The :class:`models.config.ModelConfig` the checkpoint was trained with."""
    saved = read_manifest(ckpt)["meta"]["config"]
    rc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), saved))
    return model_config(rc.model)


def export_hf(ckpt: Path, folder: str | Path, verify: bool = True) -> str:
    """Write ``folder/model.safetensors`` and ``config.json`` in Hugging Face names/layouts
    (``from_pretrained(folder)`` loads it); return the weights' path."""
    from models.hf import export_hf_state_dict, hf_config_dict, save_hf_safetensors
    from models.transformer import build_model

    cfg = saved_model_config(ckpt)
    stage = build_model(cfg, device="cpu", dtype=torch.float32, seed=0)  # one process holds the whole model
    weights = consolidated_weights(ckpt, verify)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p[: weights[name].shape[0]].copy_(weights[name])  # padded vocabulary rows stay as built
    return save_hf_safetensors(export_hf_state_dict(stage), str(folder), hf_config=hf_config_dict(cfg))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.inspect_checkpoint", description=__doc__.split("\n")[0])
    ap.add_argument("path", help="a checkpoint, a checkpoint root or a run directory")
    ap.add_argument("--consolidated", metavar="FILE", help="write all weights, whole, to one safetensors file")
    ap.add_argument("--hf", metavar="FOLDER", help="write a Hugging Face model.safetensors into FOLDER")
    args = ap.parse_args(argv)
    try:
        ckpt = resolve_checkpoint(args.path)
        print(describe(ckpt))  # verifies first: a damaged checkpoint is one error line, nothing listed
        if args.consolidated:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in consolidated_weights(ckpt, False).items()}, args.consolidated)
            print(f"wrote {args.consolidated}")
        if args.hf:
            print(f"wrote {export_hf(ckpt, args.hf, verify=False)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
