"""Finding the FSDP units under a module and the parameters they manage (every other part of
the runtime and the packages above look them up through here)."""
from __future__ import annotations

from torch import nn

__all__ = ["unit_of", "units_under", "rank_local_units", "sharded_parameters"]


def unit_of(module: nn.Module):
    """The FSDPUnit fully_shard made `module` part of, or None (no import of unit.py: it is
    above this module)."""
    return getattr(module, "_vescale_unit", None)


def units_under(module):
    """Every FSDP unit under `module` (itself included), in module order, each once (a unit
    over several modules, FSDP2's `fully_shard([a, b])`, is found at its first)."""
    units, seen = [], set()
    for unit in (unit_of(m) for m in module.modules()):
        if unit is not None and id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units


def rank_local_units(module) -> list:
    """The units under `module` whose parameters differ per rank under the same names
    (ShardingPolicy.rank_local): what files keeping one tensor per name must refuse."""
    return [unit for unit in units_under(module) if unit.sharding.rank_local]


def sharded_parameters(module: nn.Module):
    """(fqn, ShardedParameter) for every managed parameter under `module`."""
    for unit in units_under(module):
        for p in unit.params:
            home = getattr(p, "home", unit.module)  # the module its fqn is relative to
            yield p.fqn if home is module else _qualify(module, home, p.fqn), p


def _qualify(root, sub, fqn):
    for name, mod in root.named_modules():
        if mod is sub:
            return f"{name}.{fqn}" if name else fqn
    return fqn
