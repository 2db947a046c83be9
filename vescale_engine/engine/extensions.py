"""The engine's extension points: what an integration of another library adds to `initialize`
without the engine naming the library. Each field of `EngineExtension` is a role the engine
calls at one place; an integration fills the roles it has (integrations/, registered by
`integrations.connect()`, which the package root's `_connect()` calls: initialize,
build_config, apply_parallel_plan and `vescale_engine.materialize` call it first).

- `config_defaults`: what an unset config key means (DeepSpeed's gradient_clipping, 1.0);
- `check_model(model)`: a model refused before anything changes (one DeepSpeed's own zero.Init
  partitioned);
- `before_wrap(model, cfg)`: flags set on the model before the units are chosen (DeepSpeed's
  leaf modules);
- `extra_units(model, cfg, mesh)`: None, or an object giving layers units of their own
  (DeepSpeed MoE experts): `units(model, chosen) -> tuple` (the units to shard, innermost
  first) and `sharding(module, policy) -> dict` (fully_shard's keywords for one of them);
- `scheduler_class(name)`: the scheduler class a config's scheduler.type names, or None
  (DeepSpeed's lr_schedules; torch's are the engine's own fallback);
- `sequence_parallel_loader(dataset, mpu, micro_batch, collate_fn, device)`: the training
  loader under sequence parallelism (DeepSpeed's Ulysses adapter);
- `engine_built(engine)`: what an integration does with a new engine (DeepSpeed's safe_*
  accessors read its optimizer's state; transformers' save_pretrained is guarded on its model);
- `tensor_parallel(model, mesh, plan)` and `expert_parallel(model, ep_mesh, tp_mesh, plan)`:
  how a model's own TP / EP plan is applied (transformers' plans).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["EngineExtension", "register", "registered", "config_default", "first_answer",
           "the_one"]


@dataclass(frozen=True)
class EngineExtension:
    """One library's roles; a role left None is one it does not fill."""
    library: str
    config_defaults: Mapping = field(default_factory=dict)
    check_model: Callable | None = None
    before_wrap: Callable | None = None
    extra_units: Callable | None = None
    scheduler_class: Callable | None = None
    sequence_parallel_loader: Callable | None = None
    engine_built: Callable | None = None
    tensor_parallel: Callable | None = None
    expert_parallel: Callable | None = None


_REGISTERED: dict[str, EngineExtension] = {}


def register(extension: EngineExtension) -> None:
    """Add (or replace: registering again is harmless) one library's extension."""
    _REGISTERED[extension.library] = extension


def registered(role: str | None = None) -> tuple:
    """The registered extensions, in registration order; with `role`, those that fill it."""
    return tuple(e for e in _REGISTERED.values() if role is None or getattr(e, role))


def config_default(key: str, otherwise):
    """What an unset `key` means: the first registered extension's default, else `otherwise`."""
    for extension in registered():
        if key in extension.config_defaults:
            return extension.config_defaults[key]
    return otherwise


def first_answer(role: str, *args):
    """The first answer other than None of the extensions that fill `role`, else None."""
    for extension in registered(role):
        answer = getattr(extension, role)(*args)
        if answer is not None:
            return answer
    return None


def the_one(role: str, needed_for: str) -> Callable:
    """The function filling `role`; a one-line error naming `needed_for` when none does."""
    found = registered(role)
    if not found:
        raise RuntimeError(f"{needed_for} needs an integration that fills {role!r}, and none is "
                           "registered (vescale_engine.integrations.connect() registers them)")
    return getattr(found[0], role)
