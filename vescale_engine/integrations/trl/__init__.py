"""TRL's `trl.models.utils.remove_hooks` / `add_hooks` (around generation inside
`GatheredParameters(model.parameters())`, unwrap_model_for_generation): for our engine they
suspend and restore the units' forward hooks (hooks.py's suspend_hooks /
resume_hooks), so generation computes with the gathered parameters and re-gathers nothing;
TRL's own run for anything else. Supported: trl versions.SUPPORTED["trl"]; `install` checks both
names.

Installed by `patch_deepspeed()` when trl.models.utils is imported, or right after it is first
imported.
"""
from __future__ import annotations

import functools
import sys

from ...versions import supported_range
from ..registry import replace
from .hooks import resume_hooks, suspend_hooks

__all__ = ["install"]


def install() -> None:
    """Both patches (idempotent)."""
    utils = sys.modules.get("trl.models.utils")
    if utils is None or hasattr(getattr(utils, "remove_hooks", None), "__vescale_original__"):
        return
    missing = [n for n in ("remove_hooks", "add_hooks") if not callable(getattr(utils, n, None))]
    if missing:
        version = getattr(sys.modules.get("trl"), "__version__", "?")
        raise ImportError(f"trl {version} has no trl.models.utils.{missing[0]} (supported: "
                          f"trl{supported_range('trl')}): vescale_engine cannot make "
                          "unwrap_model_for_generation's gathered generation work with this "
                          "version")
    for name, ours in (("remove_hooks", suspend_hooks), ("add_hooks", resume_hooks)):
        replace("trl", utils, name, _for_our_engine(getattr(utils, name), ours))


def _for_our_engine(original, ours):
    @functools.wraps(original)
    def patched(model, *args, **kwargs):
        from ...engine.engine import VeScaleEngine
        if isinstance(model, VeScaleEngine):  # our engine: hooks of its units
            return ours(model.module)
        return original(model, *args, **kwargs)
    patched.__vescale_original__ = original
    return patched
