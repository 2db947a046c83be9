"""The config's wrap policy: which submodules become FSDP units, on which device mesh."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import fsdp, optim


def device_mesh(cfg, device: torch.device):
    """A (replicate, shard) mesh on this rank's device type for HSDP and for stage 0
    (replicate only); None: shard over the whole world."""
    if cfg.hsdp_replicate_size <= 1 and cfg.zero_stage != 0:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    replicas = world if cfg.zero_stage == 0 else cfg.hsdp_replicate_size
    return init_device_mesh(device.type, (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def wrap_model(model: nn.Module, cfg, mesh) -> nn.Module:
    """Units by the wrap policy (class names, or the smallest subtrees with min_params
    parameters), innermost first, then the root."""
    granularity = optim.sharding_granularity(  # the granularity the optimizer needs
        cfg.optimizer, {"default": cfg.granularity, "overrides": cfg.granularity_overrides}, model)
    kwargs = dict(mesh=mesh, reshard_after_forward=cfg.reshard_after_forward,
                  max_reuse_distance=cfg.max_reuse_distance,
                  grads_in_place=cfg.grads_in_place,
                  native_collectives=cfg.native_collectives,
                  granularity=granularity,
                  max_buffers=cfg.max_buffers, align_bytes=cfg.align_bytes,
                  mp_policy=fsdp.MixedPrecisionPolicy(
                      param_dtype=getattr(torch, cfg.param_dtype) if cfg.param_dtype else None,
                      reduce_dtype=getattr(torch, cfg.reduce_dtype) if cfg.reduce_dtype else None))
    wrapped = set()

    def visit(module):  # post-order: children become units before their parents
        unmanaged = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            unmanaged += visit(child)
        if module is model:
            return unmanaged
        wanted = type(module).__name__ in cfg.module_classes if cfg.module_classes else (
            cfg.min_params is not None and unmanaged >= cfg.min_params)
        if wanted and unmanaged:
            fsdp.fully_shard(module, **kwargs)
            wrapped.add(module)
            return 0
        return unmanaged

    visit(model)
    if cfg.module_classes and not wrapped:
        raise ValueError(f"vescale.wrap_policy.module_classes {list(cfg.module_classes)} match "
                         "no module of the model")
    return fsdp.fully_shard(model, **kwargs)
