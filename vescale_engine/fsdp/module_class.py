"""The class of a module `fully_shard` wrapped: a `torch.distributed.fsdp.FSDPModule`, as FSDP2
makes it, whose methods act on our FSDPUnit.

FSDP2 swaps `module.__class__` for a class made on the fly from (FSDPModule, the original
class); so does `fully_shard` here, with `VeScaleFSDPModule` (an FSDPModule whose methods read
`module._vescale_unit` instead of FSDP2's state) in front of the original class. So
`isinstance(m, torch.distributed.fsdp.FSDPModule)` holds and code written for FSDP2 finds its
methods. One difference on purpose: the class keeps the original's `__name__`, `__qualname__`
and `__module__` (FSDP2 prefixes "FSDP"), so `type(m).__name__`, `repr(m)` and the libraries
that match class names (transformers' `_no_split_modules`, its causal-LM label shift, the
architectures `save_pretrained` writes) see the model they built. `release` (fsdp/api.py)
gives the module its original class back.

Every public method of torch's FSDPModule is defined here: what FSDP2 does with it, done on
the unit, or NotImplementedError naming the method and why (tests/core/fsdp/test_fsdp_module.py
checks that none is left to torch's, which would look for FSDP2's state).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed.fsdp
from torch import nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from .guards import apply_caller
from .lookup import unit_of, units_under
from .unit import reset_iteration

__all__ = ["VeScaleFSDPModule", "FSDPState", "to_fsdp_class", "restore_class", "original_class",
           "register_fsdp_forward_method"]

_CLASSES: dict = {}  # original class -> its VeScaleFSDPModule class


def to_fsdp_class(module: nn.Module) -> None:
    """Give `module` the FSDPModule class made from its own (one class per original class)."""
    cls = type(module)
    if isinstance(module, VeScaleFSDPModule):
        return
    made = _CLASSES.get(cls)
    if made is None:
        made = type(cls.__name__, (VeScaleFSDPModule, cls),
                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                     "_vescale_original_class": cls, "__doc__": cls.__doc__})
        _CLASSES[cls] = made
    module.__class__ = made


def original_class(module_or_class) -> type:
    """The class a module had before fully_shard (its own class if it was not wrapped)."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return cls.__dict__.get("_vescale_original_class", cls)


def restore_class(module: nn.Module) -> None:
    module.__class__ = original_class(module)


class _Handle(UnshardHandle):
    """FSDP2's UnshardHandle: wait() finishes the unit's all-gather and registers the
    full-shape parameters."""

    def __init__(self, unit):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_unshard()
            self._unit = None


class _GradientReductionHandle(getattr(torch.distributed.fsdp, "GradientReductionHandle",
                                       object)):
    """FSDP2's handle of an asynchronous finalize_backward (torch 2.15): nothing to wait for."""

    def wait(self) -> None:
        return None


class FSDPState:
    """What torch's `register_fsdp_forward_method` reads from `_get_fsdp_state()` (and
    `fully_shard.state(module)` returns): the unit's forward hooks. Anything else FSDP2's code
    might read is not there, by name."""

    def __init__(self, unit):
        self._unit = unit

    def _pre_forward(self, module, args, kwargs):
        return self._unit.pre_forward(module, args, kwargs)

    def _post_forward(self, module, args, output):
        return self._unit.post_forward(module, args, output)

    def __getattr__(self, name):
        raise AttributeError(f"FSDP2's internal state ({name}) does not exist for a module "
                             "that vescale_engine's fully_shard wrapped")


# (helpers outside the class: a class attribute would hide a user's submodule of that name)
def _unit(module):
    unit = unit_of(module)
    if unit is None:
        raise RuntimeError(f"{type(module).__name__} has no fully_shard unit (released?)")
    return unit


def _units(module, recurse: bool):
    return units_under(module) if recurse else [_unit(module)]


def _refuse(method: str, why: str):
    raise NotImplementedError(f"FSDPModule.{method} is not supported by vescale_engine's "
                              f"fully_shard: {why}")


