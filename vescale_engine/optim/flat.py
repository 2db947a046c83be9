"""Which DBuffers an optimizer over sharded parameters steps, and with which hyperparameters."""
from __future__ import annotations

import torch

from ..fsdp.param import sharding_of

__all__ = ["flat_buffers", "stepped_members", "evaluate_closure"]


def flat_buffers(param_groups, optimizer_name: str, check=None):
    """One (buffer, group, weight_decay, members) per DBuffer holding trainable parameters.

    Parameters sharing a buffer are stepped in one pass, so their groups must agree on lr,
    betas and eps; weight decay may differ (a per-element vector then). Every trainable
    parameter of a stepped buffer must be given. `members` are the given ShardedParameters of
    the buffer: at each step, those whose `.grad` is set are stepped (see `stepped_ranges`).
    `check(sp)` may refuse a parameter (raise ValueError)."""
    owners = {}
    for group in param_groups:
        for p in group["params"]:
            sp = sharding_of(p)
            if sp is None:
                raise ValueError(f"{optimizer_name} needs parameters sharded by vescale_engine."
                                 f"fully_shard; got a plain parameter of shape {list(p.shape)}")
            if check is not None:
                check(sp)
            owners.setdefault(id(sp.buffer), (sp.buffer, []))[1].append((sp, group))
    entries = []
    for buf, members in owners.values():
        first = members[0][1]
        for sp, group in members:
            for key in ("lr", "betas", "eps"):
                if group[key] != first[key]:
                    raise ValueError(f"parameter {sp.fqn}: shares a flat buffer with "
                                     f"parameters whose {key} differs ({group[key]} vs "
                                     f"{first[key]})")
        given = {id(sp) for sp, _ in members}
        for sp in members[0][0].unit.params:
            if sp.buffer is buf and sp.sharded.requires_grad and id(sp) not in given:
                raise ValueError(f"parameter {sp.fqn}: trainable and in a flat buffer the "
                                 "optimizer steps, but not given to the optimizer")
        decays = {group["weight_decay"] for _, group in members}
        if len(decays) == 1:
            decay = decays.pop()
        else:
            decay = torch.zeros_like(buf.master)
            for sp, group in members:
                start, end = buf.local_ranges[sp.index]
                decay[start:end] = group["weight_decay"]
        if any(sp.requires_grad for sp, _ in members):  # all frozen: nothing to step
            entries.append((buf, first, decay, [sp for sp, _ in members]))
    return entries


def stepped_members(buf, members):
    """The members one step of `buf` updates, as torch.optim does per parameter: those with a
    gradient (a frozen parameter has none, or one the user kept), and whether they are every
    tensor of the buffer (then one pass over the whole shard serves, padding included: it
    stays zero)."""
    stepped = [sp for sp in members if sp.sharded.grad is not None]
    return stepped, len(stepped) == len(buf.layout.placements)


def evaluate_closure(closure):
    """torch.optim's closure convention: re-evaluate the loss with gradients enabled (step
    itself runs under no_grad); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
