"""FSDP2's `fully_shard` arguments in our terms: what each one means for a unit, or a one-line
error before any collective where we cannot honour it.

- `reshard_after_forward`: None (FSDP2's default: True but for the root), a bool, or an int:
  the shard group's size is True and 1 is False (as FSDP2 maps them); any other divisor N
  reshards after forward to groups of N consecutive ranks, from which backward all-gathers
  (FSDP2's post-forward mesh): that is ZeRO++'s hpZ, so it becomes `hpz_partition_size=N`
  (secondary copies of 1/N of the gathered parameters; api.py).
- `mesh`: a DeviceMesh (1-D: shard; 2-D: (replicate, shard), HSDP), a process group, or None
  (the world): the groups a unit's buffers shard and replicate over (`resolve_mesh`).
- `shard_placement_fn(param)`: None or Shard(0) keeps each dim-0 slice whole on one rank,
  as FSDP2's Shard(0) does: the parameter's granularity becomes one whose blocks are whole
  dim-0 slices (rows:1 for a matrix or a vector, block:<slice> above); Shard(d) for d > 0
  (columns on a rank: not one flat range) is refused, naming the parameter. FSDP2's
  `ShardPlacementResult(placement, mesh_info)` (torch 2.13 and later) also gives the parameter
  its own mesh (experts on the expert-data-parallel mesh, in the same unit as the dense
  parameters): its parameters get buffers of their own over that mesh (`mesh_of`).
- `offload_policy`: OffloadPolicy() (no offload) or CPUOffloadPolicy(pin_memory): the unit's
  master and gradient shards in host memory (FSDPUnit.offload_to_host).
- `ignored_params`: ids of the parameters no unit manages.
- `dp_mesh_dims`: refused (pass the data-parallel sub-mesh as `mesh`).
"""
from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..plan.granularity import Granularity, parse_granularity
from .param import sharding_of

__all__ = ["reshard_after_forward_of", "placement_of", "check_placements", "offload_of",
           "ignored_ids", "check_dp_mesh_dims", "root_modules", "resolve_mesh", "mesh_of"]


def resolve_mesh(mesh):
    """(shard group, replicate group or None, the DeviceMesh itself or None) from a DeviceMesh,
    a process group, or None."""
    if mesh is None:
        return dist.group.WORLD, None, None
    if isinstance(mesh, dist.ProcessGroup):
        return mesh, None, None
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh)}")
    # A sub-mesh (the dp mesh of a (dp, tp) mesh, the efsdp mesh of experts) may have fewer
    # ranks than the world, but this rank must be one of them.
    if mesh.get_coordinate() is None:
        raise ValueError(f"rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()} "
                         "passed to fully_shard")
    if mesh.ndim == 1:
        return mesh.get_group(0), None, mesh
    if mesh.ndim == 2:  # (replicate, shard): HSDP
        if mesh.mesh_dim_names is None:  # FSDP2's refusal, its type and words
            raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
        return mesh.get_group(1), mesh.get_group(0), mesh
    raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} (1-D: shard; "
                     "2-D: (replicate, shard), HSDP)")  # FSDP2's words


def _own_mesh(result):
    """The FSDPMeshInfo of a ShardPlacementResult (None for None or a Shard): read by its
    fields, so that torch releases without the class need nothing."""
    return getattr(result, "mesh_info", None)


def _placement(result):
    """The Shard (or None) of a shard_placement_fn answer."""
    return result.placement if _own_mesh(result) is not None else result


def mesh_of(shard_placement_fn, default):
    """param -> (shard group, replicate group, shard DeviceMesh) of a parameter that
    shard_placement_fn gives a mesh of its own (FSDP2's ShardPlacementResult), `default` (what
    fully_shard's `mesh` resolved to) for the others; None without a shard_placement_fn."""
    if shard_placement_fn is None:
        return None
    resolved = {}

    def of(param):
        info = _own_mesh(shard_placement_fn(param))
        if info is None:
            return default
        if id(info.mesh) not in resolved:
            resolved[id(info.mesh)] = (info.mesh, _resolve_info(info))
        return resolved[id(info.mesh)][1]
    return of


def _resolve_info(info):
    """FSDP2's FSDPMeshInfo (a 1-D shard mesh) or HSDPMeshInfo (2-D, replicate dim 0, shard dim
    1) as resolve_mesh's groups."""
    mesh = info.mesh
    replicate_dim = getattr(info, "replicate_mesh_dim", None)
    if replicate_dim is None and mesh.ndim != 1 or replicate_dim is not None and (
            mesh.ndim != 2 or replicate_dim != 0 or info.shard_mesh_dim != 1):
        raise NotImplementedError(
            f"shard_placement_fn returned a mesh_info over {mesh}: a parameter's own mesh must be "
            "1-D (FSDPMeshInfo) or 2-D with replicate dim 0 and shard dim 1 (HSDPMeshInfo)")
    return resolve_mesh(mesh)

