"""Parameters that are DTensors on a tensor- or expert-parallel mesh (TP/EP ran first).

RaggedShard shards such a parameter's *local* tensor over the data-parallel group exactly as a
plain one; what this module adds is the bookkeeping around it: the DTensor spec each sharded
parameter remembers (mesh, placements, global shape and stride), the block rule that keeps data-
parallel cuts out of a TP-split dimension, the key that keeps different TP/EP layouts out of one
buffer, and the full-shape DTensor face the module sees in forward, built over the buffer's view
without a copy or an autograd edge (as FSDP2's `_from_local_no_grad`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

__all__ = ["dtensor_spec_of", "local_tensor", "layout_key", "tp_block", "sharded_mesh_dims",
           "guard_state_dict_of_pieces",
           "dtensor_face", "LocalLeafRoute", "grad_face", "grad_in_placements", "local_index_maps",
           "global_shape", "local_of_global", "refuse_tp_ep"]


def _shard_dim(placement) -> int | None:
    """The tensor dim a placement cuts (`Shard` or `_StridedShard`), None for `Replicate`."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def dtensor_spec_of(fqn: str, param) -> DTensorSpec | None:
    """The DTensor spec of `param` (None for a plain tensor), after checking that we can shard
    it: placements are Shard, _StridedShard or Replicate. A DTensor on meta (a TP/EP plan
    applied to a meta model) is planned from its local shape; `materialize` or a checkpoint
    loader gives it this rank's values later (`local_of_global`)."""
    if not isinstance(param, DTensor):
        return None
    spec = param._spec
    for placement in spec.placements:
        if _shard_dim(placement) is None and not isinstance(placement, Replicate):
            raise ValueError(f"fully_shard: {fqn} is a DTensor with placement {placement}; "
                             "only Shard, _StridedShard and Replicate parameters can be sharded")
    empty = _rank_with_empty_piece(spec)
    if empty is not None:  # the same answer on every rank: all raise, none waits in a collective
        raise ValueError(f"fully_shard: {fqn} {list(spec.shape)} placed {spec.placements}: the "
                         f"piece of mesh coordinate {list(empty)} is empty (a dim split over "
                         "more ranks than its size allows), which cannot be sharded; use a "
                         "smaller tensor/expert-parallel size or leave this tensor replicated")
    return spec


def _rank_with_empty_piece(spec: DTensorSpec):
    """The first mesh coordinate whose local piece of a non-empty tensor is empty (torch
    chunks a dim of n over m ranks ceil(n/m) at a time, so even n >= m can leave one empty),
    None when every piece holds something. Arithmetic only: every rank gets the same answer."""
    if not sharded_mesh_dims(spec) or math.prod(spec.shape) == 0:
        return None
    for coordinate in itertools.product(*(range(n) for n in spec.mesh.shape)):
        if any(m is not None and len(m) == 0
               for m in local_index_maps(spec, list(coordinate))):
            return coordinate
    return None


def local_tensor(param) -> torch.Tensor:
    """What RaggedShard shards: a DTensor's local (TP/EP) tensor, a plain tensor itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def sharded_mesh_dims(spec: DTensorSpec | None) -> tuple[int, ...]:
    """The mesh dims over which the ranks hold different pieces (not replicas)."""
    if spec is None:
        return ()
    return tuple(d for d, p in enumerate(spec.placements) if _shard_dim(p) is not None)


def layout_key(spec: DTensorSpec | None):
    """Tensors with the same key may share a buffer: plain tensors and fully replicated
    DTensors (copies on every TP peer) together; sharded ones per (mesh, sharded mesh dims), so
    a buffer's gradient is one kind of piece for the norm's reduction."""
    dims = sharded_mesh_dims(spec)
    if not dims:
        return None
    mesh = spec.mesh
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), dims)


def tp_block(policy_block: int, local_shape, spec: DTensorSpec | None) -> int:
    """Blocks never straddle a TP cut: lcm(policy block, c) with c = prod(local_shape[d:]) for
    each tensor dim d > 0 that TP/EP splits (1 for dim 0), so a data-parallel cut falls only in
    the dims before it and the 2-D placement stays expressible (RaggedShard over dims < d,
    Shard(d))."""
    numel = math.prod(int(n) for n in local_shape)
    if spec is None or numel == 0:
        return policy_block
    ndim = len(local_shape)
    block = policy_block
    for placement in spec.placements:
        d = _shard_dim(placement)
        if d is not None and d % ndim > 0:
            block = math.lcm(block, math.prod(int(n) for n in local_shape[d % ndim:]))
    return min(block, numel)


def dtensor_face(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> nn.Parameter:
    """A full-shape DTensor Parameter whose local tensor IS `local` (a view of the all-gathered
    buffer): the original mesh and placements, the compute dtype. Not differentiable: the
    Parameter is a leaf over the buffer, nothing is copied."""
    face = DTensor(local, _with_dtype(spec, local.dtype), requires_grad=False)
    return nn.Parameter(face, requires_grad=requires_grad)


class LocalLeafRoute:
    """What `face.to_local()` returns while gradients are recorded: `leaf_of()`, a plain leaf
    Parameter over the same buffer view (its own AccumulateGrad straight into the buffer),
    instead of DTensor's differentiable view of the face.

    Why: models call `to_local()` on every expert tensor at the top of their forward
    (transformers' EP kernels, torchtitan's grouped experts). The backward node that view
    makes is then one of the oldest in the graph, and autograd runs the oldest last: each
    weight's gradient waited until every later matmul's backward had run, so all the local
    experts' gradients were alive at once beside the gathered experts. A leaf's
    AccumulateGrad runs as soon as its gradient is ready: each weight's gradient lands in
    the buffer (and is freed) before the next one is computed. The gradient is the same: a
    local view's gradient is the local piece's. `grad_placements` other than the parameter's
    (a Partial gradient), no_grad and a frozen face take DTensor's own path."""

    def __init__(self, face: nn.Parameter, leaf_of):
        self.face = face
        self.leaf_of = leaf_of

    def __call__(self, *, grad_placements=None) -> torch.Tensor:
        face = self.face
        own = grad_placements is None or tuple(grad_placements) == tuple(face.placements)
        if own and torch.is_grad_enabled() and face.requires_grad:
            return self.leaf_of()
        return DTensor.to_local(face, grad_placements=grad_placements)


