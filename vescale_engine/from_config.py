"""The optimizer, learning-rate scheduler and parameter groups a DeepSpeed-style config (or the
client's objects) asks for, with DeepSpeed's meaning of its keys."""
from __future__ import annotations

import inspect
import logging

import torch

from . import optim

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
    """The client's optimizer class or callable(params), else the config's optimizer."""
    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            raise ValueError("pass the optimizer class or a callable(params), not an instance: "
                             "its parameters are replaced by their shards here")
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
            LOG.info("optimizer AdamW: per-buffer AdamW cannot step these parameter groups "
                     "(%s); using torch.optim.AdamW", err)
            return torch.optim.AdamW(params, **kwargs)
    return optim.build_optimizer(name, params, kwargs)


def build_scheduler(spec, client, optimizer):
    """The client's scheduler (object or callable(optimizer)), else DeepSpeed's scheduler of
    that name (deepspeed.runtime.lr_schedules), else torch's."""
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if spec is None:
        return None
    name, kwargs = spec["type"], dict(spec.get("params", {}))
    try:
        from deepspeed.runtime import lr_schedules
        cls = getattr(lr_schedules, name, None)
    except ImportError:
        cls = None
    cls = cls or getattr(torch.optim.lr_scheduler, name, None)
    if cls is None:
        raise ValueError(f"scheduler.type {name!r} is neither a DeepSpeed nor a torch scheduler")
    return cls(optimizer, **kwargs)


def named_model_parameters(model_parameters, model):
    """DeepSpeed's model_parameters (parameters, or param-group dicts) as parameter names,
    checked before wrapping: wrapping replaces every parameter object, names stay."""
    names = {id(p): name for name, p in model.named_parameters()}

    def name_of(p):
        if id(p) not in names:
            raise ValueError(f"model_parameters holds a tensor of shape {list(p.shape)} that "
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
    if not any_dict:  # plain parameters: one group, as torch makes of them
        return [{"params": [n for g in groups for n in g["params"]]}]
    return groups


def resolve_named_parameters(groups, module):
    """The wrapped module's parameters for the names `named_model_parameters` returned."""
    by_name = dict(module.named_parameters())
    return [{**g, "params": [by_name[n] for n in g["params"]]} for g in groups]
