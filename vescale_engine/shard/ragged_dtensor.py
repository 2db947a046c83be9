"""RaggedDTensor: a RaggedShard-sharded tensor as a DTensor of its global shape.

What it is. `ragged_dtensor(local, layout, mesh)` wraps this rank's flat piece of a tensor
(`local`: 1-D, `layout.local_numel(rank)` elements, in practice a view of a DBuffer's master or
gradient shard) as a `torch.distributed.tensor.DTensor` subclass with the tensor's global
shape, the 1-D mesh of the shard group and one placement, `RaggedPlacement(block,
local_units)` (ragged_placement.py). `_local_tensor` *is* `local` (the same object: no copy)
and `to_local()` returns it; gradients and optimizer state made from it (`zeros_like`,
element-wise results) are RaggedDTensors of the same layout, so torch optimizers' foreach and
fused kernels run once on the local tensors. `isinstance(t, DTensor)` holds, which is what
torch's state-dict utilities and DCP check.

What works (ragged_ops.py has the rules): element-wise ops, `_foreach_*` and fused
Adam/AdamW/SGD/Adagrad between tensors of one layout, with scalars and 0-d tensors; reductions
over every element (vector norms, `_foreach_norm`, sum, mean, amax/amin, all/any) and over
some dims (vector norms, sum, mean, amax/amin: a row norm) all-reduced over the mesh at once
and returned as Replicate DTensors, so `clip_grad_norm_` and `.item()` give global values; `full_tensor()` and `redistribute(mesh, [Replicate()])` (our gather,
`ragged_to_replicate`; full_tensor is differentiable); `redistribute` to another
RaggedPlacement (`ragged_to_ragged`); `to_local()`, `placements`, `device_mesh`; views that
keep the flat order (view, reshape, flatten); `copy_` from a whole plain tensor (so
`nn.Module.load_state_dict` of full tensors works); torch.save and deepcopy; DCP's
`__create_write_items__` / `__create_chunk_list__` / `__get_tensor_shard__`, where this rank's
range is the boxes of `box_decomposition` (at most 2 * ndim - 1), each a view of the local
tensor, so a load writes straight into it, in any other layout; `get_model_state_dict`, full
or sharded; in-place random fills (nn.init), drawn at full shape so the values are an
unsharded tensor's. `distribute_ragged` and `fill_from_full` are what torch's
`distribute_tensor` and full-state-dict loaders do for this placement (integrations/torch.py
routes them here), so `set_model_state_dict(full_state_dict=True)` works too.

A tensor/expert-parallel parameter (TP/EP ran first: a DTensor on a tp or ep mesh) is a
RaggedDTensor of its global shape on the N-D mesh (shard group, *its TP/EP mesh dims) with the
placements (RaggedPlacement of its TP/EP-local tensor, *its TP/EP placements), FSDP2's 2-D
layout with a ragged first dim: the same operations work (reductions also over the mesh dims
that split the tensor, the gather also over TP/EP, checkpoint boxes placed in the global
tensor by tp_maps), except a view that changes the shape and redistribute to another
RaggedPlacement.

What raises (NotImplementedError naming the op and the placement), and why: shape-aware ops
(matmul, t, indexing, cat) would compute on a flat piece as if it
were the tensor; other random ops (dropout, randn_like) would not draw an unsharded
tensor's values; `out=` variants, operands of another layout or non-0-d tensors of any other
kind, redistribute to Shard or Partial.

Why a subclass and not a Placement carried by plain DTensor (line numbers of torch 2.13; 2.11 to
2.15 alike): plain DTensor's ops go through a C++ fast path and torch's sharding rules, which
know Shard, _StridedShard, Replicate and Partial only. A `Shard` subclass cannot even be put in a spec
(_dtensor_spec.py:392: `_verify_shard_order` wants each shard placement equal to
`Shard(dim)`), and made equal to it, it would be taken for an even split of a dimension. A bare
`Placement` subclass gets no sharded strategy for element-wise ops
(_ops/single_dim_strategy.py:138-149 builds candidates only as Shard or _StridedShard), so
`a + b` asks to redistribute to Replicate, which _redistribute.py:1659 refuses ("redistribute
from ... to R not supported yet"), as does `full_tensor()`; norms and sums fail in propagation
(_ops/_math_ops.py:222, "Expected Shard/_StridedShard"). Making those work means patching
torch's rule tables (what veScale's own DTensor does). A subclass with its own
`__torch_dispatch__` never enters that path (torch 2.12 and later call a subclass's own
__torch_dispatch__, _api.py:427; 2.11 takes its C++ path for subclasses too, so there
torch_compat.route_subclass_dispatch registers ours as every operator's rule), so the rules are
ours and complete for what FSDP code reaches.
Reductions are reduced at once, not left as torch's lazy `Partial`: in torch 2.13 `.item()` on
a Partial DTensor returns the local value (Partial("sum") of 1 and 2 reads 1.0 on rank 0), so
`grad.norm().item()` would silently be this rank's norm.

Cost: no copies; one Python dispatch per op (a foreach op: one for the whole list); a
collective only where a whole tensor is asked for (full_tensor, redistribute) and one
all-reduce per reduction (a `_foreach_norm`: one for the whole list).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.optim.optimizer as _optimizer
import torch.utils._foreach_utils as _foreach_utils
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .. import torch_compat
from . import ragged_ops
from .ragged import RaggedShard, ragged_to_ragged, ragged_to_replicate, root_to_ragged
from .ragged_piece import RaggedPiece
from .ragged_placement import RaggedPlacement
from .tp_maps import local_index_maps

__all__ = ["RaggedDTensor", "RaggedPlacement", "ragged_dtensor", "mesh_of_group", "local_of",
           "is_ragged_placements", "distribute_ragged", "fill_from_full"]


class RaggedDTensor(DTensor):
    """A DTensor whose one placement is a RaggedPlacement (see the module docstring)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return ragged_ops.dispatch(cls, func, args, kwargs or {})

    @property
    def ragged_shard(self) -> RaggedShard:
        """Its RaggedShard (not `layout`: that is every tensor's torch.strided), of the
        TP/EP-local tensor on an N-D mesh."""
        return ragged_ops.local_layout(self)

    @property
    def flat_range(self) -> tuple[int, int]:
        """[start, end) of this rank's piece in the (TP/EP-local) tensor flattened row-major."""
        return ragged_ops.local_range(self)

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        """Only another RaggedDTensor of this layout: torch's setter would take the new
        tensor's metadata and keep the old local piece, silently ignoring the values."""
        if not ragged_ops.is_ragged(value) or \
                ragged_ops.layout_key(value) != ragged_ops.layout_key(self):
            raise NotImplementedError(
                f"RaggedDTensor.data = {type(value).__name__} of shape {list(value.shape)}: only "
                "a RaggedDTensor of the same layout can replace it; to write whole values, "
                "copy_ a full tensor into it")
        torch.Tensor.data.__set__(self, value)  # dtype and the other tensor metadata
        self._local_tensor = value._local_tensor

    def __deepcopy__(self, memo):
        """A copy that owns its piece. torch's deepcopy rebuilds a wrapper subclass over a copy
        of the local tensor's whole storage at the local tensor's offset, which fails for a
        piece that does not start its storage (every parameter after a buffer's first)."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            local = self._local_tensor.clone()
        out = RaggedDTensor(local, self._spec, requires_grad=self.requires_grad)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def __repr__(self):
        return (f"RaggedDTensor(shape={list(self.shape)}, "
                f"{ragged_ops._shown(self._spec.placements)}, "
                f"local_tensor={self._local_tensor}, device_mesh={self._spec.mesh})")

    # -- the whole tensor, another layout, the local piece ---------------------------------------

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        if grad_placements is not None:
            raise NotImplementedError("RaggedDTensor.full_tensor: grad_placements is not "
                                      "supported (the gradient keeps the tensor's layout)")
        return _Gather.apply(self)

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements=None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        """To [Replicate()] (the gather) or to another RaggedPlacement (one all-to-all).
        Synchronous whatever `async_op` says: the result is ready when returned."""
        mesh = self._spec.mesh
        if device_mesh is not None and device_mesh != mesh:
            raise NotImplementedError("RaggedDTensor.redistribute to another mesh "
                                      f"({device_mesh}) is not supported")
        placements = tuple(self.placements if placements is None else placements)
        if backward_dtype is not None:
            raise NotImplementedError("RaggedDTensor.redistribute: backward_dtype is not "
                                      "supported")
        source = self if forward_dtype in (None, self.dtype) else self.to(forward_dtype)
        if placements == tuple(self.placements):
            return source
        if placements == (Replicate(),) * mesh.ndim:
            return DTensor.from_local(_Gather.apply(source), mesh, list(placements),
                                      run_check=False)
        if mesh.ndim == 1 and isinstance(placements[0], RaggedPlacement):
            if torch.is_grad_enabled() and source.requires_grad:
                raise NotImplementedError("RaggedDTensor.redistribute to another "
                                          "RaggedPlacement is not differentiable")
            target = placements[0].layout(self.shape)
            local = ragged_to_ragged(source._local_tensor, source.ragged_shard, target,
                                     group=mesh.get_group())
            return ragged_dtensor(local, target, mesh)
        raise NotImplementedError(f"RaggedDTensor.redistribute from {list(self.placements)} to "
                                  f"{list(placements)} is not supported; only Replicate on "
                                  "every mesh dim and (on a 1-D mesh) another RaggedPlacement")

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's flat piece: the local tensor itself (a differentiable view of it while
        gradients are recorded for this tensor)."""
        if grad_placements is not None and tuple(grad_placements) != tuple(self.placements):
            raise NotImplementedError("RaggedDTensor.to_local: gradients in other placements "
                                      f"({list(grad_placements)}) are not supported")
        if not (torch.is_grad_enabled() and self.requires_grad):
            return self._local_tensor
        return _ToLocal.apply(self)

    # -- torch.distributed.checkpoint --------------------------------------------------------

    def _piece(self) -> RaggedPiece:
        """This rank's range as DCP boxes of the global shape (placed by the TP/EP index maps
        on an N-D mesh); one rank of those holding an empty tensor writes its one chunk."""
        mesh = self._spec.mesh
        maps = local_index_maps(self._spec) if mesh.ndim > 1 else None
        return RaggedPiece(self._local_tensor, self.shape, self.flat_range[0],
                           local_shape=self.ragged_shard.shape, index_maps=maps,
                           writes_empty=not any(mesh.get_coordinate()))

    def __create_write_items__(self, fqn: str, object):
        return self._piece().write_items(fqn)

    def __create_chunk_list__(self):
        return self._piece().chunks()

    def __get_tensor_shard__(self, index):
        piece = self._piece()
        offsets = torch.Size(index.offset or ())
        if offsets not in piece.boxes:
            raise ValueError(f"{index.fqn}: this rank holds no box of it at {index.offset}")
        return piece.box(offsets)

    # -- tracing (torch.compile rebuilds subclasses from these) ----------------------------

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        local, mesh, placements, requires_grad = \
            torch_compat.unflatten_dtensor_parts(inner_tensors, flatten_spec)
        spec = ragged_ops.layout_spec(mesh, placements, outer_size, local.dtype)
        return RaggedDTensor(local, spec, requires_grad=requires_grad)