def grad_in_placements(grad, spec: DTensorSpec):
    """A DTensor gradient in the parameter's placements (a Partial one is reduced over its mesh
    dim first, FSDP2's rule), so its local tensor is the gradient of this rank's local piece."""
    if not isinstance(grad, DTensor):
        raise RuntimeError(f"a DTensor parameter got a {type(grad).__name__} gradient")
    if tuple(grad.placements) != tuple(spec.placements):
        grad = grad.redistribute(spec.mesh, spec.placements)
    return grad


def grad_face(view: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """The DTensor `.grad` preset over a gradient view (the parameter's placements)."""
    return DTensor(view, _with_dtype(spec, view.dtype), requires_grad=False)


def _with_dtype(spec: DTensorSpec, dtype) -> DTensorSpec:
    meta = spec.tensor_meta
    if meta is None or meta.dtype == dtype:
        return spec
    return dataclasses.replace(spec, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))


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
        d = _shard_dim(placement)
        if d is None:
            continue
        d %= len(shape)
        size, index = _get_shard_size_and_offsets(
            shape[d], spec.mesh.size(mesh_dim), coordinate[mesh_dim], placement,
            maps.get(d), spec.shape[d], False)
        shape[d] = size
        maps[d] = index[:size]  # an empty piece's index is a sentinel, not an index
    return [maps[d].tolist() if d in maps else None for d in range(len(shape))]


def global_shape(sp) -> tuple:
    """A ShardedParameter's global shape: its DTensor's for TP/EP, else its own."""
    spec = sp.dtensor_spec
    return tuple(spec.shape) if spec is not None else tuple(sp.shape)


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


def refuse_tp_ep(params, who: str, why: str) -> None:
    """One-line error for the first of `params` (managed parameters or ShardedParameters) that
    is a TP/EP-sharded DTensor: the callers do not support them yet and would compute a wrong
    result."""
    for p in params:
        sp = getattr(p, "_vescale", p)
        if sharded_mesh_dims(getattr(sp, "dtensor_spec", None)):
            raise NotImplementedError(
                f"{who}: {sp.fqn} is a tensor/expert-parallel (TP/EP-sharded DTensor) "
                f"parameter, which {who} does not support yet ({why})")


_GUARDED = weakref.WeakSet()  # modules whose state_dict guard_state_dict_of_pieces hooked


def guard_state_dict_of_pieces(params) -> None:
    """torch's `state_dict()` (and so DCP's `get_model_state_dict`) over a TP/EP parameter of a
    fully_shard unit: between steps the module holds this rank's plain flat piece there, not
    FSDP2's 2-D DTensor, and DCP would save each rank's piece under one key as if it were the
    whole tensor (keeping one of them): refused in one line naming the parameter and what gives
    its values. (`keep_vars=True`, what our own gathers call, is let through.)"""
    for sp in params:
        if not sharded_mesh_dims(sp.dtensor_spec):
            continue
        for module, _ in sp.registrations:
            if module not in _GUARDED:
                _GUARDED.add(module)
                module.register_state_dict_pre_hook(_refuse_pieces)


def _refuse_pieces(module, prefix, keep_vars) -> None:
    if keep_vars:
        return
    for value in module._parameters.values():
        sp = value.__dict__.get("_vescale") if isinstance(value, torch.Tensor) else None
        if sp is not None and value is sp.sharded and sharded_mesh_dims(sp.dtensor_spec):
            raise NotImplementedError(
                f"state_dict: {sp.fqn} is a tensor/expert-parallel parameter, which between "
                "steps is this rank's flat piece under fully_shard, not FSDP2's 2-D DTensor: "
                "torch's state_dict and DCP would save the pieces as whole tensors; use "
                "vescale_engine.full_state_dict(model) (the global tensors)")
