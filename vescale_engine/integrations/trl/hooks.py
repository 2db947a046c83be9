"""The units' forward hooks suspended and restored (TRL's remove_hooks / add_hooks around
generation): forwards then compute with what the modules hold, gathered by the caller."""
from __future__ import annotations

import weakref

from torch import nn

from ...fsdp.lookup import units_under

__all__ = ["suspend_hooks", "resume_hooks"]


def suspend_hooks(module: nn.Module) -> None:
    """The units' forward hooks under `module` do nothing until `resume_hooks` (their places
    among other hooks kept): forwards compute with what the modules hold."""
    for unit in units_under(module):
        if unit in _SUSPENDED:
            continue
        saved = []
        for hooks, fn in [pair for mod in unit.modules  # (a unit may span several modules)
                          for pair in ((mod._forward_pre_hooks, unit.pre_forward),
                                       (mod._forward_hooks, unit.post_forward))]:
            for key, hook in list(hooks.items()):
                if hook == fn:
                    hooks[key] = _inert
                    saved.append((hooks, key, hook))
        _SUSPENDED[unit] = saved


def resume_hooks(module: nn.Module) -> None:
    for unit in units_under(module):
        for hooks, key, hook in _SUSPENDED.pop(unit, ()):
            hooks[key] = hook


_SUSPENDED = weakref.WeakKeyDictionary()  # unit -> the hooks suspend_hooks replaced


def _inert(*args):
    return None
