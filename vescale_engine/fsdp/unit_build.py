"""Wrap time: a unit's parameters found, checked as FSDP2 checks them, planned into buffers
(identical units planned once) and copied into them as ShardedParameters."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..plan.planner import TensorSpec, plan_unit
from ..plan.quantization import quantization_block
from ..shard.collectives import default_device
from ..shard.dbuffer import DBuffer
from .dtensor_params import (dtensor_spec_of, layout_key,
                             local_tensor, tp_block)
from .faces import ParameterFace, RaggedFace
from .guards import is_deferred
from .param import ShardedParameter
from .policy import MixedPrecisionPolicy

__all__ = ["BuildOptions", "build_unit"]


@dataclass(frozen=True)
class BuildOptions:
    """What fully_shard decided about one unit's sharding and wire formats."""
    granularity: object          # fqn -> Granularity (policy.granularity_of)
    max_buffers: int
    align_bytes: int
    mp_policy: MixedPrecisionPolicy
    ignored: frozenset = frozenset()  # ids of parameters left as they are (ignored_params)
    placement: object = None     # (fqn, param, policy, shape) -> Granularity: shard_placement_fn
    face: ParameterFace = RaggedFace()  # what the module holds between steps
    rank_local: bool = False     # ShardingPolicy's: the norm sums over the world
    native_collectives: bool = False
    quantize_group: int | None = None  # elements per int8 group, when `quantized`
    quantized: tuple = ()        # "weights" and/or "gradients" (shard/quantize.py)
    quantize_format: str = "int8"
    hpz_group: object = None     # hpZ: backward re-gathers inside this group
    divide_factor: float | None = None
    shard_mesh: object = None    # fully_shard's DeviceMesh (faces of TP/EP parameters)
    param_mesh: object = None    # param -> (shard group, replicate group, shard mesh), or None


@functools.lru_cache(maxsize=256)
def _cached_plan(specs, world_size, align, max_buffers):
    """Identical units (the repeated decoder layers) are planned once."""
    return plan_unit(list(specs), world_size, align, max_buffers)


