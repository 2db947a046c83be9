"""veScale Engine: RaggedShard sharding, a structure-aware layout planner and zero-copy
distributed buffers behind a DeepSpeed-style API.

Names are imported lazily so that light tools (`vescale plan`) start without importing torch.
Importing defines names only; what the library sets up in the process (its log handler,
logs.py; the exit step that lets gloo's threads finish, launch/settle.py) is done by the calls
that need it: initialize, fully_shard, materialize and the launcher.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {
    "Granularity": "plan.granularity", "parse_granularity": "plan.granularity",
    "TensorSpec": "plan.planner", "plan_unit": "plan.planner", "check_plan": "plan.planner",
    "PlanError": "plan.planner",
    "RaggedShard": "shard.ragged",
    "fully_shard": "fsdp", "MixedPrecisionPolicy": "fsdp", "no_sync": "fsdp",
    "gathered_parameters": "fsdp", "full_state_dict": "fsdp", "sharded_state_dict": "fsdp",
    "load_hf_checkpoint": "checkpoint.hf", "save_hf_checkpoint": "checkpoint.hf",
    "allocate_shards": "materialize",
    "clip_grad_norm_": "optim.clip", "global_grad_norm": "optim.clip",
    "add_config_arguments": "engine.config", "initialize": "engine.engine",
    "VeScaleEngine": "engine.engine", "patch_deepspeed": "integrations", "unpatch": "integrations",
    "patch_fsdp2": "integrations",
    "Preempted": "engine.preemption",
}
# `materialize` is a callable submodule: vescale_engine.materialize(model) initializes,
# vescale_engine.materialize.allocate_shards(model) only allocates.
_SUBMODULES = ("optim", "materialize")


# Looking these up teaches torch's distribute_tensor and full-state-dict loaders the
# RaggedPlacement of the DTensors they make (integrations/torch.py), so FSDP2 code that
# loads full state dicts into them works unchanged.
_TEACH_TORCH = ("fully_shard",)


def _connect() -> None:
    """Register what the integrations of other libraries add to the engine's extension points
    (integrations.connect(); idempotent, patches nothing). The engine reaches integrations/
    only through this call, made by initialize, build_config, apply_parallel_plan and
    `vescale_engine.materialize`."""
    importlib.import_module(".integrations", __name__).connect()


def __getattr__(name):
    if name in _TEACH_TORCH:
        importlib.import_module(".integrations.torch", __name__).install()
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'vescale_engine' has no attribute {name!r}")


__all__ = sorted(_LAZY) + list(_SUBMODULES) + ["__version__"]
