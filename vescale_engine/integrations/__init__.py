"""Everything that patches another library or emulates it for our engine, one package (or
module) per library (deepspeed/, transformers/, peft/, trl/, accelerate.py, torch.py), and the
entry points: `patch_deepspeed()`, `patch_fsdp2()` and `unpatch()` (`vescale_engine.
patch_deepspeed`, `vescale_engine.patch_fsdp2` and `vescale_engine.unpatch` are these), and
`connect()`.

The core (plan, shard, fsdp, checkpoint, optim, engine, ...) never imports this package, never
imports DeepSpeed, transformers, PEFT or TRL, and never assigns another library's attributes
(tests/core/package/test_layering.py checks all three). The ways in are the package root's
lazy names `vescale_engine.patch_deepspeed` / `unpatch` and its `_connect()` (by name, not an
import statement). `connect()` registers what DeepSpeed and transformers add to every
`initialize` and `materialize` through the core's extension points (engine/extensions.py,
fsdp/materialize.py's init guards): it patches nothing, so a script that never calls
patch_deepspeed() runs unpatched. The replacement functions here decide when our engine is
concerned and call into the core (our engine, deepspeed/params.py's GatheredShards, ...).

Every patch goes through `replace` (registry.py), which first checks that the library still
has the name it replaces (an ImportError of one line naming the library, its version, the name
and the supported range, versions.py) and records (owner, name, original); `unpatch()` puts
every original back, latest first, and stops watching imports. `installed()` lists what is
patched now.

When a patch goes in does not depend on import order: `patch_deepspeed()` installs DeepSpeed's
and Accelerate's (it imports both), and transformers', PEFT's and TRL's either at once, when
the module they patch is imported already, or right after that module is first imported (an
import hook on `sys.meta_path` that wraps the module's loader: `_WATCHED`).
"""
from __future__ import annotations

import importlib
import sys

from ..versions import check_versions
from .registry import count, installed, missing_name, replace, restore_all

__all__ = ["connect", "patch_deepspeed", "patch_fsdp2", "unpatch", "installed", "replace",
           "missing_name"]

# module whose import triggers an install -> the integration module that installs
_WATCHED = {"transformers.modeling_utils": "transformers", "peft": "peft",
            "trl.models.utils": "trl"}


_CONNECTED = []


def connect() -> None:
    """Register the engine's extension points each integration fills (engine/extensions.py,
    fsdp/materialize.py's init guards): what DeepSpeed and transformers add to every
    `initialize`, patched or not. Idempotent; patches nothing (`installed()` stays as it is)
    and imports none of those libraries (their code is imported when a role is called)."""
    if _CONNECTED:
        return
    from ..engine.extensions import register
    from .deepspeed.extension import extension as deepspeed_extension
    from .transformers.extension import connect as connect_transformers
    register(deepspeed_extension())
    connect_transformers()
    _CONNECTED.append(True)


def unpatch() -> None:
    """Every original back, latest patch first; imports are no longer watched. A later
    `patch_deepspeed()` installs everything again."""
    _Finder.remove()
    restore_all()


# -- installing -----------------------------------------------------------------------------------

def patch_deepspeed() -> None:
    """The one-line migration: after it `deepspeed.initialize` returns our engine when the
    config has a "vescale" section (DeepSpeed's own otherwise), `deepspeed.zero.Init` builds on
    meta for such a config, our parameters carry DeepSpeed's per-parameter surface, Accelerate
    unwraps our engine, and transformers, PEFT and TRL work with the model it builds, whenever
    they are imported (idempotent). DeepSpeed's launcher, `deepspeed.comm` and
    `init_distributed` are untouched. A library below the versions we support is an error here
    (versions.py), and so is a name one of them no longer has: then nothing of this call stays
    patched."""
    import deepspeed  # noqa: F401  (imported, so that its version is checked with the rest)

    from . import accelerate, deepspeed as ours
    check_versions()
    before = count()
    try:
        ours.install()
        accelerate.install()
        for module_name in list(_WATCHED):
            if module_name in sys.modules:
                _install(module_name)
    except BaseException:
        restore_all(before)
        raise
    _Finder.add()


def patch_fsdp2() -> None:
    """The one line for FSDP2 users of Accelerate and Trainer: after it Accelerate's FSDP2 path
    (`FullyShardedDataParallelPlugin(fsdp_version=2)`, Trainer's `fsdp_config={"fsdp_version":
    2}`) wraps the model with `vescale_engine.fully_shard` instead of torch's, with the same
    units and arguments (accelerate.py). Only Accelerate's call changes: torch's
    `fully_shard`, called by anyone else, stays torch's. A separate line from
    `patch_deepspeed()`, which needs DeepSpeed and switches only configs that ask for us (a
    "vescale" section); an FSDP2 config has no such section, so this line is the asking.
    Idempotent; `unpatch()` undoes it with the rest. Accelerate below the versions we support,
    or one without the function, is a one-line ImportError, and nothing stays patched."""
    import accelerate  # noqa: F401  (imported, so that its version is checked with the rest)
    import torch  # noqa: F401

    from . import accelerate as ours
    check_versions()
    before = count()
    try:
        ours.patch_accelerate_fsdp2()
        # Accelerate's cpu_ram_efficient_loading loads through torch's distribute_tensor
        importlib.import_module(".torch", __name__).install()
    except BaseException:
        restore_all(before)
        raise


def _install(module_name: str) -> None:
    library = _WATCHED[module_name]
    check_versions()
    importlib.import_module(f".{library}", __name__).install()


class _Loader:
    """A module's own loader, and the install of its integration once the module has run."""

    def __init__(self, loader, name):
        self._loader, self._name = loader, name

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = self._loader  # as if we had never been there
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        if _Finder.active:
            _install(self._name)


class _Finder:
    """On `sys.meta_path` while patches are installed: the modules of `_WATCHED` are found by
    the finders after it, and their loader wrapped in `_Loader`."""

    active = None

    @classmethod
    def add(cls) -> None:
        if cls.active is None:
            cls.active = cls()
            sys.meta_path.insert(0, cls.active)

    @classmethod
    def remove(cls) -> None:
        if cls.active is not None:
            if cls.active in sys.meta_path:
                sys.meta_path.remove(cls.active)
            cls.active = None

    def find_spec(self, fullname, path, target=None):
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, fullname)
        return spec
