"""The optimizer, learning-rate scheduler and parameter groups a DeepSpeed-style config (or the
client's objects) asks for, with DeepSpeed's meaning of its keys."""
from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist

from .. import optim
from . import extensions

__all__ = ["optimizer_spec", "build_optimizer", "client_optimizer_groups", "rebuild_optimizer",
           "rebuild_for_offload", "check_client_scheduler", "build_scheduler", "named_model_parameters",
           "resolve_named_parameters"]

LOG = logging.getLogger("vescale_engine")

# DeepSpeed's Adam switches: they choose among DeepSpeed's kernels, whose math ours matches.
_DEEPSPEED_ADAM_KEYS = ("torch_adam", "adam_w_mode")


def optimizer_spec(spec: dict | None) -> tuple[str, dict]:
    """(class name, keyword arguments) for the config's "optimizer" section, checked against
    the class's signature so a wrong key fails before the model is wrapped.

    DeepSpeed's meaning is kept: type "Adam" is AdamW (decoupled weight decay) unless
    `adam_w_mode` is false, and weight_decay defaults to 0 as in DeepSpeed's FusedAdam unless
    `torch_adam` asks for torch's class (whose default is 1e-2)."""
    spec = spec or {"type": "AdamW", "params": {}}
    name, kwargs = spec["type"], dict(spec.get("params", {}))
    if name in ("Adam", "AdamW"):
        torch_adam = kwargs.pop("torch_adam", False)
        decoupled = kwargs.pop("adam_w_mode", True) or name == "AdamW"
        name = "AdamW" if decoupled else "Adam"
        if not torch_adam:
            kwargs.setdefault("weight_decay", 0.0)
    cls = optim.OURS.get(name) or getattr(torch.optim, name, None)
    if cls is None:
        raise ValueError(f"optimizer.type {name!r} is neither one of ours "
                         f"({', '.join(optim.OURS)}) nor a torch.optim class")
    accepted = [p for p in inspect.signature(cls.__init__).parameters
                if p not in ("self", "params")]
    for key in kwargs:
        if key not in accepted:
            raise ValueError(f"optimizer.params.{key}: not a parameter of {name} "
                             f"(accepted: {', '.join(accepted)})")
    return name, kwargs


def build_optimizer(spec, client, params):
    """The client's optimizer class or callable(params), else the config's optimizer. (An
    optimizer instance goes through `client_optimizer_groups` and `rebuild_optimizer`.)"""
    if client is not None:
        return client(params)
    name, kwargs = optimizer_spec(spec)
    if name == "AdamW":
        try:
            return optim.AdamW(params, **kwargs)
        except ValueError as err:
            if "hyperparameters" in str(err):
                raise
            # Groups that split a flat buffer (a subset of parameters, or different lr/betas
            # in one buffer): torch's AdamW does the same math per parameter.
            if not dist.is_initialized() or dist.get_rank() == 0:
                LOG.info("optimizer AdamW: per-buffer AdamW cannot step these parameter groups "
                         "(%s); using torch.optim.AdamW", err)
            return torch.optim.AdamW(params, **kwargs)
    return optim.build_optimizer(name, params, kwargs)


def client_optimizer_groups(optimizer, model) -> list:
    """An optimizer instance passed to initialize (Hugging Face Trainer passes the one its
    create_optimizer built over the model's parameters), checked before wrapping: its parameter
    groups with parameter names instead of parameters (wrapping replaces every parameter
    object; names stay). It must not have stepped: its state could not follow the shards."""
    name = type(optimizer).__name__
    if optimizer.state:
        raise ValueError(f"the {name} passed to initialize already holds state for "
                         f"{len(optimizer.state)} parameters (it has stepped): pass it before its "
                         "first step, or pass its class or a callable(params)")
    return named_model_parameters(optimizer.param_groups, model, f"the {name} passed to "
                                  "initialize")


