"""Global gradient norm and clipping across the ranks that shard the parameters."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _buffers_and_plain(parameters):
    buffers, plain, seen = [], [], set()
    for p in parameters:
        sp = getattr(p, "_vescale", None)
        if sp is None:
            if p.grad is not None:
                plain.append(p)
        elif id(sp.buffer) not in seen:
            seen.add(id(sp.buffer))
            buffers.append(sp.buffer)
    return buffers, plain


def global_grad_norm(parameters) -> torch.Tensor:
    """The 2-norm of all gradients as if unsharded: one fused sum of squares per buffer, one
    all-reduce over each shard group. Plain (unsharded) parameters count once."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    buffers, plain = _buffers_and_plain(list(parameters))
    by_group = {}
    for buf in buffers:
        by_group.setdefault(buf.shard_group, []).append(buf.grad_squared_norm())
    total = torch.zeros((), dtype=torch.float32)
    for group, parts in by_group.items():
        local = torch.stack(parts).sum().to(torch.float32)
        dist.all_reduce(local, group=group)
        total = total + local.cpu()
    for p in plain:
        total = total + p.grad.detach().float().pow(2).sum().cpu()
    return total.sqrt()


def clip_grad_norm_(parameters, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    parameters = list(parameters)
    norm = global_grad_norm(parameters)
    coef = max_norm / (float(norm) + eps)
    if coef < 1.0 and math.isfinite(coef):
        buffers, plain = _buffers_and_plain(parameters)
        for buf in buffers:
            buf.scale_grad(coef)
        for p in plain:
            p.grad.detach().mul_(coef)
    return norm
