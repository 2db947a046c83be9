"""`fully_shard`, the call that makes FSDP units (FSDP2's signature; its modules become
FSDPModules), and what undoes or suspends them (`release`, `no_sync`)."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn

from .. import torch_compat
from ..launch.settle import settle_at_exit
from ..logs import install as install_logging
from ..plan.planner import DEFAULT_ALIGN_BYTES, DEFAULT_MAX_BUFFERS
from ..plan.quantization import TILE_COLS, tile_rows
from ..shard.collectives import default_device
from ..versions import check_versions
from . import fsdp2_args
from .fp8_linear import install_fp8_linears
from .guards import guard_apply, guard_init_weights, take_assignments
from .lookup import unit_of, units_under
from .materialize import install_full_shape_reset
from .module_class import (FSDPState, register_fsdp_forward_method, restore_class,
                           to_fsdp_class)
from .policy import (CommunicationPolicy, MemoryPolicy, ShardingPolicy, as_policy,
                     policy_of)
from .unit import FSDPUnit, UnitContext

__all__ = ["fully_shard", "no_sync", "reduce_kept_gradients", "release",
           "register_fsdp_forward_method"]


# the default process group -> {N: this rank's hpZ group of N consecutive ranks}
_HPZ_GROUPS = weakref.WeakKeyDictionary()


def _modules_to_shard(module) -> list:
    """The modules of one fully_shard call, refused as FSDP2 refuses them (one line, before
    any collective)."""
    check_versions()  # a torch below the supported range: one line, before anything runs
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialized process group "
                           "(torch.distributed.init_process_group)")
    modules = fsdp2_args.root_modules(module) if isinstance(module, (list, tuple)) \
        else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError(f"fully_shard expects an nn.Module or a list of them, got {module!r}")
    if not isinstance(module, (list, tuple)):
        _check_not_container(module)
    for m in modules:
        if getattr(m, "_vescale_unit", None) is not None:
            raise AssertionError(  # FSDP2's type and words for a second application
                "Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard was already applied to this {type(m).__name__}")
    return modules


def _check_not_container(module) -> None:
    """FSDP2 refuses a ModuleList / ModuleDict without a forward of its own: its forward never
    runs, so nothing would gather its parameters (a list of its modules is one unit)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and \
            type(module).forward is nn.Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement "
                         f"forward: {type(module).__name__} (as FSDP2; shard its modules, or "
                         "pass them as a list: fully_shard(list(container)))")


def _hpz_group(size, group, replicate_group, argument="hpz_partition_size"):
    """hpZ's group for `size` (None for 1: off); its groups are made once, by every rank.
    `argument` is the name the caller gave the size (in the errors)."""
    if size == 1:
        return None
    world = dist.get_world_size()
    if replicate_group is not None or dist.get_world_size(group) != world:
        raise NotImplementedError(
            f"{argument}={size} needs a unit sharded over every rank (no HSDP, tensor, expert "
            "or sequence parallelism): its groups are consecutive ranks of the world; pass "
            "reshard_after_forward=True or False with this mesh")
    if world % size:
        raise ValueError(f"{argument}={size} does not divide the {world} ranks")
    made = _HPZ_GROUPS.setdefault(dist.group.WORLD, {})
    if size not in made:
        for first in range(0, world, size):  # every rank makes every group, in one order
            group_of_n = dist.new_group(list(range(first, first + size)))
            if first <= dist.get_rank() < first + size:
                made[size] = group_of_n
    return made[size]


def _require_rowwise_scaled_mm(modules, group) -> None:
    """fp8_matmul's matmuls need torch._scaled_mm with row-wise scales on the device the
    modules compute on (theirs, or the group's for a model on meta): one line if not."""
    device = next((p.device for m in modules for p in m.parameters()), default_device(group))
    if device.type == "meta":
        device = default_device(group)
    missing = torch_compat.rowwise_scaled_mm_missing(device.type)
    if missing:
        raise NotImplementedError(
            f"fp8_matmul=True needs torch._scaled_mm with row-wise scales on {device.type}, "
            f"which torch {torch.__version__} does not have there (torch 2.12 and later have it "
            f"on CPU): {missing}")