def rebuild_optimizer(optimizer, groups):
    """The client's optimizer instance made again over the sharded parameters `groups` (its
    groups as `client_optimizer_groups` named them, resolved): its own class, called with its
    defaults, each group keeping its hyperparameters. The instance itself is rebuilt, as
    DeepSpeed rewrites the client optimizer's groups in place, so whatever holds it keeps
    working: a scheduler built on it (Accelerate steps such a scheduler itself), Trainer's and
    Accelerate's references. Hooks registered on it and a scheduler's step wrapper stay."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items()
              if k in accepted and k not in ("self", "params")}
    try:
        fresh = cls(groups, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot rebuild the {cls.__name__} passed to initialize over the "
                         f"sharded parameters ({err}); pass its class or a callable(params) "
                         "instead") from None
    kept = {k: v for k, v in vars(optimizer).items() if k == "step" or k.endswith("_hooks")}
    vars(optimizer).update(vars(fresh))
    vars(optimizer).update(kept)
    return optimizer


def rebuild_for_offload(optimizer, groups):
    """With offload_optimizer: the client's AdamW instance made again as ours
    (vescale_engine.optim.AdamW, which steps whole flat shards on the host) over the sharded
    parameters `groups` (as `client_optimizer_groups` named them, resolved), each group keeping
    its lr, betas, eps and weight_decay. Taken: exactly torch.optim.AdamW (Hugging Face
    Trainer's default; its decay / no-decay groups), or the DeepSpeedCPUAdam in AdamW mode that
    Accelerate makes of it when offload is on (unless zero_force_ds_cpu_optimizer is false),
    with amsgrad and maximize off and no state. Anything else is a one-line error naming what to
    add. Bitwise the same as the client's class it is not (torch's per-tensor AdamW and our
    fused flat step round differently in the last bit), so without offload the client's class
    stays (`rebuild_optimizer`).

    The client's group dicts themselves become ours' groups (their "params" replaced), as
    DeepSpeed rewrites the client optimizer's groups in place: a scheduler built on the client's
    instance, or on the torch AdamW Accelerate mapped, sets the lr ours reads. Returns ours."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__name__}"
    reason = _why_not_our_adamw(optimizer)
    if reason is not None:
        raise ValueError(f"zero_optimization.offload_optimizer: the {name} passed to initialize "
                         f"cannot be stepped on the host ({reason}); offload works with our "
                         "AdamW, AdamW8bit and Muon: add an \"optimizer\" section (type AdamW, "
                         "AdamW8bit or Muon) to the config, or pass torch.optim.AdamW or "
                         "vescale_engine.optim.AdamW")
    keys = ("lr", "betas", "eps", "weight_decay")
    for client_group, group in zip(optimizer.param_groups, groups, strict=True):
        client_group["params"] = group["params"]
    defaults = {k: optimizer.defaults[k] for k in keys}
    try:
        return optim.AdamW(optimizer.param_groups, **defaults)
    except ValueError as err:  # groups that split a flat buffer
        raise ValueError(f"zero_optimization.offload_optimizer: the {name} passed to "
                         f"initialize cannot be stepped on the host as our AdamW ({err}); add "
                         "an \"optimizer\" section (type AdamW) to the config so that the "
                         "engine builds it") from None


def _why_not_our_adamw(optimizer) -> str | None:
    """Why `optimizer` cannot become our AdamW with the same math, or None."""
    cls = type(optimizer)
    if cls is torch.optim.AdamW:
        pass
    elif cls.__name__ == "DeepSpeedCPUAdam" and cls.__module__.startswith("deepspeed."):
        if not getattr(optimizer, "adam_w_mode", False):
            return "adamw_mode is false: Adam with L2 decay, not AdamW"
        if not getattr(optimizer, "fp32_optimizer_states", True):
            return "fp32_optimizer_states is false"
    else:
        return "only torch.optim.AdamW itself, or the DeepSpeedCPUAdam Accelerate makes of it, " \
            "is rebuilt as ours"
    for i, group in enumerate(optimizer.param_groups):
        for key, want in (("amsgrad", False), ("maximize", False), ("bias_correction", True)):
            if key in group and group[key] != want:
                return f"param_groups[{i}] has {key}={group[key]}"
    return None


def check_client_scheduler(scheduler, optimizer):
    """A scheduler object must step the optimizer the engine uses: the instance passed with it
    (rebuilt in place). One bound to any other optimizer would change learning rates nobody
    uses; checked before wrapping."""
    if scheduler is None or not hasattr(scheduler, "step"):
        return  # none, or a callable(optimizer): built on the engine's optimizer
    bound = getattr(scheduler, "optimizer", None)
    if bound is not None and bound is not optimizer:
        what = "the optimizer instance passed with it" if isinstance(
            optimizer, torch.optim.Optimizer) else "none passed to initialize (the engine " \
            "builds its own)"
        raise ValueError(f"lr_scheduler {type(scheduler).__name__} steps an optimizer that is "
                         f"not the engine's ({what}): pass a callable(optimizer) that builds "
                         "it, or the optimizer it was built on")


def build_scheduler(spec, client, optimizer):
    """The client's scheduler (object or callable(optimizer)), else an integration's scheduler
    of that name (DeepSpeed's lr_schedules: extensions.py), else torch's."""
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if spec is None:
        return None
    name, kwargs = spec["type"], dict(spec.get("params", {}))
    cls = extensions.first_answer("scheduler_class", name) or \
        getattr(torch.optim.lr_scheduler, name, None)
    if cls is None:
        raise ValueError(f"scheduler.type {name!r} is neither a DeepSpeed nor a torch scheduler")
    return cls(optimizer, **kwargs)


def named_model_parameters(model_parameters, model, what="model_parameters"):
    """DeepSpeed's model_parameters (parameters, or param-group dicts) as parameter names,
    checked before wrapping: wrapping replaces every parameter object, names stay. Plain
    parameters give a list of names, groups a list of group dicts with names."""
    names = {id(p): name for name, p in model.named_parameters()}

    def name_of(p):
        if id(p) not in names:
            raise ValueError(f"{what} holds a tensor of shape {list(p.shape)} that "
                             "is not a parameter of the model")
        return names[id(p)]

    groups, any_dict = [], False
    for item in model_parameters:
        if isinstance(item, dict):
            any_dict = True
            if "params" not in item:
                raise ValueError("a model_parameters group dict needs a 'params' key")
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            groups.append({**item, "params": [name_of(p) for p in params]})
        else:
            groups.append({"params": [name_of(item)]})
    if not any_dict:  # plain parameters stay plain (Muon makes its own groups of them)
        return [n for g in groups for n in g["params"]]
    return groups


def resolve_named_parameters(groups, module):
    """The wrapped module's parameters for the names `named_model_parameters` returned."""
    by_name = dict(module.named_parameters())
    return [by_name[g] if isinstance(g, str) else
            {**g, "params": [by_name[n] for n in g["params"]]} for g in groups]
