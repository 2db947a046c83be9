"""The FSDP runtime: fully_shard and what it makes, in the order its modules import each other:
faces.py (what a module holds for a sharded parameter between steps) < policy.py
(MixedPrecisionPolicy, granularity per parameter, the sharding, memory and communication
policies) < param.py (ShardedParameter) <
lookup.py (the units and parameters under a module) < guards.py (moves, casts, init_weights,
meta leftovers) < unit_build.py (wrap time: find, check, plan) < param_group.py (ParamGroup:
unshard, reshard, reduce) < context.py (what a root's units share; the end-of-backward
callback) < backward.py (a unit's backward: its state, hooks, reduction) < unit.py
(FSDPUnit: forward hooks, root, prefetch, when to unshard) < module_class.py (the FSDPModule class a wrapped module gets, its
methods on the unit) < fsdp2_args.py (FSDP2's fully_shard arguments in our terms) <
materialize.py (meta-device materialization, users call `vescale_engine.materialize`;
reset_parameters at full shape) < deferred.py (the record a deferred build leaves) < api.py (fully_shard, no_sync, release) < state_dict.py
(gathered_parameters, full/sharded state dicts, the one per-DBuffer gather); lending.py
(which object holds a parameter's full tensor now; a parameter read in forward). Must not know
about checkpoint files,
optimizer classes, the config or the engine.
"""
from .api import fully_shard, no_sync, register_fsdp_forward_method
from .lookup import sharded_parameters, unit_of
from .policy import MixedPrecisionPolicy
from .state_dict import full_state_dict, gathered_parameters, sharded_state_dict

__all__ = ["fully_shard", "MixedPrecisionPolicy", "no_sync", "gathered_parameters",
           "full_state_dict", "sharded_state_dict", "sharded_parameters", "unit_of",
           "register_fsdp_forward_method"]