def fully_shard(module, *, mesh=None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn=None, mp_policy=None, offload_policy=None,
                ignored_params=None, dp_mesh_dims=None, granularity="rows:1",
                max_buffers: int = DEFAULT_MAX_BUFFERS,
                align_bytes: int = DEFAULT_ALIGN_BYTES, grads_in_place: bool = True,
                max_reuse_distance: int = 0, native_collectives: bool = False,
                gradient_divide_factor: float | None = None,
                quantized_weights: int | None = None,
                quantized_gradients: int | None = None, hpz_partition_size: int = 1,
                quantization_format: str = "int8", fp8_matmul: bool = False,
                sharding: ShardingPolicy | None = None, memory: MemoryPolicy | None = None,
                communication: CommunicationPolicy | None = None):
    """Shard `module`'s parameters (those no inner unit manages) into planner-laid DBuffers.

    FSDP2's arguments with FSDP2's meaning (fsdp/fsdp2_args.py says how each maps or why it is
    refused; `reshard_after_forward=N`, a divisor of the shard group, is hpZ's secondary copy
    in groups of N). `mesh`: the data-parallel ranks (a 1-D mesh or process group, a 2-D
    (replicate, shard) mesh for HSDP), possibly a sub-mesh of the world; parameters that are
    DTensors on a TP or EP mesh (TP/EP applied first) have their local tensors sharded over it,
    and `mesh` must then be a DeviceMesh sliced from the same mesh as theirs, as FSDP2 requires
    (docs/architecture.md, "DTensor parameters"). The module becomes a
    `torch.distributed.fsdp.FSDPModule` keeping its class name; it is returned (the list, for
    a list: one unit, one all-gather for all).

    Ours besides: `sharding`, `memory`, `communication`, policy objects (fsdp/policy.py
    documents each field), or their fields as keywords (one set beside its policy is an error);
    `gradient_divide_factor`: what summed gradients are divided by (default the number of
    ranks of `mesh`; experts over a part of the data-parallel world set its whole size, as
    torchtitan does). Every refusal is raised here, before any collective."""
    install_logging()  # the library's lines print without logging setup (logs.py)
    settle_at_exit()  # gloo's threads finish before the interpreter does (launch/settle.py)
    modules = _modules_to_shard(module)
    fsdp2_args.check_dp_mesh_dims(dp_mesh_dims)
    group, replicate_group, shard_mesh = fsdp2_args.resolve_mesh(mesh)
    reshard_after_forward, post_forward = fsdp2_args.reshard_after_forward_of(
        reshard_after_forward, dist.get_world_size(group))
    offload = fsdp2_args.offload_of(offload_policy)
    fsdp2_args.check_placements(shard_placement_fn, modules, fsdp2_args.ignored_ids(
        ignored_params), dist.get_world_size(group))
    _check_divide_factor(gradient_divide_factor)
    sharding = policy_of(ShardingPolicy, sharding, dict(
        granularity=granularity, max_buffers=max_buffers, align_bytes=align_bytes))
    memory = policy_of(MemoryPolicy, memory, dict(grads_in_place=grads_in_place,
                                                  max_reuse_distance=max_reuse_distance))
    comm = _with_post_forward(policy_of(CommunicationPolicy, communication, dict(
        quantized_weights=quantized_weights, quantized_gradients=quantized_gradients,
        quantization_format=quantization_format, fp8_matmul=fp8_matmul,
        hpz_partition_size=hpz_partition_size, native_collectives=native_collectives)),
        post_forward)
    hpz = _hpz_group(comm.hpz_partition_size, group, replicate_group,
                     "reshard_after_forward" if post_forward > 1 else "hpz_partition_size")
    if comm.fp8_matmul:
        _require_rowwise_scaled_mm(modules, group)
    unit = FSDPUnit(modules if isinstance(module, (list, tuple)) else module, group,
                    replicate_group, reshard_after_forward, as_policy(mp_policy), sharding,
                    memory, comm, gradient_divide_factor=gradient_divide_factor,
                    ignored=fsdp2_args.ignored_ids(ignored_params),
                    placement=fsdp2_args.placement_of(shard_placement_fn), hpz_group=hpz,
                    shard_mesh=shard_mesh, param_mesh=fsdp2_args.mesh_of(
                        shard_placement_fn, (group, replicate_group, shard_mesh)))
    _finish(unit, comm, offload, modules)
    return module


def _check_divide_factor(factor) -> None:
    if factor is not None and not factor > 0:
        raise ValueError(f"gradient_divide_factor must be > 0, got {factor}")


