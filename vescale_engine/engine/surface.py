"""What Hugging Face Trainer and Accelerate call on a DeepSpeed engine besides the training loop,
with DeepSpeed's meaning: the accumulation boundary they set, the ZeRO-3 queries, the full 16-bit
state dict gathered to rank 0 and `save_16bit_model`, and attribute forwarding to the model
(DeepSpeedEngine.__getattr__). `VeScaleEngine` inherits it, so engine.py stays glue.

The engine using it provides `module`, `config` (the config dict), `engine_config` (typed) and
`global_steps`.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from ..fsdp.state_dict import gather_to_rank0

__all__ = ["DeepSpeedSurface"]

LOG = logging.getLogger("vescale_engine")

class DeepSpeedSurface:
    # -- gradient accumulation ------------------------------------------------------------------

    def set_gradient_accumulation_boundary(self, is_boundary: bool):
        """DeepSpeed's override: from now on `is_boundary` decides, instead of the micro-step
        count, whether step() takes an optimizer step, whether this micro-step's gradients are
        reduced (vescale.local_grad_accumulation) and what is_gradient_accumulation_boundary()
        says. Accelerate sets it before every backward and calls step() only at boundaries."""
        self._boundary = bool(is_boundary)

    # -- ZeRO queries ---------------------------------------------------------------------------

    def zero_optimization_stage(self) -> int:
        return self.engine_config.zero_stage

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save (or a name DeepSpeed
        accepts for it); false when absent, as in DeepSpeed."""
        return self.engine_config.checkpointing.gather_16bit_weights_on_model_save

    # -- the full model in 16 bits --------------------------------------------------------------

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False) -> dict:
        """The model's full state dict on global rank 0 ({} on the other ranks), keys as
        `module.state_dict()` (tied names share one tensor), on the host, floating tensors in
        the compute dtype (bf16/fp16 when enabled, else fp32), as DeepSpeed's. Collective: every
        rank calls it. One DBuffer is gathered at a time, so no rank ever holds the whole model
        on its device; rank 0 holds it on the host, as DeepSpeed's does. Under TP/EP the values
        are the global tensors (every rank's pieces placed on them: gather_to_rank0)."""
        self.require_global_layout("the 16-bit state dict")
        out = OrderedDict()
        for names, source, value in gather_to_rank0(self.module, self._compute_dtype()):
            if exclude_frozen_parameters and isinstance(source, nn.Parameter) and \
                    not source.requires_grad:
                continue
            for name in names:
                out[name] = value
        return out if dist.get_rank() == 0 else {}

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters=False) -> dict:
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False) -> bool:
        """DeepSpeed's: when zero_optimization.stage3_gather_16bit_weights_on_model_save is
        true, rank 0 writes the consolidated state dict to save_dir/save_filename (torch.save)
        and it returns True on every rank; otherwise nothing is written and it returns False.
        Collective."""
        path = os.path.join(os.fspath(save_dir), save_filename)
        if not self.zero_gather_16bit_weights_on_model_save():
            if dist.get_rank() == 0:
                LOG.info("did not save the model %s: zero_optimization."
                         "stage3_gather_16bit_weights_on_model_save is false", path)
            return False
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if dist.get_rank() == 0:
            os.makedirs(os.fspath(save_dir), exist_ok=True)
            torch.save(state, f"{path}.tmp")
            os.replace(f"{path}.tmp", path)
        dist.barrier()  # nobody returns before the file is there
        return True

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin") -> bool:
        """DeepSpeed's old name for save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def _compute_dtype(self):
        name = self.engine_config.precision.param_dtype
        return getattr(torch, name) if name else None

    # -- attribute forwarding -------------------------------------------------------------------

    def __getattr__(self, name):
        """As DeepSpeedEngine: an attribute the engine does not have is looked up on the
        model (`engine.generate`, `engine.gradient_checkpointing_enable`, ...)."""
        try:
            return super().__getattr__(name)  # nn.Module: parameters, buffers, submodules
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        owner = f", and neither has its module ({type(module).__name__})" \
            if module is not None else ""
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'{owner}")