class _Gather(torch.autograd.Function):
    """full_tensor: the gather forward; backward each rank keeps its range of the gradient
    (the consumer of a whole tensor is replicated, as DTensor's Shard -> Replicate)."""

    @staticmethod
    def forward(ctx, x: RaggedDTensor):
        ctx.like = x
        mesh, r = x._spec.mesh, ragged_ops.ragged_dim(x._spec)
        local = ragged_to_replicate(x._local_tensor, x.ragged_shard, group=mesh.get_group(r))
        if mesh.ndim == 1:
            return local
        # then over the other dims (TP/EP, HSDP's replicas), by DTensor's own gather
        names = mesh.mesh_dim_names
        others = [d for d in range(mesh.ndim) if d != r]
        rest = mesh[tuple(names[d] for d in others)]
        return DTensor.from_local(local, rest, [x._spec.placements[d] for d in others],
                                  run_check=False, shape=x.shape, stride=x.stride()).full_tensor()

    @staticmethod
    def backward(ctx, grad):
        x = ctx.like
        piece = ragged_ops.range_of_full(x, grad).contiguous()
        return ragged_ops.wrap_like(RaggedDTensor, piece, x)


class _ToLocal(torch.autograd.Function):
    """to_local while recording: a view of the piece whose gradient comes back as a
    RaggedDTensor of the same layout (the parameter's `.grad` type)."""

    @staticmethod
    def forward(ctx, x: RaggedDTensor):
        ctx.like = x
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        return ragged_ops.wrap_like(RaggedDTensor, grad, ctx.like)


