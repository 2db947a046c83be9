"""PEFT adapters added to a model that a vescale ZeRO-3 config built on meta (integrations/deepspeed/zero_init.py).

`get_peft_model` (and `add_adapter`) create each adapter on a real device with PEFT's own init
(LoRA: kaiming A, zero B), then move it to the device of the layer it adapts. For a deferred
model that device is `meta`, so the values would be dropped and `initialize` could only guess
them. Here, when the base layer is a deferred meta tensor, the adapter stays where it was made and
only takes the base layer's dtype; `fully_shard` plans such a unit on meta and writes the
adapter's values into the shards at allocation (fsdp.ShardedParameter.initial).

Two PEFT functions move adapters; vescale_engine/integrations/peft/__init__.py wraps both (checked
against the installed PEFT), calling the functions here:
- `BaseTunerLayer._move_adapter_to_device_of_base_layer` (every tuner's `update_layer`);
- `BaseTuner._replace_module` and LoRA's override (`module.to(weight.device)` on the new
  layer's adapter modules).
LoRA's `ParamWrapper` (target_parameters) moves its own way: its adapters end on meta and
`initialize` stops naming them, as for any tensor whose values are unknown.
"""
from __future__ import annotations

import torch

from ...fsdp.deferred import deferred_of

__all__ = ["deferred_weight", "cast_adapter", "apply_keeping_values"]


def deferred_weight(layer):
    """The layer's weight (PEFT's choice: weight, qweight) if it is a meta tensor a vescale
    zero.Init build made, else None."""
    if isinstance(layer, torch.nn.MultiheadAttention):
        layer = layer.out_proj
    for name in ("weight", "qweight"):
        weight = getattr(layer, name, None)
        if isinstance(weight, torch.Tensor):
            deferred = weight.is_meta and (deferred_of(weight) is not None or
                                           deferred_of(layer) is not None)
            return weight if deferred else None
    return None


def cast_adapter(layer, adapter_name, dtype) -> None:
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


def apply_keeping_values(self, fn, recurse=True):
    """`_apply` whose moves of real tensors to meta are skipped (dtype casts apply)."""
    def adapted(tensor):
        if tensor.is_meta:
            return fn(tensor)
        probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        if not probe.is_meta:
            return fn(tensor)
        return tensor if probe.dtype == tensor.dtype else tensor.to(probe.dtype)
    return type(self)._apply(self, adapted, recurse)
