"""`vescale_engine.materialize`, the callable submodule: `materialize(model)` gives a model
wrapped on meta real storage and its init, `materialize.allocate_shards(model)` storage only (for
loaders). The code lives in fsdp/materialize.py; this module keeps the documented names, and
connects the integrations (what transformers adds to a pretrained model's init) first.
"""
import sys
import types

from . import _connect
from .logs import install as install_logging
from .fsdp import materialize as _core
from .fsdp.materialize import allocate_shards, rng_state, set_rng_state, use_init_fn

__all__ = ["materialize", "allocate_shards", "init_unloaded", "rng_state", "set_rng_state",
           "use_init_fn"]


def materialize(module, device=None, init_fn=None):
    """fsdp/materialize.py's `materialize`, with the integrations connected (a pretrained
    model's init runs inside transformers' guard of torch's init functions)."""
    _connect()
    install_logging()  # its progress lines print without logging setup (logs.py)
    return _core.materialize(module, device, init_fn)


def init_unloaded(*args, **kwargs):
    """fsdp/materialize.py's `init_unloaded`, with the integrations connected."""
    _connect()
    return _core.init_unloaded(*args, **kwargs)


class _CallableModule(types.ModuleType):
    """`vescale_engine.materialize(model)` must call the function even once this submodule is
    imported (importing `vescale_engine.materialize` binds the package attribute to the module,
    and `materialize.allocate_shards` is the primitive other code imports)."""

    def __call__(self, module, device=None, init_fn=None):
        return materialize(module, device, init_fn)


sys.modules[__name__].__class__ = _CallableModule
