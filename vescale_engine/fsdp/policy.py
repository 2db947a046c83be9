"""What a user chooses for a unit: the mixed-precision policy and, per parameter, the
sharding granularity. Plain types at the bottom of the FSDP runtime; nothing here knows units."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from ..plan.granularity import parse_granularity

__all__ = ["MixedPrecisionPolicy", "granularity_of"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """param_dtype: compute and all-gather dtype; reduce_dtype: gradient reduction dtype. The
    master shard keeps the parameters' own dtype (fp32)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def granularity_of(granularity):
    """fqn -> Granularity, from one policy ("rows:16") or {"default": ..., "overrides":
    {glob pattern: policy}} where the first matching pattern wins."""
    if not isinstance(granularity, dict):
        policy = parse_granularity(granularity)
        return lambda fqn: policy
    default = parse_granularity(granularity.get("default", "rows:1"))
    overrides = [(pattern, parse_granularity(g))
                 for pattern, g in granularity.get("overrides", {}).items()]

    def resolve(fqn):
        return next((g for pattern, g in overrides if fnmatch.fnmatchcase(fqn, pattern)),
                    default)
    return resolve