def build_unit(unit, group, replicate_group, options: BuildOptions):
    """(device, buffers, params) of `unit` (its `modules` and `name` are read)."""
    managed = set().union(*(_managed_ids(m) for m in unit.modules)) | options.ignored
    found, order, home = _collect(unit.modules, managed)
    # the planner's names: unique over the unit (a group's modules may share names)
    plan_name = {i: found[i][0] if len(unit.modules) == 1 else f"{home[i][0]}/{found[i][0]}"
                 for i in order}
    for i in order:
        check_parameter(*found[i][:2], options.face)
    if not order:  # (as FSDP2: a root whose parameters the inner units all manage)
        return default_device(group), [], []
    device = _device(unit.name, found, order)
    meshes = _meshes(unit, found, order, group, replicate_group, options)
    dtensor_specs = {i: dtensor_spec_of(found[i][0], found[i][1]) for i in order}
    face_meshes = {i: options.face.mesh(meshes[i][2], dtensor_specs[i], found[i][0])
                   for i in order if dtensor_specs[i] is not None}
    local = {i: local_tensor(found[i][1]) for i in order}
    # One buffer never mixes tensors of different TP/EP layouts (the gradient norm and the
    # optimizers treat a buffer's gradient as a whole: what it is a piece of) or groups.
    by_kind = {}
    for i in order:
        key = (found[i][1].dtype, layout_key(dtensor_specs[i]), meshes[i][:2])
        by_kind.setdefault(key, []).append(i)
    buffers, params = [], []
    for (dtype, _, (group, replicate_group)), ids in by_kind.items():
        world_size = dist.get_world_size(group)
        specs = tuple(TensorSpec(plan_name[i], tuple(local[i].shape),
                                 _block(options, found[i][0], found[i][1], local[i],
                                        dtensor_specs[i]))
                      for i in ids)
        param_dtype = options.mp_policy.param_dtype or dtype
        itemsize = min(dtype.itemsize, param_dtype.itemsize)
        plan = _cached_plan(specs, world_size, max(1, options.align_bytes // itemsize),
                            options.max_buffers)
        position = {plan_name[i]: i for i in ids}
        for layout in plan.buffers:
            buf = _buffer(layout, dtype, device, group, replicate_group, options,
                          f"{unit.name}[{len(buffers)}]")
            buffers.append(buf)
            for k, placement in enumerate(layout.placements):
                i = position[placement.name]
                params.append(_sharded(unit, found[i], home[i][1], buf, k, local[i],
                                       dtensor_specs[i], face_meshes.get(i)))
    for i in order:  # a module still holding one of them shares it with this unit
        found[i][1]._vescale_sharded_by = unit.name
    return device, buffers, params


def _collect(modules, managed):
    """{id: (fqn, param, [(module, name) registrations])}, ids in order, {id: (k, root)}."""
    found, order, home = {}, [], {}
    for k, root in enumerate(modules):
        for mod_name, mod in root.named_modules(remove_duplicate=False):
            for pname, param in list(mod._parameters.items()):
                if param is None or id(param) in managed:
                    continue
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if id(param) not in found:
                    found[id(param)] = (fqn, param, [])
                    order.append(id(param))
                    home[id(param)] = (k, root)  # the module its fqn is relative to
                if (mod, pname) not in found[id(param)][2]:
                    found[id(param)][2].append((mod, pname))
    return found, order, home


def _device(name, found, order):
    devices = {found[i][1].device for i in order}
    on_meta = [i for i in order if found[i][1].is_meta]
    if on_meta and len(on_meta) < len(order):
        undeferred = [i for i in on_meta if not is_deferred(*found[i][1:])]
        if undeferred:
            real = next(found[i] for i in order if not found[i][1].is_meta)
            raise ValueError(f"fully_shard({name}): {found[undeferred[0]][0]} is on the "
                             f"meta device but {real[0]} is on {real[1].device}; build the "
                             "whole unit on meta (then vescale_engine.materialize) or on a "
                             "real device")
        # A deferred build (integrations/deepspeed/zero_init.py) plus tensors added after it with their values (PEFT
        # adapters, new heads): planned on meta, the real values kept for allocate.
        devices = {torch.device("meta")}
    if len(devices) > 1:
        raise ValueError(f"fully_shard({name}): parameters are on mixed devices "
                         f"{sorted(map(str, devices))}")
    return devices.pop()


def _buffer(layout, dtype, device, group, replicate_group, options, name):
    param_dtype, reduce_dtype, grad_dtype = options.mp_policy.buffer_dtypes(dtype)
    return DBuffer(layout, dtype=dtype, device=device, shard_group=group,
                   replicate_group=replicate_group, param_dtype=param_dtype,
                   reduce_dtype=reduce_dtype, grad_dtype=grad_dtype, name=name,
                   native_collectives=options.native_collectives,
                   divide_factor=options.divide_factor,
                   quantize_group=options.quantize_group, quantized=options.quantized,
                   hpz_group=options.hpz_group, quantize_format=options.quantize_format,
                   rank_local=options.rank_local)


def _meshes(unit, found, order, group, replicate_group, options) -> dict:
    """{id: (shard group, replicate group, shard DeviceMesh)} of each parameter: fully_shard's
    mesh, or the parameter's own (shard_placement_fn's ShardPlacementResult)."""
    default = (group, replicate_group, options.shard_mesh)
    if options.param_mesh is None:
        return {i: default for i in order}
    meshes = {i: options.param_mesh(found[i][1]) for i in order}
    own = next((i for i in order if meshes[i][:2] != default[:2]), None)
    if own is not None and options.hpz_group is not None:
        raise NotImplementedError(
            f"fully_shard: {found[own][0]} has a mesh of its own (shard_placement_fn), which "
            f"hpZ / reshard_after_forward=N (groups of the world) cannot gather from ({unit.name})")
    return meshes


def _sharded(unit, entry, home, buf, k, local, dtensor_spec, mesh):
    fqn, param, registrations = entry
    sp = ShardedParameter(unit, fqn, registrations, buf, k, param.requires_grad, dtensor_spec,
                          mesh)
    sp.home = home
    if param.is_meta and dtensor_spec is None:
        sp.build_writes = param._version  # materialize compares (why: there)
    if not param.is_meta:  # a meta model gets its values at materialize
        if buf.is_meta:
            sp.initial = local.detach()  # written at allocate
        else:
            buf.load_full_tensor(k, local)
    sp.register(sp.sharded)
    return sp


def _block(options, fqn, param, local, dtensor_spec):
    """The planner block of a tensor: its granularity's (or shard_placement_fn's), whole TP
    pieces, and under quantized weights small blocks joined up to a group."""
    policy = options.granularity(fqn)
    if options.placement is not None:
        policy = options.placement(fqn, param, policy, tuple(local.shape))
    block = tp_block(policy.block_size(local.shape), local.shape, dtensor_spec)
    if options.quantize_group is None:
        return block
    return min(quantization_block(block, options.quantize_group), max(1, local.numel()))


def check_parameter(fqn, param, face):
    """FSDP2's refusals of a parameter, with its error types, and tensor subclasses (FSDP2's
    all-gather extensions among them), which we do not shard. A tensor another unit shards
    already (a weight tied between separately wrapped modules; FSDP2 refuses it at the
    first forward): two copies would train apart. Then what the face refuses (FSDP2's: a
    scalar, a non-contiguous tensor; DeepSpeed's plain pieces take them)."""
    if getattr(param, "_vescale_sharded_by", None) is not None:
        raise ValueError(f"Parameter '{fqn}' is shared with a parameter already managed by "
                         f"another FSDP group ({param._vescale_sharded_by}). For "
                         "shared/tied parameters, use fully_shard([module_a, module_b]) to "
                         "place them in the same FSDP group.")
    local = param._local_tensor if isinstance(param, DTensor) else param
    if hasattr(local, "fsdp_pre_all_gather"):
        raise NotImplementedError(
            f"fully_shard: {fqn} is a {type(local).__name__} defining fsdp_pre_all_gather / "
            "fsdp_post_all_gather: FSDP2's all-gather extensions (torchao float8, NF4) are "
            "not supported by vescale_engine's fully_shard")
    if is_traceable_wrapper_subclass(local):  # its pieces would be copied as plain values
        raise NotImplementedError(
            f"fully_shard: {fqn} is a tensor subclass ({type(local).__name__}), which "
            "vescale_engine's fully_shard does not shard (plain tensors and DTensors only)")
    face.check(fqn, param)


def _managed_ids(module):
    ids = set()
    for sub in module.modules():
        unit = getattr(sub, "_vescale_unit", None)
        if unit is not None:
            for p in unit.params:
                ids.add(id(p.sharded))
    return ids
