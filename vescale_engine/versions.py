"""The library versions veScale Engine supports: for each, the lowest version CI tests (its
second pass, .ci/lowest-constraints.txt) and the release line above the newest it tests (its
first pass). setup.py declares the same ranges; tests/integration/test_versions.py keeps the three
equal.

`check_versions()` runs at `patch_deepspeed()` and at `initialize`: each library that is
imported by then is checked once, and one below its range is a one-line ImportError naming the
library, its version and the range. Within the range, the integration code finds what each
release offers by feature detection; a newer release than the range is not refused here
(setup.py keeps pip within it), and a name it lacks is reported where it is patched
(vescale_engine/integrations/: each module checks every name it replaces at install).

Torch-free: it reads versions from the modules already imported and imports none.
"""
from __future__ import annotations

import re
import sys

__all__ = ["SUPPORTED", "supported_range", "check_versions"]

# library (import name): (lowest tested, first version above the tested line)
SUPPORTED = {
    "torch": ("2.11.0", "2.16"),
    "deepspeed": ("0.19.3", "0.20"),
    "transformers": ("5.6.0", "5.26"),
    "accelerate": ("1.11.0", "1.17"),
    "peft": ("0.18.1", "0.22"),
    "trl": ("0.24.0", "1.17"),
    "datasets": ("4.0.0", "5.3"),
}

_checked: set = set()


def supported_range(name: str) -> str:
    """'>=LOW,<HIGH' for the library `name`, as setup.py declares it."""
    low, high = SUPPORTED[name]
    return f">={low},<{high}"


def _release(version: str) -> tuple:
    """(2, 13, 0) from '2.13.0+cpu', '2.13.0.dev20260101' or '0.18.6': the release numbers
    only, so that a local or development build of the lowest release counts as it."""
    found = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in found.group().split(".")) if found else ()


def check_versions(modules=None) -> None:
    """Check each library of SUPPORTED imported now (in `modules`, default sys.modules) and not
    checked before: an ImportError if its version is below the range."""
    modules = sys.modules if modules is None else modules
    for name, (low, _) in SUPPORTED.items():
        module = modules.get(name)
        if module is None or name in _checked:
            continue
        version = str(getattr(module, "__version__", ""))
        if _release(version) < _release(low):
            raise ImportError(f"vescale_engine supports {name}{supported_range(name)}, but "
                              f"{name} {version or '(version unknown)'} is installed: "
                              f"pip install '{name}{supported_range(name)}'")
        _checked.add(name)
