"""What a user chooses for a unit: the mixed-precision policy and, per parameter, the
sharding granularity. Plain types at the bottom of the FSDP runtime; nothing here knows units."""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch

from ..plan.granularity import parse_granularity

__all__ = ["MixedPrecisionPolicy", "as_policy", "granularity_of"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's fields, with FSDP2's meaning and defaults (torch's MixedPrecisionPolicy is
    accepted as well; `as_policy` converts it). param_dtype: compute and all-gather dtype;
    reduce_dtype: gradient reduction dtype (None: param_dtype); output_dtype: floating forward
    outputs of the unit cast to it; cast_forward_inputs: the unit's floating forward inputs
    cast to param_dtype (when set). The master shard keeps the parameters' own dtype (fp32)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def as_policy(policy) -> MixedPrecisionPolicy:
    """Ours from ours, torch's FSDP2 MixedPrecisionPolicy (every field read), or None."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    ours = [f.name for f in dataclasses.fields(MixedPrecisionPolicy)]
    if not dataclasses.is_dataclass(policy) or not all(hasattr(policy, f) for f in ours):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (vescale_engine.fsdp's or "
                        f"torch.distributed.fsdp's), got {type(policy).__name__}")
    for field in dataclasses.fields(policy):  # a field a later torch adds: refused if set
        if field.name not in ours and getattr(policy, field.name) != field.default:
            raise NotImplementedError(f"mp_policy.{field.name}={getattr(policy, field.name)!r} "
                                      "is not supported by vescale_engine's fully_shard")
    return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in ours})


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
