"""Guards on a sharded module: moves and casts that would cut parameters off from their
DBuffers, torchtitan's `init_weights` on flat pieces, and what must hold before values are
used on a model built on the meta device (nothing left there). (`reset_parameters` works on a
sharded module: fsdp/materialize.py runs it at full shape.)"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .lookup import sharded_parameters, units_under
from .param import sharding_of

__all__ = ["DEFERRED_MARK", "guard_apply", "apply_caller", "is_deferred", "meta_leftovers",
           "require_materialized", "take_assignments", "guard_init_weights",
           "held_as_pieces"]


# ---------------------------------------------------------------------------------------------
# Moves and casts of a sharded module.

def guard_apply(module: nn.Module) -> None:
    """Route `module._apply` (behind .to/.cuda/.half/.float/.to_empty/...) through a check:
    torch would replace each parameter's data with a new tensor, silently cutting it off from
    its DBuffer. A call that leaves every managed parameter as it is (`.to` its own device and
    dtype, `.float()` on fp32) still runs, and so does `to_empty` on shards still on meta (the
    module's class gives them storage: fsdp/module_class.py); a cast to another floating dtype
    casts the shards (FSDP2's `model.to(dtype)` after sharding: ParamGroup.cast); anything else
    raises before touching the module."""
    module._apply = types.MethodType(_guarded_apply, module)  # parents' recursion calls it too


def _guarded_apply(self, fn, recurse=True):
    dtype = _cast_of(self, fn)
    if dtype is not None:  # FSDP2's module.to(dtype) after sharding: the shards are cast
        _cast_units(self, dtype)
    else:
        _check_apply(self, fn)
    # Every managed parameter is left as it is, but torch swaps a DTensor-subclass parameter for
    # a new Parameter even then (losing `_vescale`, what ties it to its buffer): the sharded
    # faces sit the recursion out, their slots None (which _apply skips) so the order stays.
    held = [(module, name, p.sharded) for _, p in sharded_parameters(self)
            for module, name in p.registrations
            if module._parameters.get(name) is p.sharded]
    for module, name, _ in held:
        module._parameters[name] = None
    try:
        return type(self)._apply(self, fn, recurse)
    finally:
        for module, name, param in held:
            module._parameters[name] = param


def _cast_of(module, fn):
    """The floating dtype `fn` casts every managed parameter to, on its own device (`.to(dtype)`,
    `.double()`, `.half()`, ...); None for anything else (a move, a no-op, mixed targets), and
    where the cast is refused (_check_apply): parameters still on meta (materialize first) or
    the engine's plain pieces (its config sets the dtypes; its optimizer holds the master)."""
    targets = set()
    for _, p in sharded_parameters(module):
        before = p.sharded
        if before.is_meta or not p.unit.sharding.face.global_shape:
            return None
        try:  # an empty tensor like it answers what fn does to a tensor of its dtype and device
            after = fn(torch.empty(0, dtype=before.dtype, device=before.device))
        except Exception:
            return None
        if after.device != before.device or not after.dtype.is_floating_point:
            return None
        targets.add((before.dtype, after.dtype))
    dtypes = {after for before, after in targets}
    if len(dtypes) != 1 or all(before == after for before, after in targets):
        return None
    return dtypes.pop()


def _cast_units(module, dtype) -> None:
    """Every unit under `module` cast, each checked first (a unit reaching outside `module`,
    one that cannot be cast now): one line before any unit changes."""
    inside = {id(m) for m in module.modules()}
    units = units_under(module)
    for unit in units:
        outside = [m for m in unit.modules if id(m) not in inside]
        if outside:
            raise RuntimeError(f"{type(module).__name__}.to({dtype}): unit {unit.name} also holds "
                               f"{type(outside[0]).__name__}, which is not under it; cast the "
                               "module that holds every module of the unit")
    for unit in units:
        unit.group.cast(dtype, unit.mp_policy)


def _check_apply(module, fn):
    call = apply_caller(fn)
    for _, p in sharded_parameters(module):
        before = p.sharded
        if call == "to_empty" and before.is_meta:
            continue  # storage for the shards: fsdp/module_class.py's _apply gives it
        try:
            with torch.no_grad():
                after = fn(before)
        except Exception as err:  # e.g. .cuda() on a CPU-only build: still not a no-op
            kind = "to_empty" if before.is_meta else "move"
            raise RuntimeError(_apply_error(module, call, kind)) from err
        if after is before:
            continue
        kind = "to_empty" if call == "to_empty" or before.is_meta else \
            "cast" if after.dtype != before.dtype else "move"
        raise RuntimeError(_apply_error(module, call, kind))


def apply_caller(fn) -> str:
    """The nn.Module method that made `fn` ('to', 'cuda', 'half', ...), from its qualname."""
    parts = getattr(fn, "__qualname__", "").split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "Module" else "_apply"


def _apply_error(module, call, kind) -> str:
    what = {"move": "build or move the model before fully_shard/initialize (initialize puts it "
                    "on the rank's device)",
            "cast": "the fp32 master stays fp32; set the compute dtype with MixedPrecisionPolicy "
                    "(param_dtype) or the bf16/fp16 config",
            "to_empty": "for a model built on the meta device call "
                        "vescale_engine.materialize(model) (storage and init, shard by shard) or "
                        "vescale_engine.materialize.allocate_shards(model) (storage only, e.g. "
                        "before load_hf_checkpoint)"}[kind]
    return (f"{type(module).__name__}.{call}(...) on a module sharded by fully_shard would detach "
            f"its parameters from their sharded buffers: {what}")


# ---------------------------------------------------------------------------------------------
# Deferred (meta-device) initialization: what must hold before values are used.

DEFERRED_MARK = "_vescale_deferred"  # deferred.py's record: set on what a deferred build made


def is_deferred(param, registrations) -> bool:
    """A meta parameter that a vescale `deepspeed.zero.Init` build made (or a copy of one of
    its modules made, as PEFT's modules_to_save): its values come at initialize."""
    return getattr(param, DEFERRED_MARK, None) is not None or \
        any(module.__dict__.get(DEFERRED_MARK) is not None for module, _ in registrations)


def meta_leftovers(module: nn.Module) -> list:
    """Names (as `module.state_dict` would say them) of the managed parameters and the module
    buffers under `module` that are still on the meta device."""
    left = [fqn for fqn, p in sharded_parameters(module) if p.buffer.is_meta]
    managed = {id(p.sharded) for _, p in sharded_parameters(module)}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.is_meta and id(param) not in managed:
            left.append(name)
    left += [name for name, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
    return left


def require_materialized(module: nn.Module, when: str) -> None:
    left = meta_leftovers(module)
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise RuntimeError(f"{left[0]}{more} is still on the meta device at {when}: call "
                           "vescale_engine.materialize(model) (or load_hf_checkpoint) first")


def take_assignments() -> None:
    """A parameter assigned in place of a managed one (`model.w = nn.Parameter(t)` after
    fully_shard: an init computed from other weights, a module's own re-init) would be replaced
    by our face at the next unshard and its values dropped, silently. As FSDP2 takes what a
    module holds into its sharded parameters, torch's parameter-registration hook (every
    `register_parameter`, which attribute assignment and `load_state_dict(assign=True)` use)
    takes the values into the shard and registers our sharded parameter instead, so
    `model.parameters()` and an optimizer made afterwards see ours. A unit still on meta keeps
    the values (ShardedParameter.initial) and takes storage on their device once every one of
    its parameters has one, or when it is materialized. Installed once, by fully_shard."""
    global _TAKING
    if _TAKING is None:
        _TAKING = nn.modules.module.register_module_parameter_registration_hook(_take_assigned)


_TAKING = None


def _take_assigned(module, name, param):
    current = module._parameters.get(name)
    p = sharding_of(current) or getattr(current, "_vescale_full", None)
    if p is None or param is None or not _foreign(param, p):
        return None
    if current is p.full_face:
        raise RuntimeError(f"{type(module).__name__}.{name} ({p.fqn}) was assigned while its "
                           f"fully_shard unit ({p.unit.name}) holds it unsharded (inside a "
                           "forward or before its backward): assign it between steps")
    where = f"{type(module).__name__}.{name}"
    values = assigned_piece(p, where, param, "an assignment")
    with torch.no_grad():
        whole = param.detach().to_local() if isinstance(param, DTensor) else param.detach()
        if p.buffer.is_meta and tuple(whole.shape) == tuple(p.shape):
            p.initial = whole  # kept until the unit has storage (allocate writes it)
            if all(q.initial is not None for q in p.unit.params):
                p.unit.group.allocate(values.device)
        else:  # (this rank's piece of a unit on meta: a sharded state dict's, as Accelerate's
            if p.buffer.is_meta:  # cpu_ram_efficient_loading assigns every one of them)
                p.unit.group.allocate(values.device)
            p.local().copy_(values)
    if p.sharded.requires_grad != param.requires_grad:
        p.sharded.requires_grad_(param.requires_grad)
    return p.sharded


def _foreign(current, p) -> bool:
    """`current` is a tensor of the user's, not a face of `p` or of another managed parameter
    (a weight tied again after sharding stays as the unit's registrations say)."""
    return current is not None and sharding_of(current) is None and \
        getattr(current, "_vescale_full", None) is None


def assigned_piece(p, where: str, value, how: str) -> torch.Tensor:
    """This rank's flat range of a tensor put in place of managed parameter `p` (by `how`): a
    RaggedDTensor of its layout, or a whole tensor of its shape (plain, or a DTensor every
    rank holds whole: Replicate, as torch's ops on sharded parameters often return). Anything
    else is refused before anything changed."""
    from torch.distributed.tensor import Replicate
    from ..shard.ragged_dtensor import RaggedDTensor
    if isinstance(value, DTensor) and not isinstance(value, RaggedDTensor) and \
            all(isinstance(x, Replicate) for x in value.placements):
        value = value.to_local()
    if isinstance(value, RaggedDTensor) and isinstance(p.sharded, RaggedDTensor):
        if value.placements == p.sharded.placements and value.shape == p.sharded.shape:
            piece = value._local_tensor
            if not piece.is_meta:
                return piece
    elif not isinstance(value, DTensor) and tuple(value.shape) == tuple(p.shape) and \
            not value.is_meta:
        start, end = p.flat_range
        return value.detach().reshape(-1)[start:end]
    what = f"{type(value).__name__} {list(value.shape)}" + \
        (f" {list(value.placements)}" if isinstance(value, DTensor) else "") + \
        (" on meta" if value.is_meta else "")
    raise ValueError(f"{how}: {where} ({p.fqn} in its fully_shard unit) was given a {what}; a "
                     "fully_shard parameter takes its own layout's DTensor "
                     f"({list(getattr(p.sharded, 'placements', []))}) or a whole tensor of shape "
                     f"{list(p.shape)} with values")


def _is_piece(param) -> bool:
    """A managed parameter as held between steps: a RaggedDTensor over this rank's piece (its
    shape is the global one, but its values are not all here), or a plain 1-D piece."""
    sp = sharding_of(param)
    return sp is not None and param is sp.sharded and \
        (isinstance(param, DTensor) or tuple(param.shape) != tuple(sp.shape))


def held_as_pieces(module: nn.Module) -> list:
    """Names of `module`'s own managed parameters it holds as pieces of the shard (between
    steps), not at full shape."""
    return [name for name, param in module._parameters.items() if _is_piece(param)]


def guard_init_weights(module: nn.Module) -> None:
    """torchtitan's convention: build on meta, shard, then `model.init_weights()`. On
    RaggedDTensor parameters (fully_shard's default) it runs as written: nn.init's fills draw
    at full shape (shard/ragged_ops.py) and each module's `reset_parameters` runs at full
    shape (materialize.install_full_shape_reset), so the values are an unsharded model's from
    the same seed. On plain flat pieces (the DeepSpeed face, the engine's) the call would
    draw each piece as if it were a whole tensor (wrong std from wrong fans, the same numbers
    on every rank), silently: routed through a check naming what to call instead; it runs as
    usual at full shape. Hugging Face models are left alone: their `init_weights` is part of
    their own build."""
    is_pretrained = callable(getattr(type(module), "_initialize_weights", None))
    if callable(getattr(type(module), "init_weights", None)) and not is_pretrained and \
            "init_weights" not in module.__dict__:
        module.init_weights = types.MethodType(_guarded_init_weights, module)


def _guarded_init_weights(self, *args, **kwargs):
    flat = next((name for name, p in self.named_parameters()
                 if _is_piece(p) and not isinstance(p, DTensor)), None)
    if flat is not None:
        raise RuntimeError(
            f"{type(self).__name__}.init_weights(): {flat} is a flat piece of the sharded master "
            "between steps, not a full tensor, so the init would draw wrong values; run it at "
            "full shape inside `with vescale_engine.gathered_parameters(model, writeback=True):` "
            "(every rank holds the whole model meanwhile), or give vescale_engine.materialize("
            "model, init_fn=...) a per-module init (docs/big_models.md)")
    return type(self).init_weights(self, *args, **kwargs)