def ragged_dtensor(local: torch.Tensor, layout: RaggedShard, mesh: DeviceMesh, *,
                   requires_grad: bool = False, tp=None) -> RaggedDTensor:
    """`local` (this rank's piece of `layout`, 1-D) as a RaggedDTensor of the global shape,
    without a copy: its `_local_tensor` is `local` itself. For a TP/EP parameter `tp` is its
    DTensor spec: `layout` is then of its TP/EP-local tensor and `mesh` the N-D mesh ([HSDP's
    replicate dim,] the shard group, *tp.mesh's dims)."""
    tp_placements = () if tp is None else tuple(tp.placements)
    r = mesh.ndim - 1 - len(tp_placements)  # the shard group's dim
    if r < 0 or tp is None and r != 0:
        raise ValueError(f"a RaggedDTensor with TP/EP placements {list(tp_placements)} lives "
                         f"on a mesh of {1 + len(tp_placements)} or (HSDP) "
                         f"{2 + len(tp_placements)} dims, got {mesh.ndim}")
    if mesh.size(r) != layout.world_size:
        raise ValueError(f"the layout is for {layout.world_size} ranks, the mesh has "
                         f"{mesh.size(r)}")
    expected = layout.local_numel(mesh.get_local_rank(r))
    if local.dim() != 1 or local.numel() != expected:
        raise ValueError(f"the local piece has shape {list(local.shape)}, expected 1-D with "
                         f"{expected} elements")
    torch_compat.route_subclass_dispatch(RaggedDTensor, mesh)  # (torch 2.11 needs it)
    spec = ragged_ops.layout_spec(mesh, (Replicate(),) * r + (RaggedPlacement.of(layout),
                                                              *tp_placements),
                                  layout.shape if tp is None else tp.shape, local.dtype)
    if tp is not None and ragged_ops.inner_shape(spec) != tuple(layout.shape):
        raise ValueError(f"the layout's shape {list(layout.shape)} is not this rank's TP/EP-local "
                         f"shape of {list(tp.shape)} placed {list(tp_placements)}")
    return RaggedDTensor(local, spec, requires_grad=requires_grad)


