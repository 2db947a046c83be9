"""The DeepSpeed-compatible engine, the one composition root: initialize and VeScaleEngine
(engine.py: backward/step semantics, accumulation, fp16 skip-on-overflow), the typed config
(config.py), optimizer/scheduler from the config (from_config.py), the wrap policy (wrap.py),
what Trainer/Accelerate call besides the loop (surface.py), where the model's weights go and
come from (weights.py), the same config on every rank (rank_agreement.py), the preemption
save on a signal (preemption.py), fp16 loss scaling, timers, monitors and progress. It may
import every layer below; nothing below imports it (patch_deepspeed, which patches DeepSpeed to
return this engine, is in vescale_engine/integrations/). Names load lazily, so `engine.config`
stays free of torch.
"""
import importlib

_LAZY = {"initialize": "engine", "VeScaleEngine": "engine", "Preempted": "preemption"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
