"""Where a tensor- or expert-parallel (TP/EP) DTensor's local tensor lies in its global one.

A DTensor sharded by `Shard` or `_StridedShard` placements on some mesh dims holds on each rank
a local tensor whose indices along each split dim are a list of global indices: one run for
`Shard`, one run per segment for `_StridedShard` (transformers' packed gate/up). These index
maps place local pieces on the global tensor (checkpoints, gathers to rank 0, the RaggedShard
DTensors of TP/EP parameters) and take a rank's local tensor out of a global one (loads,
initialization). Placements that split no tensor dim (`Replicate`, a `RaggedPlacement` on the
data-parallel mesh dim) are skipped.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Shard, _StridedShard

__all__ = ["shard_dim", "sharded_mesh_dims", "local_index_maps", "local_of_global"]


def shard_dim(placement) -> int | None:
    """The tensor dim a placement cuts (`Shard` or `_StridedShard`), None for `Replicate`."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def sharded_mesh_dims(spec: DTensorSpec | None) -> tuple[int, ...]:
    """The mesh dims over which the ranks hold different pieces (not replicas)."""
    if spec is None:
        return ()
    return tuple(d for d, p in enumerate(spec.placements) if shard_dim(p) is not None)


def local_index_maps(spec: DTensorSpec, coordinate=None) -> list:
    """Per tensor dim, the global index of each index of this rank's local tensor (None where
    the dim is not split): the map that places the pieces of a TP/EP-local tensor on the
    global one. Shard gives one run at the rank's offset; `_StridedShard` (transformers'
    packed gate/up) one run per segment. torch's own offset helper, applied mesh dim by mesh
    dim from the left as DTensor shards. `coordinate`: this rank's on spec.mesh by default."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    shape = list(spec.shape)
    if coordinate is None:
        coordinate = spec.mesh.get_coordinate()
    maps: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(spec.placements):
        d = shard_dim(placement)
        if d is None:
            continue
        d %= len(shape)
        size, index = _get_shard_size_and_offsets(
            shape[d], spec.mesh.size(mesh_dim), coordinate[mesh_dim], placement,
            maps.get(d), spec.shape[d], False)
        shape[d] = size
        maps[d] = index[:size]  # an empty piece's index is a sentinel, not an index
    return [maps[d].tolist() if d in maps else None for d in range(len(shape))]


def local_of_global(full: torch.Tensor, spec: DTensorSpec | None, coordinate=None):
    """This rank's TP/EP-local tensor of the GLOBAL tensor `full` (`local_index_maps`): a view
    where each split dim is one run (Shard), a copy where it is several (`_StridedShard`);
    `full` itself for a plain or replicated parameter."""
    if spec is None:
        return full
    out = full
    for d, index in enumerate(local_index_maps(spec, coordinate)):
        if index is None:
            continue
        if not index or index == list(range(index[0], index[0] + len(index))):
            out = out.narrow(d, index[0] if index else 0, len(index))
        else:
            out = out.index_select(d, torch.tensor(index, dtype=torch.long, device=full.device))
    return out