def _install(unit, modules) -> None:
    """The unit's hooks and guards on each of its modules, which become FSDPModules."""
    for m in modules:
        m._vescale_unit = unit
        to_fsdp_class(m)
        guard_apply(m)
        guard_init_weights(m)
        # first of the pre-hooks, as FSDP2's: a user's own see the full parameters
        m.register_forward_pre_hook(unit.pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(unit.post_forward)


def _with_post_forward(comm: CommunicationPolicy, post_forward: int) -> CommunicationPolicy:
    """FSDP2's post-forward mesh (reshard_after_forward=N) as hpZ's secondary copies."""
    if post_forward == 1:
        return comm
    if comm.hpz_partition_size not in (1, post_forward):
        raise ValueError(f"reshard_after_forward={post_forward} and hpz_partition_size="
                         f"{comm.hpz_partition_size} name two sizes for the groups to reshard "
                         "to after forward; pass one of them")
    return dataclasses.replace(comm, hpz_partition_size=post_forward)


def _finish(unit, comm: CommunicationPolicy, offload, modules) -> None:
    """What a built unit gets: FP8 matmuls, offload, the full-shape resets, the assignment
    guards, then its modules' hooks."""
    if comm.quantization_format == "fp8_e4m3" and dist.get_rank() == 0:
        _warn_untiled(unit)
    if comm.fp8_matmul:
        for buf in unit.buffers:
            buf.gather_format.keep_fp8 = True
        unit.fp8_linears = install_fp8_linears(unit)
    if offload is not None:
        unit.group.offload_to_host(offload)
    install_full_shape_reset(unit)
    take_assignments()
    _install(unit, modules)


def _state(module):
    """`fully_shard.state(module)`, as FSDP2's contract function has it: the state of the unit
    `module` belongs to (None when fully_shard did not wrap it). FSDP2's is its private
    FSDPState, which no public API reads beyond its forward hooks (torch's
    register_fsdp_forward_method); ours has those and names any other attribute asked for."""
    unit = unit_of(module)
    return None if unit is None else FSDPState(unit)


fully_shard.state = _state


def _warn_untiled(unit) -> None:
    """FP8 weights: name the matrices that travel as int8 groups instead of FP8 tiles (one
    message per set of names: a model's identical layers warn once)."""
    names = [p.name for b in unit.buffers for p in b.layout.placements
             if len(p.spec.shape) >= 2 and tile_rows(p.spec) is None]
    if names:
        warnings.warn(f"quantization_format='fp8_e4m3': {', '.join(names)} travel as int8 "
                      f"groups, not FP8 tiles: FP8 tiles need a width that is a multiple of "
                      f"{TILE_COLS} and planner blocks of whole rows (granularity rows:R or "
                      f"tile:Rx{TILE_COLS})", stacklevel=3)


# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Backward passes inside accumulate full gradients locally, without communication; the
    first backward after it reduce-scatters everything accumulated."""
    ctxs = set()
    for unit in units_under(module):
        if unit.ctx is None:
            unit.ctx = UnitContext()
        ctxs.add(unit.ctx)
    for ctx in ctxs:
        ctx.require_sync = False
    try:
        yield
    finally:
        for ctx in ctxs:
            ctx.require_sync = True


def reduce_kept_gradients(module: nn.Module) -> None:
    """Reduce-scatter now the full gradients that backward passes inside `no_sync` kept under
    `module`, into the gradient shards (added to what they hold), without a backward: every
    rank calls it. A no-op where nothing is kept."""
    units = units_under(module)
    for unit in units:
        unit.reduce_kept_gradients()
    for unit in units:
        unit.group.advance_gradients()
    for unit in units:
        unit.group.finish_gradients()
        for buf in unit.buffers:
            buf.wait_grad_copies()


def release(module: nn.Module) -> None:
    """Undo fully_shard's runtime on every unit under `module`: reshard, free gradient and full
    buffers, remove the forward hooks and give each module its own class back (no longer an
    FSDPModule), so nothing of the engine runs or stays allocated."""
    released = set()
    for sub in module.modules():
        unit = unit_of(sub)
        if unit is None:
            continue
        if id(unit) not in released:
            released.add(id(unit))
            unit.reshard()
            for buf in unit.buffers:
                buf.release_grad()
                buf.unreduced.drop_full_grad()
            for p in unit.params:
                p.sharded.grad = None
            for mod, _ in {id(m): (m, n) for p in unit.params
                           for m, n in p.registrations}.values():
                mod.__dict__.pop("reset_parameters", None)
        for hooks, fn in ((sub._forward_pre_hooks, unit.pre_forward),
                          (sub._forward_hooks, unit.post_forward)):
            for handle_id, hook in list(hooks.items()):
                if hook == fn:
                    del hooks[handle_id]
                    sub._forward_pre_hooks_with_kwargs.pop(handle_id, None)
        sub.__dict__.pop("_apply", None)  # fully_shard's guards
        del sub._vescale_unit
        restore_class(sub)
