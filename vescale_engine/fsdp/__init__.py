"""The FSDP runtime: fully_shard and what it makes (ShardedParameter, the unit and its hooks,
prefetch, accumulation, no_sync, mixed precision, HSDP), the state-dict utilities
(gathered_parameters, full/sharded state dicts, gather_to_rank0: the one per-DBuffer gather),
the guards on moves and casts (runtime.py), meta-device materialization (materialize.py;
users call `vescale_engine.materialize`) and what DeepSpeed-aware libraries read on our
parameters (deepspeed_params.py). Must not know about checkpoint files, optimizer classes, the
config or the engine.
"""
from .runtime import (MixedPrecisionPolicy, full_state_dict, fully_shard, gathered_parameters,
                      no_sync, sharded_parameters, sharded_state_dict, unit_of)

__all__ = ["fully_shard", "MixedPrecisionPolicy", "no_sync", "gathered_parameters",
           "full_state_dict", "sharded_state_dict", "sharded_parameters", "unit_of"]
