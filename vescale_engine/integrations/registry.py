"""The record of every patch (`replace`), what `unpatch` reads to put the originals back, and
the one-line error for a name a library no longer has (`missing_name`)."""
from __future__ import annotations

import sys

from ..versions import supported_range

__all__ = ["replace", "missing_name", "installed", "restore_all", "count"]

_ABSENT = object()
_PATCHES = []  # (owner, name, original or _ABSENT), in installation order


def _owner_name(owner) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", repr(owner))


def missing_name(library: str, dotted: str, what: str = "") -> ImportError:
    """The one-line error for a name `library` no longer has where we patch or use it."""
    version = getattr(sys.modules.get(library), "__version__", "(version unknown)")
    return ImportError(f"{library} {version} has no {dotted} (vescale_engine.integrations."
                       f"{library} supports {library}{supported_range(library)})"
                       + (f": {what}" if what else ""))


def replace(library: str, owner, name: str, new, *, absent_ok: bool = False, what: str = ""):
    """Set `owner.name = new`, recorded for `unpatch`. `owner` must have `name` (else the
    one-line ImportError of `missing_name`) unless `absent_ok` (a name we add)."""
    original = vars(owner).get(name, _ABSENT)
    if original is _ABSENT and not absent_ok and not hasattr(owner, name):
        raise missing_name(library, f"{_owner_name(owner)}.{name}", what)
    _PATCHES.append((owner, name, original))
    setattr(owner, name, new)
    return new


def installed() -> list:
    """'module.Class.name' of every attribute of another library patched now, sorted."""
    return sorted({f"{_owner_name(owner)}.{name}" for owner, name, _ in _PATCHES})


def count() -> int:
    """How many patches are recorded now (`restore_all(count())` undoes the ones after)."""
    return len(_PATCHES)


def restore_all(keep: int = 0) -> None:
    """Every original back, latest patch first, down to the first `keep` patches."""
    while len(_PATCHES) > keep:
        owner, name, original = _PATCHES.pop()
        if original is _ABSENT:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, original)
