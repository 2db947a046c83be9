"""DeepSpeed's names, patched for configs with a "vescale" section (DeepSpeed's own code runs for
every other config). Supported: deepspeed versions.SUPPORTED["deepspeed"] (0.19.3 to 0.19.x);
`install` checks each name below before replacing it.

- `deepspeed.initialize` returns our engine (`vescale_engine.initialize`); given DeepSpeed's
  sequence-parallel mpu, it sets `deepspeed.utils.groups.mpu` as DeepSpeed's engine does.
- `deepspeed.tp_model_init` returns the model as it is (initialize applies the TP plan);
  DeepSpeed's own would record its AutoTP arguments process-wide, where a later DeepSpeed
  engine finds them. Transformers' Trainer calls it before `initialize` when the config has
  tensor_parallel.autotp_size.
- `deepspeed.checkpointing.configure(mpu, deepspeed_config=...)` starts `deepspeed.comm` over
  the existing process group and refuses cpu_checkpointing without partition_activations
  (DeepSpeed accepts it and then fails in backward: it offloads only partitioned activations).
- `deepspeed.zero.Init` builds on the meta device (zero_init.py's MetaInit), and
  `deepspeed.zero.GatheredParameters` gathers our sharded parameters
  (params.py's GatheredShards), refusing parameters a vescale Init left on meta;
  any others in the same call go to DeepSpeed's own.
- `torch.nn.Parameter.ds_status` / `ds_shape` (torch's class, patched for DeepSpeed's
  surface): descriptors that answer for our parameters, keep the values DeepSpeed stores on its
  own, and raise AttributeError (hasattr is False) for every other parameter, as without them
  (params.py says who reads them). A parameter a vescale zero.Init left on
  meta is NOT_AVAILABLE, as DeepSpeed's partitioned ones.
- `deepspeed.utils.safe_get_full_fp32_param` and the other `safe_*` accessors of the fp32
  parameter, gradient and optimizer state (in `deepspeed.utils` and `deepspeed.utils.
  tensor_fragment`): for our parameters they read and write our shards
  (params.py's local_piece, full_value, set_full_value); DeepSpeed's own for
  every other parameter.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Iterable

import torch
from torch import nn

from ...fsdp.deferred import deferred_of
from ...fsdp.lending import holds_full
from ...fsdp.param import sharding_of
from ..registry import missing_name, replace
from .params import GatheredShards, full_value, local_piece, set_full_value
from .zero_init import MetaInit, refuse_gathering, zero_init_config

__all__ = ["install"]

_OUR_ARGUMENTS = ("args", "model", "optimizer", "model_parameters", "training_data",
                  "lr_scheduler", "mpu", "dist_init_required", "collate_fn", "config",
                  "config_params")


def _config_of(kwargs):
    from config_schemas.validate import read_config
    source = kwargs.get("config") or kwargs.get("config_params")
    if source is None and kwargs.get("args") is not None:
        source = getattr(kwargs["args"], "deepspeed_config", None)
    return read_config(source) if source is not None else None


def _is_ours(value) -> bool:
    return hasattr(value, "__vescale_original__")


# DeepSpeed's private names the core reads (not patched), checked here with the patched ones:
# the expert-data-parallel groups of its MoE layers (moe.py) and the status
# ds_status answers with.
_READ = (("deepspeed.utils.groups", "_get_expert_data_parallel_group_dict"),
         ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus"))


def install() -> None:
    """Every patch of the module docstring (idempotent)."""
    import deepspeed
    from deepspeed import checkpointing, zero
    for module_name, name in _READ:
        if not hasattr(importlib.import_module(module_name), name):
            raise missing_name("deepspeed", f"{module_name}.{name}")
    for owner, name, make in ((deepspeed, "initialize", _initialize),
                              (deepspeed, "tp_model_init", _tp_model_init),
                              (checkpointing, "configure", _configure),
                              (zero, "Init", _init),
                              (zero, "GatheredParameters", _gathered_parameters)):
        _wrap(owner, name, make)
    _install_accessors()
    for name, compute in (("ds_status", _ds_status), ("ds_shape", _ds_shape)):
        if not isinstance(nn.Parameter.__dict__.get(name), _Attribute):
            replace("deepspeed", nn.Parameter, name, _Attribute(name, compute), absent_ok=True)


# -- deepspeed.initialize, tp_model_init, checkpointing.configure --------------------------------

def _initialize(original):
    positional = list(inspect.signature(original).parameters)  # DeepSpeed's order

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if args:  # by DeepSpeed's names (its 7th is distributed_port, not mpu)
            kwargs.update(zip(positional, args))
        config = _config_of(kwargs)
        if isinstance(config, dict) and "vescale" in config:
            from ...engine.engine import initialize as ours
            unknown = sorted(set(kwargs) - set(_OUR_ARGUMENTS) - {"distributed_port",
                                                                  "mesh_param"})
            if unknown:
                raise TypeError(f"deepspeed.initialize got arguments veScale does not know: "
                                f"{unknown}")
            if kwargs.get("mesh_param") is not None:  # DeepSpeed's own TP/SP mesh
                raise TypeError("deepspeed.initialize(mesh_param=...) with a \"vescale\" "
                                "section: give the parallel sizes in the config instead "
                                "(tensor_parallel.autotp_size, docs/parallelism.md)")
            result = ours(**{k: v for k, v in kwargs.items() if k in _OUR_ARGUMENTS})
            _publish_sequence_parallel_mpu(result[0])
            return result
        return original(**kwargs)
    return initialize


def _publish_sequence_parallel_mpu(engine) -> None:
    """What DeepSpeed's engine does with a sequence-parallel mpu: it sets
    deepspeed.utils.groups.mpu, where DeepSpeed's tutorial, Accelerate's
    deepspeed_ulysses_dl_adapter and transformers' deepspeed_sp_compute_loss read the
    sequence-parallel group after initialize (recorded: unpatch() puts the old value back)."""
    if engine.sequence_parallel_size > 1:
        from deepspeed.utils import groups
        replace("deepspeed", groups, "mpu", engine.mpu)


def _tp_model_init(original):
    @functools.wraps(original)
    def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
        config_dict = _config_of({"config": config})
        if isinstance(config_dict, dict) and "vescale" in config_dict:
            want = (config_dict.get("tensor_parallel") or {}).get("autotp_size", 0) or 1
            if tp_size != want:
                raise ValueError(f"deepspeed.tp_model_init(tp_size={tp_size}) but the config's "
                                 f"tensor_parallel.autotp_size is {want}")
            return model
        return original(model, tp_size, dtype, config=config, **kwargs)
    return tp_model_init


def _configure(original):
    """How Megatron-style scripts turn on DeepSpeed's activation checkpointing from the
    config's activation_checkpointing section (DeepSpeed's engine itself reads none of it).
    DeepSpeed's `checkpoint` recomputes reentrantly, which our units hook, and acts on every
    key itself; `deepspeed.comm`, which it logs and gathers through and which DeepSpeed's
    initialize would have started, is started over the existing process group."""
    @functools.wraps(original)
    def configure(*args, **kwargs):
        given = inspect.signature(original).bind(*args, **kwargs).arguments
        config = _config_of({"config": given.get("deepspeed_config")})
        if isinstance(config, dict) and "vescale" in config:
            section = config.get("activation_checkpointing") or {}

            def value(argument, key):
                chosen = given.get(argument)
                return section.get(key, False) if chosen is None else chosen

            if value("checkpoint_in_cpu", "cpu_checkpointing") and \
                    not value("partition_activations", "partition_activations"):
                raise ValueError(
                    "activation_checkpointing.cpu_checkpointing needs partition_activations: "
                    "DeepSpeed's checkpoint offloads only partitioned activations, and fails in "
                    "backward without them")
            _start_deepspeed_comm()
        return original(*args, **kwargs)
    return configure


def _start_deepspeed_comm() -> None:
    """deepspeed.comm over the process group our initialize (or the launcher) made."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist
    if dist.is_initialized() and not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


