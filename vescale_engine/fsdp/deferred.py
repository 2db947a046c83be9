"""The deferred-init record: what a deferred build (a vescale `deepspeed.zero.Init`, whose
emulation makes it) leaves on the modules and parameters it built, for the engine's weights and
placement and the integrations to read.

A module or parameter built inside carries its `DeferredInit` (`mark_deferred`, read back with
`deferred_of`): the generator state at the build's start and what the builder recorded about
it. The core owns the record; it must not know how the build was entered or how the weights
are loaded.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .guards import DEFERRED_MARK as MARK, meta_leftovers
from .materialize import rng_state, set_rng_state

__all__ = ["MARK", "DeferredInit", "mark_deferred", "deferred_of", "deferred_record",
           "replayed_generator"]


@dataclass(eq=False)
class DeferredInit:
    """One deferred build (a `with deepspeed.zero.Init(...)` under a vescale config), and what
    it built. A builder that knows where the values come from subclasses it (the DeepSpeed
    integration's record of a transformers build loads its checkpoint)."""
    config: dict
    rng: tuple                       # materialize.rng_state(...) when the build started
    loaded: object = None            # checkpoint.hf.LoadResult of initialize's load (this rank)

    def __deepcopy__(self, memo):
        return self  # a copy of a deferred module (PEFT's modules_to_save) is of this build

    def prepare_weights(self, module: nn.Module, cfg, device) -> bool:
        """Give the wrapped `module` its values the builder's way (initialize calls it first);
        False: the builder has no way of its own, and the engine's sources apply."""
        return False


def mark_deferred(obj, record: DeferredInit) -> None:
    """Record that `obj` (a module or a tensor) was built by `record`'s deferred build."""
    obj.__dict__[MARK] = record


def deferred_of(obj) -> DeferredInit | None:
    """The record `obj` itself carries (not its children's), or None."""
    return obj.__dict__.get(MARK)


def deferred_record(module: nn.Module) -> DeferredInit | None:
    """The record of the vescale zero.Init that built `module` (or a part of it) while some of
    it is still on meta; None otherwise. Parts built by separate contexts are an error."""
    records = {id(r): r for m in module.modules() if (r := deferred_of(m)) is not None}
    if not records or not meta_leftovers(module):
        return None
    if len(records) > 1:
        raise ValueError(f"{type(module).__name__} was built in {len(records)} separate "
                         "deepspeed.zero.Init contexts: build it in one, or initialize each "
                         "part on its own")
    return next(iter(records.values()))


@contextlib.contextmanager
def replayed_generator(record: DeferredInit | None, device):
    """Inside, the generators draw from where they were when `record`'s build started (no
    change for None); afterwards they are as the caller left them."""
    if record is None:
        yield
        return
    current = rng_state({torch.device(device), *record.rng[1]})
    set_rng_state(record.rng)
    try:
        yield
    finally:
        set_rng_state(current)
