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
"""
from __future__ import annotations

import functools
import sys

from .registry import replace

__all__ = ["install", "patch_accelerate_unwrap", "patch_accelerate_state_dict"]


def install() -> None:
    """Both patches (idempotent)."""
    patch_accelerate_unwrap()
    patch_accelerate_state_dict()


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
    for module in list(sys.modules.values()):
        # __dict__, not getattr: lazy modules (transformers) import nothing here
        if getattr(module, "__dict__", {}).get("extract_model_from_parallel") is original:
            replace("accelerate", module, "extract_model_from_parallel",
                    extract_model_from_parallel)


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
