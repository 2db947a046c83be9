"""Accelerate's names, patched so that it handles our engine as it handles DeepSpeed's.
Supported: accelerate versions.SUPPORTED["accelerate"]; `install` checks each name below
before replacing it. Nothing to do without Accelerate.

- `accelerate.utils.other.extract_model_from_parallel` (behind `accelerator.unwrap_model`,
  transformers' unwrap_model and Trainer's label smoothing, which asks the unwrapped model its
  class) recognises DeepSpeedEngine only: ours is unwrapped first, then Accelerate's own runs.
  Every module imported by then that holds the function by name gets the new one too (each
  recorded, so `unpatch` restores it there).
- `Accelerator.get_state_dict(engine)` (behind Trainer.save_model) gathers the full model to
  rank 0 for our engine at every ZeRO stage. Accelerate gathers only at stage 3 and otherwise
  reads the unwrapped model's state_dict(), which for our engine (parameters are sharded at
  every stage) holds each rank's flat pieces.

`patch_fsdp2()` (integrations/__init__.py) installs one more, and only it:

- `fsdp2_prepare_model(accelerator, model)` (behind `Accelerator.prepare` for an FSDP plugin
  with `fsdp_version=2`, and so behind Trainer's `fsdp_config={"fsdp_version": 2}`) wraps
  with `vescale_engine.fully_shard` instead of torch's. Accelerate imports torch's inside the
  function (`from torch.distributed.fsdp import ... fully_shard`, looked up at each call), so
  the wrapper puts ours in `torch.distributed.fsdp.fully_shard` for the duration of that one
  call and torch's back after: the rest of the process (a user's own `fully_shard`, TRL,
  transformers) keeps torch's. Everything else of Accelerate's FSDP2 path (its wrap policy,
  which units and with what arguments, `clip_grad_norm_`, `get_state_dict`, the optimizer's
  parameter swap) runs as it is on our FSDPModules and DTensor parameters. Replaced in every
  module that holds the function by name (accelerate.accelerator, accelerate.utils), as
  `extract_model_from_parallel` above.
"""
from __future__ import annotations

import functools
import sys

from .registry import missing_name, replace

__all__ = ["install", "patch_accelerate_unwrap", "patch_accelerate_state_dict",
           "patch_accelerate_fsdp2"]


def install() -> None:
    """Both patches (idempotent)."""
    patch_accelerate_unwrap()
    patch_accelerate_state_dict()


def _rebind_everywhere(original, new, name: str) -> None:
    """`name` -> `new` in every module imported now that holds `original` under that name
    (each recorded for `unpatch`); modules imported later import the new one."""
    for module in list(sys.modules.values()):
        # __dict__, not getattr: lazy modules (transformers) import nothing here
        if getattr(module, "__dict__", {}).get(name) is original:
            replace("accelerate", module, name, new)


def patch_accelerate_unwrap() -> None:
    """`accelerator.unwrap_model(engine)` returns the model (see the module docstring)."""
    try:
        import accelerate  # noqa: F401
        import accelerate.utils.other as other
    except ImportError:
        return
    original = getattr(other, "extract_model_from_parallel", None)
    if original is None:
        replace("accelerate", other, "extract_model_from_parallel", None,
                what="vescale_engine.patch_deepspeed() cannot make accelerator.unwrap_model "
                     "return the model with this version")
    if hasattr(original, "__vescale_original__"):
        return

    @functools.wraps(original)
    def extract_model_from_parallel(model, *args, **kwargs):
        from ..engine.engine import VeScaleEngine
        while isinstance(model, VeScaleEngine):
            model = model.module
        return original(model, *args, **kwargs)

    extract_model_from_parallel.__vescale_original__ = original
    _rebind_everywhere(original, extract_model_from_parallel, "extract_model_from_parallel")


def patch_accelerate_state_dict() -> None:
    """`accelerator.get_state_dict(engine)` gathers at every stage (see the module docstring)."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return
    original = getattr(Accelerator, "get_state_dict", None)
    if original is None:
        replace("accelerate", Accelerator, "get_state_dict", None)
    if hasattr(original, "__vescale_original__"):
        return

    @functools.wraps(original)
    def get_state_dict(self, model, unwrap=True):
        from ..engine.engine import VeScaleEngine
        if isinstance(model, VeScaleEngine) and model.zero_optimization_stage() < 3:
            return model._zero3_consolidated_16bit_state_dict()
        return original(self, model, unwrap)

    get_state_dict.__vescale_original__ = original
    replace("accelerate", Accelerator, "get_state_dict", get_state_dict)


def patch_accelerate_fsdp2() -> None:
    """Accelerate's FSDP2 path wraps with our `fully_shard` (see the module docstring)."""
    import accelerate  # noqa: F401  (patch_fsdp2 is asked for by name: Accelerate must be there)
    import accelerate.accelerator  # noqa: F401  (holds fsdp2_prepare_model by name)
    import accelerate.utils.fsdp_utils as fsdp_utils
    import torch.distributed.fsdp as torch_fsdp

    what = "vescale_engine.patch_fsdp2() cannot make Accelerate's FSDP2 path use our fully_shard"
    original = getattr(fsdp_utils, "fsdp2_prepare_model", None)
    if original is None:
        raise missing_name("accelerate", "accelerate.utils.fsdp_utils.fsdp2_prepare_model", what)
    if not hasattr(torch_fsdp, "fully_shard"):  # where Accelerate's function imports it from
        raise missing_name("torch", "torch.distributed.fsdp.fully_shard", what)
    if hasattr(original, "__vescale_original__"):
        return

    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator, model, *args, **kwargs):
        from ..fsdp import fully_shard
        torchs = torch_fsdp.fully_shard
        # Only for this call: Accelerate's function imports the name when it runs. Not through
        # `replace`: nothing of it outlives the call, so there is nothing for unpatch to undo.
        torch_fsdp.fully_shard = fully_shard
        try:
            return original(accelerator, model, *args, **kwargs)
        finally:
            torch_fsdp.fully_shard = torchs

    fsdp2_prepare_model.__vescale_original__ = original
    _rebind_everywhere(original, fsdp2_prepare_model, "fsdp2_prepare_model")