def reshard_after_forward_of(value, shard_size: int) -> tuple:
    """(None, True or False for a unit; the size of the groups to reshard to after forward,
    1 for all ranks), from FSDP2's bool-or-int (or None)."""
    if value is None or isinstance(value, bool):
        return value, 1
    if not isinstance(value, int):
        raise ValueError("reshard_after_forward should be a bool or an int representing the "
                         f"group size to reshard to, not {value}")
    if value < 1 or value > shard_size or shard_size % value:
        raise ValueError("If passing reshard_after_forward as an int, it should be a factor of "
                         f"{shard_size}, not {value}")
    if value == 1:
        return False, 1
    return True, (1 if value == shard_size else value)


def placement_of(shard_placement_fn):
    """(fqn, param, policy, shape) -> Granularity, from FSDP2's shard_placement_fn; None
    when there is none (the granularity argument alone decides)."""
    if shard_placement_fn is None:
        return None
    from torch.distributed.tensor import Shard

    def placement(fqn, param, policy, shape):
        result = _placement(shard_placement_fn(param))
        if result is not None and not isinstance(result, Shard):
            raise NotImplementedError(
                f"shard_placement_fn returned {type(result).__name__} for {fqn}: vescale_engine's "
                "fully_shard takes None, Shard(0) or a ShardPlacementResult of one of them")
        dim = 0 if result is None else result.dim
        if len(shape) and dim < 0:
            dim += len(shape)
        if dim != 0:
            raise NotImplementedError(
                f"shard_placement_fn returned Shard({result.dim}) for {fqn}: vescale_engine's "
                "fully_shard keeps each rank's piece one flat range, so it shards along dim 0 "
                "only; return None or Shard(0)")
        return dim0_granularity(policy, shape)
    return placement


def check_placements(shard_placement_fn, modules, ignored: set, shard_size: int) -> None:
    """What FSDP2 itself refuses of `shard_placement_fn`'s answers, with its error types and
    words, looked at over every parameter the call will manage before anything is planned (as
    FSDP2 finds them at wrap time): a dim the parameter does not have (AssertionError), then a
    dim > 0 that the shard group does not divide (NotImplementedError). What FSDP2 accepts and
    we do not (an even Shard(d > 0)) is placement_of's refusal, after these."""
    if shard_placement_fn is None:
        return
    from torch.distributed.tensor import DTensor, Shard
    params = [p for m in modules for p in m.parameters()
              if id(p) not in ignored and sharding_of(p) is None]
    answers = []
    for param in dict.fromkeys(params):
        answer = shard_placement_fn(param)
        info = _own_mesh(answer)
        if info is not None and info.mesh.get_coordinate() is None:
            raise ValueError(f"shard_placement_fn: rank {dist.get_rank()} is not in the mesh "
                             f"{info.mesh.mesh.tolist()} of a {tuple(param.shape)} parameter")
        result = _placement(answer)
        if isinstance(result, Shard):
            dim = result.dim + param.ndim if result.dim < 0 else result.dim
            if not 0 <= dim < max(param.ndim, 1):
                raise AssertionError(f"Shard dim {dim} is invalid for {param.ndim}D tensor: "
                                     f"{tuple(param.shape)}")
            answers.append((param, dim, shard_size if info is None else
                            info.mesh.size(getattr(info, "shard_mesh_dim", 0))))
    for param, dim, size in answers:
        if dim > 0 and not isinstance(param, DTensor) and param.shape[dim] % size:
            raise NotImplementedError(f"FSDP does not support uneven sharding on dim {dim}: "
                                      f"{param.size()} (world size: {size})")


def dim0_granularity(policy, shape) -> Granularity:
    """`policy` if its blocks are whole dim-0 slices of `shape`, else the smallest policy
    whose are: rows:1 up to two dimensions (a slice is a row), block:<slice elements> above."""
    policy = parse_granularity(policy)
    per_slice = math.prod(shape[1:]) if len(shape) > 1 else 1
    if per_slice == 0 or policy.block_size(shape) % per_slice == 0:
        return policy
    return Granularity("rows", 1) if len(shape) <= 2 else Granularity("block", rows=per_slice)


def offload_of(offload_policy):
    """pin_memory of a CPUOffloadPolicy; None for no offload (None or OffloadPolicy())."""
    if offload_policy is None:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    if isinstance(offload_policy, CPUOffloadPolicy):
        return bool(offload_policy.pin_memory)
    if type(offload_policy) is OffloadPolicy:
        return None
    raise NotImplementedError(f"offload_policy={offload_policy!r} is not supported by "
                              "vescale_engine's fully_shard: OffloadPolicy() or "
                              "CPUOffloadPolicy(pin_memory=...)")


def ignored_ids(ignored_params) -> set:
    if ignored_params is None:
        return set()
    from torch import nn
    ids = set()
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameter objects, got {type(p)}")
        ids.add(id(p))
    return ids


def check_dp_mesh_dims(dp_mesh_dims) -> None:
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "dp_mesh_dims is not supported by vescale_engine's fully_shard: pass the data-"
            "parallel mesh itself as mesh (its dp sub-mesh; TP/EP parameters keep their own "
            "mesh as DTensors)")


def root_modules(modules) -> list:
    """FSDP2's list argument: the modules not inside another module of the list, in order,
    each once."""
    modules = list(dict.fromkeys(modules))
    inside = set()
    for m in modules:
        inside.update(id(sub) for sub in m.modules() if sub is not m)
    return [m for m in modules if id(m) not in inside]
