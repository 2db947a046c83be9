"""DeepSpeed's ZeRO-3 leaf modules: a module flagged `_z3_leaf` (by
`deepspeed.utils.set_z3_leaf_modules`, or by `zero_optimization.leaf_module`, whose default
names transformers' Mixtral and Qwen MoE blocks) is fetched whole when it is entered, so that a
forward whose path through the module differs by step or by rank (which experts a token routes
to) issues the same collectives on every rank. Here: no FSDP unit lies strictly inside a leaf;
a leaf that would have held units becomes one unit itself, gathered whole on entry. (The
config's leaf modules are flagged by the DeepSpeed integration's `before_wrap`, with
DeepSpeed's own parser and matcher.)"""
from __future__ import annotations

from torch import nn

__all__ = ["leaf_modules", "units_with_whole_leaves"]


def leaf_modules(model: nn.Module) -> list:
    """The outermost flagged modules (a leaf inside a leaf changes nothing)."""
    found = []

    def visit(module):
        if getattr(module, "_z3_leaf", False):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def units_with_whole_leaves(model: nn.Module, units: tuple) -> tuple:
    """`units` (innermost first) without those strictly inside a leaf, plus each such leaf
    (not the root, which is a unit anyway), in the same children-before-parents order."""
    leaves = leaf_modules(model)
    if not leaves:
        return units
    owner = {}  # id of a module strictly inside a leaf -> that leaf
    for leaf in leaves:
        owner.update((id(m), leaf) for m in leaf.modules() if m is not leaf)
    last_inside = {id(owner[id(m)]): i for i, m in enumerate(units) if id(m) in owner}
    already = {id(m) for m in units}
    out = []
    for i, module in enumerate(units):  # a leaf takes the place of the last unit inside it,
        leaf = owner.get(id(module))    # which keeps children before parents
        if leaf is None:
            out.append(module)
        elif last_inside[id(leaf)] == i and leaf is not model and id(leaf) not in already:
            out.append(leaf)
    return tuple(out)