class VeScaleFSDPModule(FSDPModule):
    # FSDPModule.__new__ builds the original class from cls.__mro__[this]:
    # [made class, VeScaleFSDPModule, FSDPModule, original, ...]
    _orig_cls_mro_index = 3

    # -- parameters ------------------------------------------------------------------------------

    def reshard(self) -> None:
        """Free the full parameters and register the sharded ones (not recursive)."""
        _unit(self).reshard()

    def unshard(self, async_op: bool = False):
        """All-gather this module's parameters and register them at full shape (not
        recursive). `async_op=True`: a handle whose wait() finishes it (the module's forward
        waits for it too). They stay unsharded until its forward reshards them, or reshard()."""
        unit = _unit(self)
        unit._keep = True
        unit.unshard(async_op=True)
        handle = _Handle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: on the root, reshard everything, discard
        the failed iteration's gradients not yet in a gradient shard (reduce-scatters in
        flight, no_sync accumulation, HSDP partial sums) and start the next iteration clean."""
        unit = _unit(self)
        if unit.ctx is not None and not unit.is_root:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        reset_iteration(units_under(self))

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """True: resharding keeps the full buffers' storage (the parameters switch to their
        sharded faces; the next unshard gathers into the same memory, so the full
        parameters' data pointers stay put, as CUDA graph capture wants), at the cost of
        holding it between steps. False (default): resharding frees it."""
        for unit in _units(self, recurse):
            for buf in unit.buffers:
                buf.keep_full_storage = bool(keep)

    # -- gradients -----------------------------------------------------------------------------

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """torch 2.15's FSDP2: whether the caller finalizes backward (finalize_backward). Each
        backward here finalizes its own reductions and resharding (False, the default)."""
        unit = _unit(self)
        if unit.ctx is not None and not unit.is_root:
            raise RuntimeError("set_manual_backward_finalization must be called on the root "
                               "FSDP module")
        if enabled:
            _refuse("set_manual_backward_finalization", "every backward finalizes its own "
                    "gradient reductions and resharding before it returns; several backward "
                    "passes before one finalization need set_requires_gradient_sync(False) "
                    "on all but the last instead")

    def finalize_backward(self, *, async_op: bool = False):
        """torch 2.15's FSDP2: finalize a backward run under manual finalization, which is
        refused here (set_manual_backward_finalization), so as FSDP2 without it: nothing to do
        before the first forward, an error after it."""
        if _unit(self).ctx is not None:
            raise RuntimeError("FSDP finalize_backward requires manual backward finalization. "
                               "Call set_manual_backward_finalization(True) before forward")
        return _GradientReductionHandle() if async_op else None


    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward keeps full gradients unreduced (no collective), as no_sync; the
        next backward with True reduce-scatters what was kept. HSDP: the all-reduce too."""
        for unit in _units(self, recurse):
            unit.switches.requires_gradient_sync = bool(requires_gradient_sync)
            unit.switches.requires_all_reduce = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but skips the replicas' all-reduce; the outputs add up
        until a backward with True all-reduces their sum into the gradient shard. No effect
        without replicas, as in FSDP2."""
        for unit in _units(self, recurse):
            unit.switches.requires_all_reduce = bool(requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2 lets the last reductions of a backward run on into the next micro-batch when
        False. Every backward here finishes its reductions before it returns (what True
        asks), so the flag changes no result; it is kept for code that reads it back."""
        for unit in units_under(self):
            unit.switches.is_last_backward = bool(is_last_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of the number of ranks (this
        module's unit, not recursive)."""
        _unit(self).set_gradient_divide_factor(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2: set_gradient_divide_factor."""
        warnings.warn("Use `set_gradient_divide_factor` instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only SUM in the collectives and one divide after, even where the backend averages
        (NCCL); not recursive, as FSDP2."""
        _unit(self).set_force_sum(bool(enable))

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        _refuse("set_reduce_scatter_unused_params",
                "a unit always reduce-scatters its whole buffers, so a parameter no forward "
                "used gets a zero gradient where its unit ran (never None, as False gives), "
                "and every rank must run the same units (docs/architecture.md), so a unit "
                "skipped on some ranks is not reduced with zeros either (as True gives)")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError("max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        if max_input_buffers != 1:
            _refuse("set_reduce_scatter_max_input_buffers",
                    f"{max_input_buffers} reduce-scatters in flight; one is (FSDP2's default)")

    # -- resharding ----------------------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """Whether forward frees the full parameters (the root's too once set explicitly)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward)}")
        for unit in _units(self, recurse):
            unit.switches.reshard_after_forward = reshard_after_forward
            unit.switches.auto_reshard_after_forward = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: the unit stays unsharded from its backward to its next forward (no
        all-gather there; gradient accumulation). Its full parameters are then those of that
        backward: reshard() (or True before the last micro-batch) before the optimizer step
        and the forward after it, as with FSDP2."""
        for unit in _units(self, recurse):
            unit.switches.reshard_after_backward = bool(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not all-gather this unit (its backward reads none of its
        parameters, e.g. an embedding); its gradients are computed and reduced as usual."""
        _unit(self).switches.unshard_in_backward = bool(unshard_in_backward)

    # -- prefetching ---------------------------------------------------------------------------

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """This module's forward issues these modules' all-gathers (instead of the next unit
        of the last forward's order)."""
        _unit(self).switches.forward_prefetch = _units_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """This module's backward issues these modules' all-gathers (instead of the unit
        before it in forward order)."""
        _unit(self).switches.backward_prefetch = _units_of(modules)

    def _set_unshard_async_op(self, async_op: bool):
        """FSDP2's private switch for all-gathers on the compute stream: ours always issue
        there (one stream) and wait in the pre-forward, whatever the value."""

    # -- streams and events --------------------------------------------------------------------

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next forward waits for `event` (recorded after the optimizer step)
        before its first all-gather, then drops it. On CPU there are no streams to wait on
        and FSDP2 does nothing with it either; it is dropped the same way."""
        _unit(self).switches.post_optim_event = event

    # -- communication FSDP2 lets users replace: refused ---------------------------------------

    def set_custom_all_gather(self, comm) -> None:
        _refuse("set_custom_all_gather", "the all-gather writes in place into the unit's "
                "DBuffer (shard/collectives.py), not into a buffer a Comm allocates")

    def set_custom_reduce_scatter(self, comm) -> None:
        _refuse("set_custom_reduce_scatter", "the reduce-scatter reads the unit's DBuffer in "
                "place (shard/collectives.py), not a buffer a Comm allocates")

    def set_all_reduce_hook(self, hook, *, stream=None):
        _refuse("set_all_reduce_hook", "no user hook runs on the reduced gradients; HSDP's "
                "all-reduce is built in (a 2-D mesh)")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        if enable:
            _refuse("set_separate_reduce_scatter_group", "all-gather and reduce-scatter run "
                    "on the unit's one shard group")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        if enable:
            _refuse("set_allocate_memory_from_process_group_for_comm", "the collectives work "
                    "in place on the unit's DBuffers; there are no staging buffers to allocate")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _refuse("set_symm_mem_for_comm", "the collectives work in place on the unit's "
                "DBuffers; there are no staging buffers in symmetric memory")

    # -- torch's hooks into FSDP2's state ------------------------------------------------------

    def _get_fsdp_state(self):
        """For torch's register_fsdp_forward_method, which calls the state's forward hooks."""
        return FSDPState(_unit(self))

    def _apply(self, fn, recurse=True):
        """`to_empty(device=...)` on a unit still on meta gives its shards real (uninitialized)
        storage on that device, the same Parameter objects; then `reset_parameters()` on each
        module initializes (fsdp/materialize.py, `install_full_shape_reset`). Other moves and
        casts are fsdp/guards.py's (checked before this runs)."""
        if apply_caller(fn) == "to_empty":
            units = [u for u in units_under(self) if u.is_meta]
            if units:
                device = fn(torch.empty(0, device="meta")).device
                for unit in units:
                    unit.group.allocate(device)
                managed = {id(t) for u in units_under(self) for p in u.params
                           for t in (p.sharded, p.sharded.grad) if t is not None}
                fn = _keeping(managed, fn)
        return super(FSDPModule, self)._apply(fn, recurse)

    def __deepcopy__(self, memo):
        raise AssertionError(f"{type(self).__name__} is sharded by fully_shard and cannot be deep-"
                        "copied (its parameters are pieces of buffers shared across ranks); "
                        "copy the unsharded model, or its full_state_dict (FSDP does not "
                        "support deepcopy either)")


def _keeping(managed: set, fn):
    """`fn` for every tensor but the managed ones, which stay as they are."""
    def keep(t):
        return t if id(t) in managed else fn(t)
    keep.__qualname__ = getattr(fn, "__qualname__", "keep")  # (the guard names the caller)
    return keep


def _units_of(modules) -> list:
    units = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
        unit = unit_of(module)
        if unit is None:
            raise ValueError(f"{type(module).__name__} was wrapped by torch's fully_shard, not "
                             "vescale_engine's: the two cannot prefetch each other")
        units.append(unit)
    return units


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` (e.g. "generate") unshard before and reshard after as
    forward does, as FSDP2's function of the same name (which works on our modules too); a
    module fully_shard did not wrap is left alone."""
    if unit_of(module) is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)
    unit = unit_of(module)

    def wrapped(*args, **kwargs):
        args, kwargs = unit.pre_forward(module, args, kwargs)
        return unit.post_forward(module, args, method(*args, **kwargs))
    wrapped.__wrapped__ = method
    wrapped.__name__ = getattr(method, "__name__", method_name)
    wrapped.__doc__ = getattr(method, "__doc__", None)
    setattr(module, method_name, wrapped)
