"""`patch_deepspeed()`: the one-line migration for existing ZeRO scripts and for frameworks
that call `deepspeed.initialize` themselves (Hugging Face Trainer, Accelerate). After it,
`deepspeed.initialize` returns our engine when the config has a "vescale" section, and
DeepSpeed's own engine otherwise (`deepspeed.tp_model_init` likewise: a vescale config's model
is left to initialize's TP plan); Accelerate unwraps our engine as it unwraps DeepSpeed's;
`deepspeed.zero.Init` builds on the meta device for such a config (init/zero.py; transformers'
from_pretrained / from_config under it: init/hf_pretrained.py); `deepspeed.checkpointing.configure`
reads such a config's activation_checkpointing section as DeepSpeed's own; and the per-parameter ZeRO-3 surface
libraries read (`ds_status`, `ds_shape`, `GatheredParameters`, TRL's generation hooks) works on
our sharded parameters (deepspeed_params)."""
from __future__ import annotations

import functools
import inspect
import sys

__all__ = ["patch_deepspeed", "patch_accelerate_unwrap", "patch_accelerate_state_dict"]

_OUR_ARGUMENTS = ("args", "model", "optimizer", "model_parameters", "training_data",
                  "lr_scheduler", "mpu", "dist_init_required", "collate_fn", "config",
                  "config_params")


def _config_of(kwargs):
    from config_schemas.validate import read_config
    source = kwargs.get("config") or kwargs.get("config_params")
    if source is None and kwargs.get("args") is not None:
        source = getattr(kwargs["args"], "deepspeed_config", None)
    return read_config(source) if source is not None else None


def patch_deepspeed() -> None:
    """Route `deepspeed.initialize` to `vescale_engine.initialize` for vescale configs, let
    Accelerate unwrap our engine, make `deepspeed.zero.Init` build on meta for vescale
    configs, and give our parameters DeepSpeed's per-parameter surface (idempotent). DeepSpeed's launcher, `deepspeed.comm` and `init_distributed` are
    untouched. A library below the versions we support is an error here (versions.py)."""
    import deepspeed  # noqa: F401  (imported, so that its version is checked with the rest)

    from ..fsdp import deepspeed_params
    from ..init.zero import install as install_zero_init
    from ..versions import check_versions
    check_versions()
    _route_initialize()
    _route_tp_model_init()
    _route_checkpointing_configure()
    patch_accelerate_unwrap()
    patch_accelerate_state_dict()
    install_zero_init()
    deepspeed_params.install()
    deepspeed_params.patch_trl_generation()  # now if TRL is imported, else at the first gather


def patch_accelerate_unwrap() -> None:
    """`accelerator.unwrap_model(engine)` returns the model. Accelerate's
    `extract_model_from_parallel` (behind unwrap_model, transformers' unwrap_model and
    Trainer's label smoothing, which asks the unwrapped model its class) recognises
    DeepSpeedEngine only: ours is unwrapped first, then Accelerate's own runs. Modules that
    imported the function by name get the new one too. Nothing to do without Accelerate."""
    try:
        import accelerate
        import accelerate.utils.other as other
    except ImportError:
        return
    original = getattr(other, "extract_model_from_parallel", None)
    if original is None:
        raise ImportError(
            f"accelerate {getattr(accelerate, '__version__', '?')} has no "
            "accelerate.utils.other.extract_model_from_parallel: vescale_engine.patch_deepspeed() "
            "cannot make accelerator.unwrap_model return the model with this version")
    if hasattr(original, "__vescale_original__"):
        return

    @functools.wraps(original)
    def extract_model_from_parallel(model, *args, **kwargs):
        from .engine import VeScaleEngine
        while isinstance(model, VeScaleEngine):
            model = model.module
        return original(model, *args, **kwargs)

    extract_model_from_parallel.__vescale_original__ = original
    for module in list(sys.modules.values()):
        # __dict__, not getattr: lazy modules (transformers) import nothing here
        if getattr(module, "__dict__", {}).get("extract_model_from_parallel") is original:
            module.extract_model_from_parallel = extract_model_from_parallel


def patch_accelerate_state_dict() -> None:
    """`accelerator.get_state_dict(engine)` (behind Trainer.save_model) gathers the full model
    to rank 0 for our engine at every ZeRO stage. Accelerate gathers only at stage 3 and
    otherwise reads the unwrapped model's state_dict(), which for our engine (parameters are
    sharded at every stage) holds each rank's flat pieces."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return
    original = Accelerator.get_state_dict
    if hasattr(original, "__vescale_original__"):
        return

    @functools.wraps(original)
    def get_state_dict(self, model, unwrap=True):
        from .engine import VeScaleEngine
        if isinstance(model, VeScaleEngine) and model.zero_optimization_stage() < 3:
            return model._zero3_consolidated_16bit_state_dict()
        return original(self, model, unwrap)

    get_state_dict.__vescale_original__ = original
    Accelerator.get_state_dict = get_state_dict


def _route_initialize() -> None:
    import deepspeed

    if hasattr(deepspeed.initialize, "__vescale_original__"):
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if args:  # DeepSpeed's positional order starts like ours: name them
            kwargs.update(zip(_OUR_ARGUMENTS, args))
        config = _config_of(kwargs)
        if isinstance(config, dict) and "vescale" in config:
            from .engine import initialize as ours
            unknown = sorted(set(kwargs) - set(_OUR_ARGUMENTS) - {"distributed_port",
                                                                  "mesh_param"})
            if unknown:
                raise TypeError(f"deepspeed.initialize got arguments veScale does not know: "
                                f"{unknown}")
            return ours(**{k: v for k, v in kwargs.items() if k in _OUR_ARGUMENTS})
        return original(**kwargs)

    initialize.__vescale_original__ = original
    deepspeed.initialize = initialize


def _route_tp_model_init() -> None:
    """`deepspeed.tp_model_init(model, tp_size, dtype, config=...)`, which transformers' Trainer
    calls before `initialize` when the config has tensor_parallel.autotp_size: for a vescale
    config the model is returned as it is (initialize applies the TP plan); DeepSpeed's own
    would record its AutoTP arguments process-wide, where a later DeepSpeed engine finds them."""
    import deepspeed

    original = getattr(deepspeed, "tp_model_init", None)
    if original is None or hasattr(original, "__vescale_original__"):
        return

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

    tp_model_init.__vescale_original__ = original
    deepspeed.tp_model_init = tp_model_init


def _route_checkpointing_configure() -> None:
    """`deepspeed.checkpointing.configure(mpu, deepspeed_config=...)`: how Megatron-style scripts
    turn on DeepSpeed's activation checkpointing from the config's activation_checkpointing
    section (DeepSpeed's engine itself reads none of it). DeepSpeed's `checkpoint` recomputes
    reentrantly, which our units hook, and acts on every key itself. For a vescale config two
    things differ from DeepSpeed: `deepspeed.comm`, which it logs and gathers through and which
    DeepSpeed's initialize would have started, is started over the existing process group; and
    cpu_checkpointing without partition_activations, which DeepSpeed accepts and then fails on
    in backward (it offloads only partitioned activations), is refused by name."""
    import deepspeed

    checkpointing = deepspeed.checkpointing  # (runtime.activation_checkpointing.checkpointing)
    original = checkpointing.configure
    if hasattr(original, "__vescale_original__"):
        return

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

    configure.__vescale_original__ = original
    checkpointing.configure = configure


def _start_deepspeed_comm() -> None:
    """deepspeed.comm over the process group our initialize (or the launcher) made."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist
    if dist.is_initialized() and not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