def is_ragged_placements(placements) -> bool:
    return placements is not None and any(isinstance(p, RaggedPlacement) for p in placements)


def distribute_ragged(tensor: torch.Tensor, mesh: DeviceMesh, placements, *,
                      src_data_rank: int | None = 0) -> RaggedDTensor:
    """torch's `distribute_tensor` for a RaggedPlacement: this rank's range of `tensor` as a
    RaggedDTensor that owns its piece. As torch does, the values come from mesh rank
    `src_data_rank` (one scatter, root_to_ragged); with None each rank takes its range of its
    own `tensor` and nothing moves. A meta tensor gives a meta piece. On an N-D mesh (a TP/EP
    parameter's: [Replicate,] RaggedPlacement, TP/EP placements) the whole tensor is broadcast
    from mesh coordinate 0 along each mesh dim in turn, then each rank keeps its range."""
    placements = tuple(placements)
    if mesh.ndim != len(placements) or sum(isinstance(p, RaggedPlacement)
                                           for p in placements) != 1:
        raise NotImplementedError(f"distribute_tensor with {list(placements)} on a {mesh.ndim}-D "
                                  "mesh: one RaggedPlacement, one placement per mesh dim")
    if mesh.ndim > 1:
        return _distribute_nd(tensor, mesh, placements, src_data_rank)
    layout = placements[0].layout(tensor.shape)
    rank = mesh.get_local_rank()
    if tensor.is_meta or src_data_rank is None:
        piece = tensor.detach().reshape(-1)[slice(*layout.local_range(rank))].clone()
    else:
        piece = root_to_ragged(tensor.detach() if rank == src_data_rank else None, layout,
                               src_data_rank, group=mesh.get_group(), dtype=tensor.dtype,
                               device=tensor.device).clone()  # its own storage, as torch's
    return ragged_dtensor(piece, layout, mesh, requires_grad=tensor.requires_grad)


