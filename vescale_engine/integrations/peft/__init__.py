"""PEFT's private methods that move adapters, wrapped so that adapters added to a model a vescale
`deepspeed.zero.Init` built on meta keep their values (integrations/peft/adapters.py says why and does
the work; every other model goes through PEFT's own). Supported: peft versions.SUPPORTED["peft"];
`install` checks every name below (and its leading parameters) and names the version if one
moved.

- `BaseTunerLayer._move_adapter_to_device_of_base_layer` (every tuner's `update_layer`);
- `BaseTuner._replace_module` and LoRA's override (`module.to(weight.device)` on the new
  layer's adapter modules).

Installed by `patch_deepspeed()` when peft is imported, or right after it is first imported.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import types

from ...versions import supported_range
from ..registry import replace
from .adapters import apply_keeping_values, cast_adapter, deferred_weight

__all__ = ["check_peft", "install"]

_WRAPPED = (("peft.tuners.tuners_utils", "BaseTunerLayer", "_move_adapter_to_device_of_base_layer",
             ["self", "adapter_name", "device"]),
            ("peft.tuners.tuners_utils", "BaseTuner", "_replace_module",
             ["self", "parent", "child_name", "new_module", "child"]),
            ("peft.tuners.lora.model", "LoraModel", "_replace_module",
             ["self", "parent", "child_name", "new_module", "child"]))


def _keep_move_adapter(original):
    @functools.wraps(original)
    def _move_adapter_to_device_of_base_layer(self, adapter_name, device=None):
        weight = deferred_weight(self.get_base_layer()) if device is None else None
        if weight is None:
            return original(self, adapter_name, device=device)
        # Done here rather than by calling PEFT's with the adapter's own device: PEFT releases
        # before 0.19 read the base weight's dtype only when no device is given.
        cast_adapter(self, adapter_name, weight.dtype)
    return _move_adapter_to_device_of_base_layer


def _keep_replace_module(original):
    @functools.wraps(original)
    def _replace_module(self, parent, child_name, new_module, child, *args, **kwargs):
        base = getattr(child, "base_layer", child)
        if deferred_weight(base) is None:
            return original(self, parent, child_name, new_module, child, *args, **kwargs)
        patched = [m for m in new_module.modules() if "_apply" not in m.__dict__]
        for m in patched:  # its moves to meta keep the values (the deferred ones wait anyway)
            m._apply = types.MethodType(apply_keeping_values, m)
        try:
            return original(self, parent, child_name, new_module, child, *args, **kwargs)
        finally:
            for m in patched:
                m.__dict__.pop("_apply", None)
    return _replace_module


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
    """Wrap the methods of the module docstring (idempotent)."""
    for cls, name, fn in check_peft():
        if hasattr(fn, "__vescale_original__"):
            continue
        wrapper = _keep_move_adapter(fn) if name.startswith("_move") else \
            _keep_replace_module(fn)
        wrapper.__vescale_original__ = fn
        replace("peft", cls, name, wrapper)
