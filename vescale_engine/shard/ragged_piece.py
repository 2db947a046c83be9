"""A rank's ragged flat piece of a tensor as the rectangular boxes of the tensor's true shape:
the one mapping from a RaggedShard range to DCP chunks, used by a RaggedDTensor's DCP methods
(ragged_dtensor.py) and by what the engine's checkpoints write for a parameter or an optimizer
state entry with its own global shape (checkpoint/sharded.py's docstring, the optimizer state
interface); checkpoint/dcp.py writes and reads each box as one DCP chunk.

A RaggedShard range is cut by `box_decomposition` into rectangular boxes (each a contiguous flat
range, so each is a view of the local piece).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .ragged import box_decomposition, map_box

__all__ = ["RaggedPiece"]


class RaggedPiece:
    """This rank's flat range [start, start + numel) of a tensor of `shape`, as the boxes DCP
    reads and writes. Every box of `box_decomposition` covers a contiguous flat range, so each
    box is a view of `local` and loading writes straight into it.

    Under tensor/expert parallelism the range is one of a TP/EP-local tensor of `local_shape`,
    and `index_maps` (tp_maps.local_index_maps) place its boxes on the global
    `shape`: shifted by the rank's TP/EP offset, split where the local dim is not one run of
    global indices (`_StridedShard`); such a box is a strided view of `local`.

    A tensor without elements still needs one chunk in a checkpoint (else its key is missing
    at load): the piece with `writes_empty` (one rank of those holding the tensor) writes it."""

    def __init__(self, local: torch.Tensor, shape, start: int, local_shape=None,
                 index_maps=None, writes_empty=False):
        self.local = local
        self.shape = torch.Size(shape)
        self.mapped = index_maps is not None  # placed through TP/EP index maps (or identity)
        local_shape = self.shape if local_shape is None else torch.Size(local_shape)
        maps = index_maps or [None] * len(local_shape)
        self.boxes = {}  # global offsets -> (sizes, flat begin in local, local box, offsets in it)
        at = 0
        for offsets, sizes in box_decomposition(local_shape, start, start + local.numel()):
            for inner, part, global_offsets in map_box(offsets, sizes, maps):
                within = tuple(i - o for i, o in zip(inner, offsets))
                self.boxes[torch.Size(global_offsets)] = (torch.Size(part), at, sizes, within)
            at += math.prod(sizes)
        if writes_empty and self.shape.numel() == 0:
            self.boxes[torch.Size([0] * len(self.shape))] = (self.shape, 0, self.shape,
                                                             (0,) * len(self.shape))

    def chunks(self):
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, (s, *_) in self.boxes.items()]

    def write_items(self, fqn):
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(o, s),
                                                      properties=props, size=self.shape))
                for o, (s, *_) in self.boxes.items()]

    def box(self, offsets) -> torch.Tensor:
        part, at, sizes, within = self.boxes[torch.Size(offsets)]
        view = self.local[at:at + math.prod(sizes)].view(sizes)
        for d, (o, n) in enumerate(zip(within, part)):
            if n != view.shape[d]:
                view = view.narrow(d, o, n)
        return view