def _distribute_nd(tensor, mesh, placements, src_data_rank):
    spec = ragged_ops.layout_spec(mesh, placements, tensor.shape, tensor.dtype)
    full = tensor.detach()
    if not (full.is_meta or src_data_rank is None):
        if src_data_rank != 0:
            raise NotImplementedError(f"distribute_tensor with {list(placements)}: "
                                      f"src_data_rank={src_data_rank}; 0 or None")
        full = full.contiguous().clone()
        for d in range(mesh.ndim):  # after dim d, every rank holds coordinate (0, .., 0)'s
            dist.broadcast(full, group=mesh.get_group(d), group_src=0)
    piece = ragged_ops.range_of_full(spec, full).clone()  # its own storage, as torch's
    torch_compat.route_subclass_dispatch(RaggedDTensor, mesh)  # (torch 2.11 needs it)
    return RaggedDTensor(piece, spec, requires_grad=tensor.requires_grad)


def fill_from_full(local_state: RaggedDTensor, full: torch.Tensor) -> RaggedDTensor:
    """`local_state` holding its range of `full` (a whole tensor every rank has): written into
    its piece, or, for a meta piece, a new RaggedDTensor of that layout owning a copy."""
    if tuple(full.shape) != tuple(local_state.shape):
        raise ValueError(f"a full tensor of shape {list(full.shape)} for a RaggedDTensor of "
                         f"shape {list(local_state.shape)}")
    if local_state.is_meta:
        piece = ragged_ops.range_of_full(local_state, full.detach())
        return ragged_ops.wrap_like(RaggedDTensor, piece.to(local_state.dtype).clone(),
                                    local_state)
    with torch.no_grad():
        local_state.copy_(full.detach())  # this rank's range (ragged_ops' copy_ rule)
    return local_state


def local_of(t):
    """A RaggedDTensor's local piece (without autograd), anything else as it is: for code that
    computes on this rank's flat pieces (our optimizers) and must not pay a dispatch per op."""
    return t._local_tensor if isinstance(t, RaggedDTensor) else t


_MESHES: dict = {}


def mesh_of_group(group, device_type: str) -> DeviceMesh:
    """The 1-D DeviceMesh over a process group (one per group and device type, made once)."""
    key = (group, device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


# As torch registers DTensor (torch/distributed/tensor/__init__.py): optimizers and
# clip_grad_norm_ choose their foreach paths for these tensors by default where the device
# has foreach kernels.
for _types in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
    if RaggedDTensor not in _types:
        _types.append(RaggedDTensor)
