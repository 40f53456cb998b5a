"""Sharded checkpoints that reshard: every rank writes its own pieces of the global tensors
through ``torch.distributed.checkpoint``; any layout reads any other's (see ``docs/checkpoint.md``)."""

from .background import BackgroundSaver
from .chunks import CheckpointError, Chunked, Placement, flat_range_boxes, to_global, tp_placement
from .faults import STORAGE_ERRNOS, CheckpointStorageError, storage_errno
from .size import checkpoint_bytes, format_bytes, free_bytes
from .store import (
    barrier,
    begin_save,
    latest_checkpoint,
    load_checkpoint,
    prune,
    publish_save,
    published,
    resolve_checkpoint,
    resume_candidates,
    save_checkpoint,
    saved_tensors,
    step_dir_name,
    write_shards,
)
from .verify import DAMAGED, agreed_damage, find_damage, mark_damaged, quick_damage, read_manifest, verify_checkpoint
from .zero_state import prepare_optimizer_state, publish, zero_state_pieces

__all__ = [
    "DAMAGED",
    "STORAGE_ERRNOS",
    "BackgroundSaver",
    "agreed_damage",
    "CheckpointError",
    "CheckpointStorageError",
    "checkpoint_bytes",
    "format_bytes",
    "free_bytes",
    "mark_damaged",
    "quick_damage",
    "resume_candidates",
    "storage_errno",
    "Chunked",
    "LoadPlanner",
    "Placement",
    "SafeFileSystemReader",
    "SavePlanner",
    "barrier",
    "begin_save",
    "find_damage",
    "flat_range_boxes",
    "latest_checkpoint",
    "load_checkpoint",
    "prepare_optimizer_state",
    "prune",
    "publish",
    "publish_save",
    "published",
    "read_dcp_metadata",
    "read_manifest",
    "resolve_checkpoint",
    "save_checkpoint",
    "saved_tensors",
    "step_dir_name",
    "to_global",
    "tp_placement",
    "verify_checkpoint",
    "write_shards",
    "zero_state_pieces",
]

_PLANNER = ("LoadPlanner", "SafeFileSystemReader", "SavePlanner", "read_dcp_metadata")


def __getattr__(name: str):
    """The DCP planners load with ``torch.distributed.checkpoint`` (~1 s of start-up) only when asked for."""
    if name in _PLANNER:
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
