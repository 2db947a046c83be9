"""torch, taught the RaggedPlacement where its own Python builds DTensors out of full tensors
(torch 2.11 to 2.15):

- `distribute_tensor` (torch.distributed.tensor, and the name torch's state-dict utilities
  imported): it knows Shard, _StridedShard, Replicate and Partial and raises for any other
  placement, so `set_model_state_dict` / `set_optimizer_state_dict` with
  `full_state_dict=True` and Accelerate's `fsdp2_load_full_state_dict` could not load into
  our parameters. A RaggedPlacement goes to shard.ragged_dtensor.distribute_ragged.
- `_distribute_tensors` (torch.distributed._state_dict_utils): after
  `broadcast_from_rank0=True` broadcast a full tensor, it cuts the rank's box out by Shard
  offsets, which a ragged range is not. Our entries get their range (fill_from_full), torch's
  code does the rest.

Everything else goes to torch's own functions, unchanged. `vescale_engine.fully_shard`
installs this when it is first looked up (the package root), since only our `fully_shard`
makes RaggedDTensors users hand to torch; `unpatch()` undoes it.
"""
from __future__ import annotations

import importlib

__all__ = ["install"]

_MARK = "torch.distributed._state_dict_utils._distribute_tensors"  # the last one installed


def install() -> None:
    """Idempotent; a torch without one of the names raises one line (registry.replace)."""
    from . import registry
    if _MARK in registry.installed():
        return
    tensor_api = importlib.import_module("torch.distributed.tensor")
    tensor_impl = importlib.import_module("torch.distributed.tensor._api")
    sd_utils = importlib.import_module("torch.distributed._state_dict_utils")
    original = tensor_api.distribute_tensor
    for owner in (tensor_api, tensor_impl, sd_utils):
        registry.replace("torch", owner, "distribute_tensor", _distribute_tensor(original),
                         what="needed for full state dicts into RaggedPlacement DTensors")
    registry.replace("torch", sd_utils, "_distribute_tensors",
                     _distribute_tensors(sd_utils._distribute_tensors),
                     what="needed for broadcast_from_rank0 state dicts")


def _distribute_tensor(original):
    from ..shard.ragged_dtensor import distribute_ragged, is_ragged_placements

    def distribute_tensor(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
        if is_ragged_placements(placements):
            if device_mesh is None:
                raise ValueError("distribute_tensor with a RaggedPlacement needs its device_mesh")
            return distribute_ragged(tensor, device_mesh, placements,
                                     src_data_rank=src_data_rank)
        return original(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    distribute_tensor.__doc__ = original.__doc__
    distribute_tensor.__wrapped__ = original
    return distribute_tensor


def _distribute_tensors(original):
    from ..shard.ragged_dtensor import RaggedDTensor, fill_from_full

    def _distribute_tensors(local_state_dict, keys, device, pg=None):
        rest = []
        for key in keys:
            entry = local_state_dict.get(key)
            if isinstance(entry, tuple) and isinstance(entry[0], RaggedDTensor):
                local_state_dict[key] = fill_from_full(entry[0], entry[1].to(device))
            else:
                rest.append(key)
        return original(local_state_dict, rest, device, pg)
    _distribute_tensors.__wrapped__ = original
    return _distribute_tensors
