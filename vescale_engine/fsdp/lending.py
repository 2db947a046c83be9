"""Which object holds a sharded parameter's full tensor now, and a parameter read in forward.

A sharded parameter's objects hold its full tensor while its unit is gathered (the full-shape
parameter the unit registers) or while an integration lends it (`lend_full` / `return_full`:
DeepSpeed's GatheredParameters fills the sharded object in place). `holds_full` answers for
both, the same on every rank (it decides collectives). `ReadGathers`: a sharded parameter read
inside a forward outside its unit is gathered and handed out full, as DeepSpeed's
ZeROOrderedDict gathers its "external parameters".
"""
from __future__ import annotations

import torch

from .param import sharding_of
from .unit import forward_in_progress, running_backward, serve_outside_read

__all__ = ["lend_full", "return_full", "holds_full", "ReadGathers", "gather_on_read"]

_LENT = set()  # ids of the parameter objects an integration lent the full tensor


def lend_full(p) -> None:
    """`p` (a sharded parameter object) holds its full tensor until `return_full(p)`."""
    _LENT.add(id(p))


def return_full(p) -> None:
    _LENT.discard(id(p))


def holds_full(p, sp) -> bool:
    """Does the object hold the full tensor now? (rank-consistent: it decides collectives)"""
    if id(p) in _LENT:
        return True
    if p is sp.full_face:
        module, name = sp.registrations[0]
        return module._parameters.get(name) is p
    return False


# -- a parameter read in forward -----------------------------------------------------------------

class ReadGathers(dict):
    """`module._parameters` of a module whose parameters the engine shards: a sharded
    parameter read (`module.weight`) inside a root's forward, but not in backward, is gathered
    by its unit (unit.serve_outside_read) and the full one returned. Iterating
    (`named_parameters()`) reads nothing through here."""
    __slots__ = ()

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        # (first: a compiled forward must not trace, nor guard on, the runtime's state)
        if torch.compiler.is_compiling() or not forward_in_progress() or \
                not isinstance(p, torch.Tensor):
            return p
        sp = sharding_of(p)  # a sharded face (not a full one)
        if sp is None or id(p) in _LENT or running_backward():
            return p
        serve_outside_read(sp.unit, sp)
        return dict.__getitem__(self, key)


def gather_on_read(units) -> None:
    """Give the modules holding `units`' parameters ReadGathers (once; idempotent)."""
    for unit in units:
        for sp in unit.params:
            for module, _ in sp.registrations:
                if type(module._parameters) is not ReadGathers:
                    module._parameters = ReadGathers(module._parameters)
