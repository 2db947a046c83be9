"""`vescale_engine.materialize`, the callable submodule: `materialize(model)` gives a model
wrapped on meta real storage and its init, `materialize.allocate_shards(model)` storage only (for
loaders). The code lives in fsdp/materialize.py; this module keeps the documented names.
"""
import sys
import types

from .fsdp.materialize import (allocate_shards, init_unloaded, materialize, rng_state,
                               set_rng_state, use_init_fn)

__all__ = ["materialize", "allocate_shards", "init_unloaded", "rng_state", "set_rng_state",
           "use_init_fn"]


class _CallableModule(types.ModuleType):
    """`vescale_engine.materialize(model)` must call the function even once this submodule is
    imported (importing `vescale_engine.materialize` binds the package attribute to the module,
    and `materialize.allocate_shards` is the primitive other code imports)."""

    def __call__(self, module, device=None, init_fn=None):
        return materialize(module, device, init_fn)


sys.modules[__name__].__class__ = _CallableModule
