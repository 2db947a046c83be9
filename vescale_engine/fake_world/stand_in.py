"""A model with a shapes file's parameters, every one at its full shape, built on the meta
device: the root's groups on the model itself (their names are the model's), each other group
a ModuleList of its repeats under the group's name (`layers.3`), a group `within` another a
child of each of its instances. Its forward reads one element of every parameter, so each
unit is gathered, used and given a full gradient as in a real step, without the matmuls: the
collectives a step issues depend on the units' parameters and the hooks, not on the math.
"""
from __future__ import annotations

import torch
from torch import nn

from ..plan.model_plan import ModelShapes

__all__ = ["build", "unit_modules"]


def _register(module: nn.Module, name: str, shape) -> None:
    """A meta parameter under its dotted name, making containers on the way (in the file's
    order: fully_shard lays a unit's parameters out in module order)."""
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, nn.Parameter(torch.empty(shape, device="meta")))


def _touch(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x plus one element of each of the module's own parameters (a full gradient each)."""
    for p in module.parameters(recurse=False):
        x = x + p.reshape(-1)[0].float()
    for child in module.children():
        if not isinstance(child, _Unit):
            x = _touch(child, x)
    return x


class _Unit(nn.Module):
    """One instance of a repeated (or non-root) group; units `within` it run inside it."""

    def forward(self, x):
        x = _touch(self, x)
        for child in self.children():
            if isinstance(child, _Unit):
                x = child(x)
        return x


class _Model(nn.Module):
    def __init__(self, model: ModelShapes, root: tuple):
        super().__init__()
        self.plan = []   # ("root", [tensor names]) and ("units", group name), in forward order
        for group in model.groups:
            if group.name in root:
                for name, shape in group.tensors:
                    _register(self, name, shape)
                self.plan.append(("root", [name for name, _ in group.tensors]))
                continue
            if group.within is None:
                instances = nn.ModuleList(_Unit() for _ in range(group.repeat))
                self.add_module(group.name, instances)
                self.plan.append(("units", group.name))
            else:   # one in each instance of the group it sits in
                instances = []
                for parent in getattr(self, group.within):
                    parent.add_module(group.name, _Unit())
                    instances.append(getattr(parent, group.name))
            for unit in instances:
                for name, shape in group.tensors:
                    _register(unit, name, shape)

    def forward(self, x):
        for kind, what in self.plan:
            if kind == "root":
                for name in what:
                    x = x + self.get_parameter(name).reshape(-1)[0].float()
            else:
                for unit in getattr(self, what):
                    x = unit(x)
        return x


def build(model: ModelShapes, root: tuple) -> nn.Module:
    """The stand-in model of `model` (meta), `root` the groups the root unit owns."""
    return _Model(model, root)


def unit_modules(module: nn.Module) -> list:
    """Every unit's module below the root, in forward order (a unit within another after it):
    what fully_shard wraps before the root."""
    return [m for m in module.modules() if isinstance(m, _Unit)]
