"""The model as the simulations see it: units of tensors, the root (gathered from the first
forward to the end of backward: embeddings, final norm, head) and the others in forward order,
built from a shapes file and the tensors' use counts (a tied embedding is used twice). In a
TP/EP-local model (plan/parallel.py) a MoE layer is two units, its dense part then its experts
(sharded over their own group), interleaved layer by layer in forward order as fully_shard on
the experts and then on the layer makes them (torchtitan's apply_fsdp)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..model_plan import ModelShapes, ShapesError

__all__ = ["Tensor", "Unit", "default_root", "tensor_uses", "model_units", "expand"]


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple
    uses: int = 1      # how often forward uses it (a tied embedding: 2)
    cut: int = 1       # a block is a multiple of it (a TP cut on a dim > 0: Group.cuts)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    name: str
    tensors: tuple
    repeat: int = 1
    late: tuple = ()   # root only: tensors whose gradients come first in backward (the head)
    expert: bool = False       # sharded over the expert group (efsdp), not the dense one
    within: str | None = None  # the unit whose layer it runs in: interleaved with it

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def default_root(model: ModelShapes) -> tuple:
    """The groups the root owns when the user names none: the non-repeated groups before the
    first repeated one and after the last (embeddings, final norm and head), as wrapping a
    Hugging Face model's decoder layers leaves them; every group if none repeats."""
    groups = model.groups
    repeated = [i for i, g in enumerate(groups) if g.repeat > 1]
    if not repeated:
        return tuple(g.name for g in groups if not g.expert)
    return tuple(g.name for i, g in enumerate(groups)
                 if (i < repeated[0] or i > repeated[-1]) and g.repeat == 1 and not g.expert)


def tensor_uses(path: str) -> dict:
    """{(group, tensor): uses} for tensors with a "uses" count in the shapes file (an optional
    key: a tied embedding, used by the embedding and the output head, says 2)."""
    with open(path) as f:
        data = json.load(f)
    uses = {}
    for group in data.get("groups", []):
        for tensor in group.get("tensors", []):
            count = tensor.get("uses", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ShapesError(f"{path}: group {group.get('name')!r}, tensor "
                                  f"{tensor.get('name')!r}: 'uses' must be a positive integer")
            if count != 1:
                uses[(group.get("name"), tensor.get("name"))] = count
    return uses


def model_units(model: ModelShapes, root: tuple, uses: dict) -> tuple:
    """(root unit, [other units in forward order])."""
    first_other = next((i for i, g in enumerate(model.groups) if g.name not in root), None)
    root_tensors, late, others = [], [], []
    for i, group in enumerate(model.groups):
        cuts = group.cuts or (1,) * len(group.tensors)
        tensors = [Tensor(name, shape, uses.get((group.within or group.name, name), 1), cut)
                   for (name, shape), cut in zip(group.tensors, cuts)]
        if group.name in root:
            qualified = [Tensor(f"{group.name}.{t.name}", t.shape, t.uses) for t in tensors]
            root_tensors += qualified
            if first_other is None or i > first_other:
                late += [t.name for t in qualified]
        else:
            others.append(Unit(group.name, tuple(tensors), group.repeat, (), group.expert,
                              group.within))
    return Unit("root", tuple(root_tensors), 1, tuple(late)), others


def expand(units) -> list:
    """Forward order with repeats expanded: [(unit, instance index)]; a unit `within` the one
    before it (a layer's experts) runs right after it in every instance."""
    stacks = []
    for u in units:
        if stacks and u.within is not None and u.within == stacks[-1][0].name:
            stacks[-1].append(u)
        else:
            stacks.append([u])
    return [(u, i) for stack in stacks for i in range(stack[0].repeat) for u in stack]
