"""PEFT adapters added to a model that a vescale ZeRO-3 config built on meta (init/zero.py).

`get_peft_model` (and `add_adapter`) create each adapter on a real device with PEFT's own init
(LoRA: kaiming A, zero B), then move it to the device of the layer it adapts. For a deferred
model that device is `meta`, so the values would be dropped and `initialize` could only guess
them. Here, when the base layer is a deferred meta tensor, the adapter stays where it was made and
only takes the base layer's dtype; `fully_shard` plans such a unit on meta and writes the
adapter's values into the shards at allocation (fsdp.ShardedParameter.initial).

Two PEFT functions move adapters; both are wrapped, checked against the installed PEFT once:
- `BaseTunerLayer._move_adapter_to_device_of_base_layer` (every tuner's `update_layer`);
- `BaseTuner._replace_module` and LoRA's override (`module.to(weight.device)` on the new
  layer's adapter modules).
LoRA's `ParamWrapper` (target_parameters) moves its own way: its adapters end on meta and
`initialize` stops naming them, as for any tensor whose values are unknown.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import types

import torch

from ..versions import supported_range
from .record import MARK

__all__ = ["check_peft", "install"]

_WRAPPED = (("peft.tuners.tuners_utils", "BaseTunerLayer", "_move_adapter_to_device_of_base_layer",
             ["self", "adapter_name", "device"]),
            ("peft.tuners.tuners_utils", "BaseTuner", "_replace_module",
             ["self", "parent", "child_name", "new_module", "child"]),
            ("peft.tuners.lora.model", "LoraModel", "_replace_module",
             ["self", "parent", "child_name", "new_module", "child"]))


def _deferred_weight(layer):
    """The layer's weight (PEFT's choice: weight, qweight) if it is a meta tensor a vescale
    zero.Init build made, else None."""
    if isinstance(layer, torch.nn.MultiheadAttention):
        layer = layer.out_proj
    for name in ("weight", "qweight"):
        weight = getattr(layer, name, None)
        if isinstance(weight, torch.Tensor):
            deferred = weight.is_meta and (getattr(weight, MARK, None) is not None or
                                           layer.__dict__.get(MARK) is not None)
            return weight if deferred else None
    return None


def _keep_move_adapter(original):
    @functools.wraps(original)
    def _move_adapter_to_device_of_base_layer(self, adapter_name, device=None):
        weight = _deferred_weight(self.get_base_layer()) if device is None else None
        if weight is None:
            return original(self, adapter_name, device=device)
        # Done here rather than by calling PEFT's with the adapter's own device: PEFT releases
        # before 0.19 read the base weight's dtype only when no device is given.
        _cast_adapter(self, adapter_name, weight.dtype)
    return _move_adapter_to_device_of_base_layer


def _cast_adapter(layer, adapter_name, dtype) -> None:
    """The adapter `adapter_name` of `layer` stays on its device and takes the base layer's
    dtype where that is floating (what PEFT's move does, less the move to meta)."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return
    for attr in layer.adapter_layer_names + layer.other_param_names:
        container = getattr(layer, attr, None)
        # ModuleDict, ParameterDict or PEFT's BufferDict: Modules holding items by name
        if not isinstance(container, torch.nn.Module) or not hasattr(container, "keys") or \
                adapter_name not in container.keys():
            continue
        item = container[adapter_name]
        tensors = [item] if isinstance(item, torch.Tensor) else [*item.parameters(),
                                                               *item.buffers()]
        if any(t.is_meta for t in tensors):
            continue
        if isinstance(item, torch.nn.Module) or item.is_floating_point() or item.is_complex():
            container[adapter_name] = item.to(dtype=dtype)  # a Module casts floating ones only


def _keep_replace_module(original):
    @functools.wraps(original)
    def _replace_module(self, parent, child_name, new_module, child, *args, **kwargs):
        base = getattr(child, "base_layer", child)
        if _deferred_weight(base) is None:
            return original(self, parent, child_name, new_module, child, *args, **kwargs)
        patched = [m for m in new_module.modules() if "_apply" not in m.__dict__]
        for m in patched:  # its moves to meta keep the values (the deferred ones wait anyway)
            m._apply = types.MethodType(_apply_keeping_values, m)
        try:
            return original(self, parent, child_name, new_module, child, *args, **kwargs)
        finally:
            for m in patched:
                m.__dict__.pop("_apply", None)
    return _replace_module


def _apply_keeping_values(self, fn, recurse=True):
    """`_apply` whose moves of real tensors to meta are skipped (dtype casts apply)."""
    def adapted(tensor):
        if tensor.is_meta:
            return fn(tensor)
        probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        if not probe.is_meta:
            return fn(tensor)
        return tensor if probe.dtype == tensor.dtype else tensor.to(probe.dtype)
    return type(self)._apply(self, adapted, recurse)


def check_peft(wrapped=_WRAPPED) -> list:
    """[(class, name, function)] to wrap; an ImportError naming what the installed PEFT lacks."""
    import peft
    found, absent = [], []
    for module_name, cls_name, name, params in wrapped:
        cls = getattr(importlib.import_module(module_name), cls_name, None)
        fn = cls.__dict__.get(name) if cls is not None else None
        if fn is None or list(inspect.signature(fn).parameters)[:len(params)] != params:
            absent.append(f"{module_name}.{cls_name}.{name}({', '.join(params)})")
        else:
            found.append((cls, name, fn))
    if absent:
        raise ImportError(f"vescale keeps PEFT adapters of a deferred model real through "
                          f"{', '.join(absent)}, which peft {peft.__version__} does not have "
                          f"(supported: peft{supported_range('peft')})")
    return found


def install() -> None:
    """Wrap the functions of the module docstring (idempotent)."""
    for cls, name, fn in check_peft():
        if hasattr(fn, "__vescale_original__"):
            continue
        wrapper = _keep_move_adapter(fn) if name.startswith("_move") else \
            _keep_replace_module(fn)
        wrapper.__vescale_original__ = fn
        setattr(cls, name, wrapper)
