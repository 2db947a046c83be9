"""What DeepSpeed adds to our engine's `initialize`, through the engine's extension points
(engine/extensions.py), for every config and whether or not `patch_deepspeed()` ran: the meaning
of an unset gradient_clipping, the refusal of a model DeepSpeed's own zero.Init partitioned, its
ZeRO-3 leaf modules, its MoE layers' experts (moe.py), its learning-rate schedulers by name and
its Ulysses data loader; and the engine's optimizer, whose state its safe_* accessors read
(params.py)."""
from __future__ import annotations

import importlib.util

from ...engine.extensions import EngineExtension
from .moe import expert_sharding
from .params import serve_optimizer
from .zero_init import require_not_partitioned

__all__ = ["GRADIENT_CLIPPING_DEFAULT", "extension"]

# DeepSpeed's GRADIENT_CLIPPING_DEFAULT (deepspeed/runtime/constants.py): 1.0 from the lowest
# supported DeepSpeed to 0.19.8. Ours, not read from their source: tests/engine/
# test_engine_config.py compares it with the installed DeepSpeed's and fails naming both if
# they part. DeepSpeed clips at it when a config does not set gradient_clipping, so an unset
# key means it here too while DeepSpeed is installed (0, no clipping, without DeepSpeed).
GRADIENT_CLIPPING_DEFAULT = 1.0


def flag_leaf_modules(model, cfg) -> None:
    """Flag the config's `zero_optimization.leaf_module` as DeepSpeed's engine does, with
    DeepSpeed's own parser and matcher (its default classes when the config names none);
    engine/leaf_modules.py makes each flagged module one unit."""
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config
    leaves = DeepSpeedZeroLeafModuleConfig(**(cfg.wrap.leaf_module or {}))
    apply_zero_leaf_module_config(model, leaves)


def scheduler_class(name: str):
    """DeepSpeed's scheduler of that name (deepspeed.runtime.lr_schedules), or None."""
    try:
        from deepspeed.runtime import lr_schedules
    except ImportError:
        return None
    return getattr(lr_schedules, name, None)


def sequence_parallel_loader(dataset, mpu, micro_batch: int, collate_fn, device):
    """initialize's training loader under sequence parallelism: every rank draws its own
    samples (a sampler over all ranks), and DeepSpeed's UlyssesSPDataLoaderAdapter hands each
    SP rank its chunk of one sample at a time, as DeepSpeed's tutorial builds it. Its batches
    have `shift_labels` instead of `labels` and need `position_ids` (the adapter says so)."""
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    loader = torch.utils.data.DataLoader(dataset, batch_size=micro_batch, sampler=sampler,
                                         collate_fn=collate_fn,
                                         pin_memory=device.type == "cuda")
    return UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(),
                                      sp_group=mpu.get_sequence_parallel_group(),
                                      sp_world_size=mpu.get_sequence_parallel_world_size(),
                                      device=device)


def extension() -> EngineExtension:
    installed = importlib.util.find_spec("deepspeed") is not None
    return EngineExtension(
        "deepspeed",
        config_defaults={"gradient_clipping": GRADIENT_CLIPPING_DEFAULT} if installed else {},
        check_model=require_not_partitioned, before_wrap=flag_leaf_modules,
        extra_units=expert_sharding, scheduler_class=scheduler_class,
        sequence_parallel_loader=sequence_parallel_loader,
        engine_built=lambda engine: serve_optimizer(engine.optimizer))
