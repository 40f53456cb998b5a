"""Sharded checkpoints that reshard: every rank writes its own pieces of the global tensors
through ``torch.distributed.checkpoint``; any layout reads any other's (see ``docs/checkpoint.md``)."""

from .background import BackgroundSaver
from .chunks import CheckpointError, Placement, flat_range_boxes, to_global, tp_placement
from .planner import Chunked, LoadPlanner, SafeFileSystemReader, SavePlanner, read_dcp_metadata
from .store import (
    barrier,
    begin_save,
    find_damage,
    latest_checkpoint,
    load_checkpoint,
    prune,
    publish_save,
    published,
    read_manifest,
    resolve_checkpoint,
    save_checkpoint,
    saved_tensors,
    step_dir_name,
    verify_checkpoint,
    write_shards,
)
from .zero_state import prepare_optimizer_state, publish, zero_state_pieces

__all__ = [
    "BackgroundSaver",
    "CheckpointError",
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
