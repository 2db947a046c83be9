"""`patch_deepspeed()`: the one-line migration for existing ZeRO scripts and for frameworks
that call `deepspeed.initialize` themselves. After it, `deepspeed.initialize` returns our
engine when the config has a "vescale" section, and DeepSpeed's own engine otherwise; and
`deepspeed.zero.Init` builds on the meta device for such a config (zero_init; transformers'
from_pretrained / from_config under it: hf_zero_init)."""
from __future__ import annotations

import functools

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
    """Route `deepspeed.initialize` to `vescale_engine.initialize` for vescale configs
    (idempotent). DeepSpeed's launcher, `deepspeed.comm` and `init_distributed` are untouched."""
    import deepspeed

    from .zero_init import install as install_zero_init
    install_zero_init()  # idempotent on its own
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
            if kwargs.get("model") is not None:
                from .zero_init import require_not_partitioned
                require_not_partitioned(kwargs["model"])
            return ours(**{k: v for k, v in kwargs.items() if k in _OUR_ARGUMENTS})
        return original(**kwargs)

    initialize.__vescale_original__ = original
    deepspeed.initialize = initialize
