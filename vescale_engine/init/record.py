"""The record a vescale `deepspeed.zero.Init` leaves on what it built (init/zero.py makes it;
init/hf_pretrained.py, init/peft_adapters.py, the engine's weights and placement read it).

A module built inside the context carries its `DeferredInit` under `MARK` (parameters too):
the generator state at the build's start and what transformers recorded about the build.
Plain state shared by zero.Init and the transformers hooks, so neither imports the other for
it. Must not know how the context is entered or how the weights are loaded.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..fsdp.materialize import rng_state, set_rng_state
from ..fsdp.guards import meta_leftovers

__all__ = ["MARK", "DeferredInit", "deferred_record", "replayed_generator"]

MARK = "_vescale_deferred"  # attribute of the modules and parameters built inside: the record


@dataclass(eq=False)
class DeferredInit:
    """One `with deepspeed.zero.Init(...)` under a vescale config, and what it built."""
    config: dict
    rng: tuple                       # materialize.rng_state(...) when the build started
    builder: str | None = None       # "from_pretrained" / "from_config": transformers built it
    root: nn.Module | None = None    # the model transformers built (set by init/hf_pretrained.py)
    pretrained: object = None        # init/hf_pretrained.py.PretrainedWeights, from from_pretrained
    init_like_transformers: bool = False  # from_config: initialize_weights' walk, deferred
    loaded: object = None            # checkpoint.hf.LoadResult of initialize's load (this rank)

    def __deepcopy__(self, memo):
        return self  # a copy of a deferred module (PEFT's modules_to_save) is of this build


def deferred_record(module: nn.Module) -> DeferredInit | None:
    """The record of the vescale zero.Init that built `module` (or a part of it) while some of
    it is still on meta; None otherwise. Parts built by separate contexts are an error."""
    records = {id(r): r for m in module.modules() if (r := m.__dict__.get(MARK)) is not None}
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