# -- deepspeed.zero.Init and GatheredParameters ---------------------------------------------------

def _init(original):
    signature = inspect.signature(original.__init__)

    @functools.wraps(original, updated=())
    def Init(*args, **kwargs):
        try:
            arguments = signature.bind(None, *args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # DeepSpeed's own message
        config = zero_init_config(arguments)
        return original(*args, **kwargs) if config is None else MetaInit(config, arguments)
    return Init


def _gathered_parameters(original):
    @functools.wraps(original, updated=())
    def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
        if not enabled or not isinstance(params, (torch.Tensor, Iterable)):
            return original(params, modifier_rank=modifier_rank, fwd_module=fwd_module,
                            enabled=enabled)
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        refuse_gathering(params)
        ours = [p for p in params if sharding_of(p, full=True) is not None]
        if not ours:
            return original(params, modifier_rank=modifier_rank, fwd_module=fwd_module)
        rest = [p for p in params if sharding_of(p, full=True) is None]  # DeepSpeed's, or plain ones
        return GatheredShards(ours, modifier_rank, fwd_module,
                              others=original(rest, modifier_rank=modifier_rank,
                                              fwd_module=fwd_module) if rest else None)
    return GatheredParameters


# -- ds_status / ds_shape on nn.Parameter --------------------------------------------------------

class _Attribute:
    """A ds_* attribute of nn.Parameter: a value stored on the object (DeepSpeed's own params)
    wins; vescale's parameters compute it; any other parameter has none."""

    def __init__(self, name, compute):
        self.name = name
        self.compute = compute

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        stored = obj.__dict__.get(self.name, _Attribute)
        if stored is not _Attribute:
            return stored
        sp = sharding_of(obj, full=True)
        if sp is None and deferred_of(obj) is not None:  # built in a vescale zero.Init
            return self.compute(obj, None)
        if sp is None:
            raise AttributeError(f"'{type(obj).__name__}' object has no attribute '{self.name}'")
        return self.compute(obj, sp)

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value

    def __delete__(self, obj):
        if obj.__dict__.pop(self.name, _Attribute) is _Attribute:
            raise AttributeError(self.name)


def _ds_status(p, sp):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return ZeroParamStatus.AVAILABLE if sp is not None and holds_full(p, sp) else \
        ZeroParamStatus.NOT_AVAILABLE


def _ds_shape(p, sp):
    return torch.Size(sp.shape if sp is not None else p.shape)


# -- deepspeed.utils.safe_* ----------------------------------------------------------------------

# name -> (full or local, get or set, what; None: the optimizer state key argument)
_ACCESSORS = {
    "safe_get_full_fp32_param": ("full", "get", "param"),
    "safe_set_full_fp32_param": ("full", "set", "param"),
    "safe_get_full_grad": ("full", "get", "grad"),
    "safe_set_full_grad": ("full", "set", "grad"),
    "safe_get_full_optimizer_state": ("full", "get", None),
    "safe_set_full_optimizer_state": ("full", "set", None),
    "safe_get_local_fp32_param": ("local", "get", "param"),
    "safe_set_local_fp32_param": ("local", "set", "param"),
    "safe_get_local_grad": ("local", "get", "grad"),
    "safe_set_local_grad": ("local", "set", "grad"),
    "safe_get_local_optimizer_state": ("local", "get", None),
    "safe_set_local_optimizer_state": ("local", "set", None),
}


def _install_accessors() -> None:
    utils = importlib.import_module("deepspeed.utils")
    fragment = importlib.import_module("deepspeed.utils.tensor_fragment")
    makers = {**{name: functools.partial(_accessor, **dict(zip(("scope", "verb", "what"), how)))
                 for name, how in _ACCESSORS.items()},
              "safe_update_full_grad_vectorized": _update_full_grads}
    for name, make in makers.items():
        for owner in (utils, fragment):
            _wrap(owner, name, make)


def _wrap(owner, name: str, make) -> None:
    """`owner.name` replaced by `make(original)` (once: a second install finds ours); a
    DeepSpeed without the name is one line naming it."""
    current = getattr(owner, name, None)
    if current is None:
        raise missing_name("deepspeed", f"{owner.__name__}.{name}")
    if not _is_ours(current):
        new = make(current)
        new.__vescale_original__ = current
        replace("deepspeed", owner, name, new)


def _update_full_grads(original):
    """safe_update_full_grad_vectorized(params, update_func): `update_func(full gradient,
    param)` on our parameters' full gradients (gathered; the result written back to each
    rank's piece), DeepSpeed's own for the rest."""
    @functools.wraps(original)
    def update(param_list, update_func):
        rest = []
        for p in param_list:
            sp = sharding_of(p, full=True)
            if sp is None:
                rest.append(p)
            elif p.requires_grad:
                full = full_value(sp, "grad")
                if full is not None:
                    set_full_value(sp, "grad", update_func(full, p))
        if rest:
            original(rest, update_func)
    return update


def _accessor(original, scope, verb, what):
    """DeepSpeed's signatures: get(param[, key]) and set(param, value[, key])."""
    @functools.wraps(original)
    def accessor(param, *args):
        sp = sharding_of(param, full=True)
        if sp is None:
            return original(param, *args)
        key = what or args[-1]
        if not param.requires_grad:  # DeepSpeed keeps no fp32 copy, gradient or state of it
            if verb == "get":
                return None
            raise RuntimeError(f"deepspeed.utils.{original.__name__} on a frozen parameter of "
                               f"shape {list(sp.shape)}: DeepSpeed keeps no {key} of it to set")
        if scope == "full":
            return full_value(sp, key) if verb == "get" else set_full_value(sp, key, args[0])
        piece = local_piece(sp, key)
        if verb == "get":
            return piece
        value = args[0]
        if piece is None or piece.numel() != value.numel():
            raise RuntimeError(f"deepspeed.utils.{original.__name__}: this rank holds "
                               f"{0 if piece is None else piece.numel()} elements of {key} of "
                               f"{list(sp.shape)}, the value has {value.numel()}")
        with torch.no_grad():
            piece.copy_(value.reshape(-1))
        if key == "param":
            sp.unit.reshard()  # a gather made already (a prefetch) holds the old values
    return accessor
