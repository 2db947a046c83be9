"""Parameters that are DTensors on a tensor- or expert-parallel mesh (TP/EP ran first).

RaggedShard shards such a parameter's *local* tensor over the data-parallel group exactly as a
plain one; what this module adds is the bookkeeping around it: the DTensor spec each sharded
parameter remembers (mesh, placements, global shape and stride), the block rule that keeps data-
parallel cuts out of a TP-split dimension, the key that keeps different TP/EP layouts out of one
buffer, the full-shape DTensor face the module sees in forward, built over the buffer's view
without a copy or an autograd edge (as FSDP2's `_from_local_no_grad`), and the 2-D mesh its
sharded face (a RaggedDTensor) lives on between steps. Where the local tensor lies in the
global one: shard/tp_maps.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Replicate

from ..shard.tp_maps import local_index_maps, local_of_global, shard_dim, sharded_mesh_dims

__all__ = ["dtensor_spec_of", "local_tensor", "layout_key", "tp_block", "sharded_mesh_dims",
           "face_mesh",
           "dtensor_face", "LocalLeafRoute", "grad_face", "grad_in_placements", "local_index_maps",
           "global_shape", "local_of_global", "refuse_tp_ep"]




def dtensor_spec_of(fqn: str, param) -> DTensorSpec | None:
    """The DTensor spec of `param` (None for a plain tensor), after checking that we can shard
    it: placements are Shard, _StridedShard or Replicate. A DTensor on meta (a TP/EP plan
    applied to a meta model) is planned from its local shape; `materialize` or a checkpoint
    loader gives it this rank's values later (`local_of_global`)."""
    if not isinstance(param, DTensor):
        return None
    spec = param._spec
    for placement in spec.placements:
        if shard_dim(placement) is None and not isinstance(placement, Replicate):
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
        d = shard_dim(placement)
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




def global_shape(sp) -> tuple:
    """A ShardedParameter's global shape: its DTensor's for TP/EP, else its own."""
    spec = sp.dtensor_spec
    return tuple(spec.shape) if spec is not None else tuple(sp.shape)




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


_FACE_MESHES: dict = {}


def face_mesh(shard_mesh, spec: DTensorSpec, fqn: str):
    """The N-D mesh a TP/EP parameter's sharded face lives on: fully_shard's mesh (the shard
    dim, or HSDP's replicate and shard dims) followed by its TP/EP mesh's, as FSDP2's
    (`DeviceMesh._concatenate`, which wants both sliced from one mesh), made once per pair.
    Refused in one line, before any collective, where fully_shard got no DeviceMesh (a process
    group, or none) or one of another mesh."""
    if shard_mesh is None:
        raise ValueError(
            f"fully_shard: {fqn} is a DTensor on the mesh {spec.mesh}; pass mesh= the "
            "data-parallel DeviceMesh sliced from the same mesh (e.g. world_mesh['dp']), as "
            "FSDP2 requires: its sharded parameter is a DTensor on both meshes")
    key = (shard_mesh, spec.mesh)
    if key not in _FACE_MESHES:
        try:
            _FACE_MESHES[key] = DeviceMesh._concatenate([shard_mesh, spec.mesh])
        except (RuntimeError, TypeError, AttributeError) as err:  # (no dim names: TypeError)
            raise RuntimeError(f"fully_shard: {fqn} is a DTensor on {spec.mesh}, which cannot "
                               f"be joined to the data-parallel mesh {shard_mesh} ({err}); "
                               "slice both from one DeviceMesh with named dims, as FSDP2 "
                               "requires") from err
    return _FACE_MESHES[key]
