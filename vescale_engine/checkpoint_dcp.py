"""A rank's ragged flat piece of a tensor as DCP chunks of the tensor's true shape.

A RaggedShard range is cut by `box_decomposition` into rectangular boxes (each a contiguous flat
range, so each is a view of the local piece); each box is one DCP chunk. The two planners
subclass DCP's default ones only to write and read those boxes.
"""
from __future__ import annotations

import collections
import math
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   StorageMeta, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .ragged import box_decomposition

__all__ = ["CheckpointError", "RaggedPiece", "SavePlanner", "LoadPlanner", "SafeReader"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (or state that cannot be saved); names file or key."""


class RaggedPiece:
    """This rank's flat range [start, start + numel) of a tensor of `shape`, as the boxes DCP
    reads and writes. Every box of `box_decomposition` covers a contiguous flat range, so each
    box is a view of `local` and loading writes straight into it."""

    def __init__(self, local: torch.Tensor, shape, start: int):
        self.local = local
        self.shape = torch.Size(shape)
        self.boxes = {}  # offsets -> (sizes, flat begin in local)
        at = 0
        for offsets, sizes in box_decomposition(self.shape, start, start + local.numel()):
            self.boxes[torch.Size(offsets)] = (torch.Size(sizes), at)
            at += math.prod(sizes)

    def chunks(self):
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, (s, _) in self.boxes.items()]

    def write_items(self, fqn):
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(o, s),
                                                      properties=props, size=self.shape))
                for o, (s, _) in self.boxes.items()]

    def box(self, offsets) -> torch.Tensor:
        sizes, at = self.boxes[torch.Size(offsets)]
        return self.local[at:at + math.prod(sizes)].view(sizes)


class SavePlanner(DefaultSavePlanner):
    """The default planner, plus RaggedPiece values written as their boxes."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [i for i in plan.items if not isinstance(self.state_dict[i.index.fqn], RaggedPiece)]
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, RaggedPiece):
                items += obj.write_items(fqn)
        self.plan = type(plan)(items, planner_data=plan.planner_data, storage_data=plan.storage_data,
                               usable=plan.usable)
        return self.plan

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        return obj.box(index.offset) if isinstance(obj, RaggedPiece) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """The default planner, plus RaggedPiece targets; never unpickles (we save no blobs)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=True)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # not the default's: its meta-tensor initialisation replaces our pieces by None
        self.state_dict = self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, RaggedPiece)}
        saved, self.state_dict = self.state_dict, plain
        plan = super().create_local_plan()
        self.state_dict = saved
        items = list(plan.items)
        for fqn, obj in saved.items():
            if isinstance(obj, RaggedPiece) and obj.boxes:
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], obj.chunks())
        return LoadPlan(items)

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        return obj.box(index.offset) if isinstance(obj, RaggedPiece) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
                              "vescale checkpoints hold tensors only and never unpickle")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles `.metadata`; this reads it with only DCP's metadata classes, torch.Size,
    dtypes and paths allowed, so a doctored file cannot run code."""

    def find_class(self, module, name):
        import pathlib

        from torch.distributed.checkpoint import filesystem, metadata
        allowed = {
            "torch.distributed.checkpoint.metadata": lambda: isinstance(
                getattr(metadata, name, None), type) and getattr(metadata, name),
            "torch.distributed.checkpoint.filesystem": lambda: name == "_StorageInfo" and
            filesystem._StorageInfo,
            "torch": lambda: (name == "Size" and torch.Size) or isinstance(
                getattr(torch, name, None), torch.dtype) and getattr(torch, name),
            "torch.serialization": lambda: name == "_get_layout" and
            torch.serialization._get_layout,
            "pathlib": lambda: name in ("PosixPath", "WindowsPath", "PurePosixPath",
                                        "PureWindowsPath") and getattr(pathlib, name),
            "collections": lambda: name == "OrderedDict" and collections.OrderedDict,
        }
        found = allowed.get(module, lambda: None)()
        if not found:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        return found


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader (tensors already come through torch.load(weights_only=True)) with a
    restricted unpickler for `.metadata`."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(self.path, ".metadata")
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{path}: not DCP metadata ({err})") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
