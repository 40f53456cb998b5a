"""How ``torch.distributed.checkpoint`` (DCP) writes and reads our pieces.

DCP already reshards: it stores each tensor as chunks with global offsets
(``ChunkStorageMetadata``) and, on load, reads the overlap of every stored
chunk with every chunk the loading rank asks for. It learns chunks from
``ShardedTensor`` / ``DTensor``; our pieces are neither (a ZeRO shard of a TP
shard is a handful of boxes, see :mod:`parallel.checkpoint.chunks`), so the two
planners below — DCP's documented extension point — take them from
:class:`Chunked` directly. Everything else (plain tensors, deduplication of
replicated chunks, the global plan, storage) is DCP's default.

:class:`SafeFileSystemReader` reads DCP's ``.metadata`` with an unpickler that
admits only DCP's metadata classes and torch's dtypes/sizes, so loading a
checkpoint never runs arbitrary pickled code (the tensors themselves DCP
already reads with ``weights_only=True``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

from .chunks import CheckpointError, Chunked  # noqa: F401 (Chunked re-exported)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, taught :class:`Chunked` (flat keys, no flattening)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            items += obj.write_items(fqn) if isinstance(obj, Chunked) else _create_write_items(fqn, obj)
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, Chunked):
            return obj.piece(write_item.index).detach()
        return super().resolve_data(write_item)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, taught :class:`Chunked`; every key must be in the checkpoint."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default would first "initialise meta tensors", replacing every object it does
        # not know (our Chunked) by None; ours are real views already
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        missing = sorted(k for k in self.state_dict if k not in saved)
        if missing:
            raise CheckpointError(
                f"the checkpoint lacks {len(missing)} tensors this model needs, e.g. "
                f"{missing[:3]}; was it saved from a different model config?"
            )
        requests = []
        for fqn, obj in self.state_dict.items():
            md = saved[fqn]
            if isinstance(obj, Chunked):
                if not isinstance(md, TensorStorageMetadata) or md.size != obj.global_shape:
                    raise CheckpointError(
                        f"{fqn!r}: checkpoint shape {tuple(getattr(md, 'size', ()))} ≠ "
                        f"model shape {tuple(obj.global_shape)}"
                    )
                requests += create_read_items_for_chunk_list(fqn, md, obj.chunks())
            else:
                if isinstance(md, TensorStorageMetadata) and md.size != obj.shape:
                    raise CheckpointError(
                        f"{fqn!r}: checkpoint shape {tuple(md.size)} ≠ model shape {tuple(obj.shape)}"
                    )
                requests += _create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def resolve_tensor(self, read_item):
        obj = self.state_dict[read_item.dest_index.fqn]
        if isinstance(obj, Chunked):
            return narrow_tensor_by_index(obj.piece(read_item.dest_index), read_item.dest_offsets, read_item.lengths)
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"{read_item.dest_index.fqn!r} is a pickled object; gridtrain checkpoints hold "
            f"tensors only and never unpickle objects"
        )


_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("builtins", "slice"),
    ("builtins", "set"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which a checkpoint never "
            f"needs; refusing to unpickle it (the file may be tampered with)"
        )


def read_dcp_metadata(path) -> Metadata:
    """DCP's ``<path>/.metadata``, unpickled with only DCP's own classes allowed."""
    with open(f"{path}/.metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}/.metadata does not hold DCP metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        metadata.storage_meta.load_id = self.load_id
        return metadata
