"""Optimizers that step whole DBuffer shards at once, and how the engine picks one.

`build_optimizer(name, params, kwargs)` makes the optimizer a config names; `sharding_granularity`
says how parameters must be sharded for it (the engine calls it before wrapping the model).
"""
from __future__ import annotations

import torch

from .adamw import AdamW
from .adamw8bit import DEFAULT_BLOCK, AdamW8bit, quantization_granularity
from .muon import DEFAULT_ADAMW_PATTERNS, Muon, is_muon_matrix
from .shampoo import Shampoo, shampoo_granularity

__all__ = ["AdamW", "AdamW8bit", "Muon", "Shampoo", "build_optimizer", "sharding_granularity",
           "OURS", "DEFAULT_BLOCK"]

OURS = {"AdamW": AdamW, "AdamW8bit": AdamW8bit, "Muon": Muon, "Shampoo": Shampoo}
_TUPLES = ("betas", "ns_coefficients", "adamw_betas", "adamw_patterns")  # JSON gives lists


def build_optimizer(name: str, params, kwargs: dict) -> torch.optim.Optimizer:
    """Our flat-shard optimizers by name, else the torch.optim class of that name."""
    cls = OURS.get(name) or getattr(torch.optim, name, None)
    if cls is None:
        raise ValueError(f"optimizer.type {name!r} is neither one of ours ({', '.join(OURS)}) "
                         "nor a torch.optim class")
    kwargs = {k: tuple(v) if k in _TUPLES and isinstance(v, list) else v
              for k, v in kwargs.items()}
    return cls(params, **kwargs)


def sharding_granularity(spec: dict | None, granularity: dict, model=None) -> dict:
    """The {"default", "overrides"} granularity policy to shard with for optimizer `spec`.

    AdamW8bit: its quantization block for every parameter (each rank must own whole blocks).
    Muon in "tensor" mode: every matrix atomic ("matrix": each expert of a stack too), the
    parameters AdamW steps as configured. Shampoo: rows:B (B = max_preconditioner_dim) or
    whole matrices, so that no shard boundary cuts a Shampoo block (`shampoo_granularity`).
    Anything else: `granularity` unchanged (its default `rows:1` when it has none: `granularity`
    holds a "default" only where the user set one). With `model`,
    parameters are checked here, before wrapping: a block that does not fit a parameter, or a
    Muon model without matrices, is an error naming the parameter.
    """
    name = (spec or {}).get("type")
    params = dict((spec or {}).get("params", {}))
    if name == "Shampoo":
        return shampoo_granularity(params, granularity, model)
    if name == "AdamW8bit":
        block = quantization_granularity(params.get("block", DEFAULT_BLOCK))
        if model is not None:
            for fqn, p in model.named_parameters():
                try:
                    block.block_size(p.shape)
                except ValueError as err:
                    raise ValueError(f"parameter {fqn}: AdamW8bit block {block}: {err}") from None
        return {"default": block, "overrides": {}}
    if name == "Muon":
        patterns = tuple(params.get("adamw_patterns", DEFAULT_ADAMW_PATTERNS))
        if model is not None:
            found = [(fqn, tuple(p.shape)) for fqn, p in model.named_parameters()]
            if not any(is_muon_matrix(fqn, shape, patterns) for fqn, shape in found):
                raise ValueError(
                    "Muon: no 2-D (or stacked 3-D) parameter outside the AdamW name patterns "
                    f"{list(patterns)}; the parameters are: "
                    + ", ".join(f"{fqn} {list(shape)}" for fqn, shape in found))
        if params.get("mode", "gather") == "tensor":
            default = granularity.get("default", "rows:1")
            return {"default": "matrix",
                    "overrides": {**{pattern: default for pattern in patterns},
                                  **granularity.get("overrides", {})}}
    return {"default": granularity.get("default", "rows:1"),
            "overrides": granularity.get("overrides", {})}
