"""Global gradient norm and clipping across the ranks that shard the parameters.

Everything stays on the gradients' device: the norm is a device tensor and clipping multiplies
by a device-side coefficient, so neither forces a host-device sync. Whoever needs the value on
the host (a log line, the fp16 overflow decision) pays the one sync by calling `float(norm)`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..fsdp.dtensor_params import sharded_mesh_dims
from ..fsdp.param import sharding_of
from ..launch.collective_timeout import explain_timeout

__all__ = ["clip_grad_norm_", "global_grad_norm", "clip_coefficient", "scale_gradients_"]


def _buffers_and_plain(parameters, with_specs=False):
    buffers, plain, specs, seen = [], [], [], set()
    for p in parameters:
        sp = sharding_of(p)
        if sp is None:
            if p.grad is not None:
                plain.append(p)
        elif id(sp.buffer) not in seen:
            seen.add(id(sp.buffer))
            buffers.append(sp.buffer)
            specs.append(sp.dtensor_spec)  # one TP/EP layout per buffer (fsdp/dtensor_params)
    return (buffers, plain, specs) if with_specs else (buffers, plain)


def _piece_groups(buf, spec) -> tuple:
    """The groups whose ranks hold different pieces of this buffer's tensors: its norm group
    (its shard group, or the world for DeepSpeed MoE experts, whose EP ranks hold different
    experts: integrations/deepspeed/moe.py), then the TP/EP mesh dims that split them. Replicas
    (HSDP's replicate group, TP peers of a replicated tensor) hold copies and are left out, so
    every element counts once."""
    if spec is None:
        return (buf.comm.norm_group,)
    return (buf.comm.norm_group, *(spec.mesh.get_group(d) for d in sharded_mesh_dims(spec)))


def _device_of(buffers, plain, parameters) -> torch.device:
    """Where the norm lives: the gradients' device (the parameters' when none has one); for
    sharded parameters their buffers' device, where the norm's all-reduce runs (an offloaded
    buffer's gradient shard is in host memory)."""
    if buffers:
        return buffers[0].device
    if plain:
        return plain[0].grad.device
    return parameters[0].device if parameters else torch.device("cpu")


def _sum_of_squares(tensors, device) -> torch.Tensor:
    """Sum of squares of `tensors` in fp32 on `device`: one fused norm kernel per call (no
    tensor-sized temporary), the per-tensor norms squared and added there."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    by_device = {}
    for t in tensors:  # (host gradient shards of offloaded buffers beside device ones)
        by_device.setdefault(t.device, []).append(t)
    norms = [n for group in by_device.values()
             for n in torch._foreach_norm(group, 2, dtype=torch.float32)]
    return torch.stack([n.to(device, non_blocking=True) for n in norms]).square().sum()


def global_grad_norm(parameters) -> torch.Tensor:
    """The 2-norm of all gradients as if unsharded, as a 0-d fp32 tensor on the gradients'
    device: one fused norm per shard group, one all-reduce over each shard group (and over
    each TP/EP mesh dim that splits a DTensor parameter: those pieces differ; replicas are
    counted once). Plain (unsharded) parameters count once, in the same fused kernel, without
    a sync each."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    parameters = list(parameters)
    buffers, plain, specs = _buffers_and_plain(parameters, with_specs=True)
    device = _device_of(buffers, plain, parameters)
    by_groups = {}
    for buf, spec in zip(buffers, specs):
        grads = by_groups.setdefault(_piece_groups(buf, spec), [])
        if buf.has_grad:  # a buffer whose gradient storage is released adds nothing
            grads.append(buf.grad)
    total = _sum_of_squares([p.grad.detach() for p in plain], device)
    for groups, grads in by_groups.items():
        local = _sum_of_squares(grads, device)
        for group in groups:  # every rank of the group joins, grads or none
            with explain_timeout("the all-reduce of the gradient norm"):
                dist.all_reduce(local, group=group)
        total = total + local
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """min(1, max_norm / (norm + eps)) on the norm's device; 1 when the norm is nan (the
    gradients are left as they are, as before: the step's loss tells the story)."""
    return (max_norm / (norm + eps)).clamp(max=1.0).nan_to_num(nan=1.0)


def scale_gradients_(parameters, factor) -> None:
    """Multiply every gradient by `factor` (a number, or a 0-d tensor on the gradients'
    device): flat shards once per buffer, plain gradients in one fused call."""
    buffers, plain = _buffers_and_plain(list(parameters))
    for buf in buffers:
        buf.scale_grad(factor)
    if plain:
        torch._foreach_mul_([p.grad.detach() for p in plain], factor)


def clip_grad_norm_(parameters, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before
    (a device tensor: no host sync here)."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    parameters = list(parameters)
    norm = global_grad_norm(parameters)
    scale_gradients_(parameters, clip_coefficient(norm, max_norm, eps))
    return norm
