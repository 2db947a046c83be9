"""What a user chooses for a unit: the mixed-precision policy and, per parameter, the
sharding granularity. Plain types at the bottom of the FSDP runtime; nothing here knows units."""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch

from .. import torch_compat
from ..plan.granularity import parse_granularity

__all__ = ["MixedPrecisionPolicy", "as_policy", "granularity_of"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's fields, with the meaning and defaults of the installed torch's FSDP2 (torch's
    MixedPrecisionPolicy is accepted as well; `as_policy` converts it). param_dtype: compute and
    all-gather dtype; reduce_dtype: gradient reduction dtype, and the dtype gradients are
    accumulated in when it is wider than param_dtype (None: param_dtype up to torch 2.14, the
    parameter's own dtype from 2.15, as FSDP2 reads it: `reduce_dtype_for`); output_dtype:
    floating forward outputs of the unit cast to it; cast_forward_inputs: the unit's floating
    forward inputs cast to param_dtype (when set). The master shard keeps the parameters' own
    dtype (fp32).

    Ours besides, `keep_wide_grads`: a gradient autograd produces wider than param_dtype
    (rms_norm's weight gradient is fp32 for bf16 weights) is kept that wide when the gradients
    are accumulated in a wider reduce_dtype (True, torch 2.15's FSDP2), or rounded to
    param_dtype first (False: torch 2.14's FSDP2, DeepSpeed; what the engine uses); None: as the
    installed torch's FSDP2."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    keep_wide_grads: bool | None = None

    def reduce_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        """The reduction dtype for parameters of `dtype` (reduce_dtype=None resolved)."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return dtype if torch_compat.fsdp2_grads_in_reduce_dtype() else \
            (self.param_dtype or dtype)

    @property
    def keeps_wide_grads(self) -> bool:
        return torch_compat.fsdp2_grads_in_reduce_dtype() if self.keep_wide_grads is None \
            else self.keep_wide_grads


_OURS_ONLY = {"keep_wide_grads"}  # not fields of torch's MixedPrecisionPolicy


def as_policy(policy) -> MixedPrecisionPolicy:
    """Ours from ours, torch's FSDP2 MixedPrecisionPolicy (every field read), or None."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fsdp2 = [f.name for f in dataclasses.fields(MixedPrecisionPolicy)
             if f.name not in _OURS_ONLY]
    if not dataclasses.is_dataclass(policy) or not all(hasattr(policy, f) for f in fsdp2):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (vescale_engine.fsdp's or "
                        f"torch.distributed.fsdp's), got {type(policy).__name__}")
    for field in dataclasses.fields(policy):  # a field a later torch adds: refused if set
        if field.name not in fsdp2 and getattr(policy, field.name) != field.default:
            raise NotImplementedError(f"mp_policy.{field.name}={getattr(policy, field.name)!r} "
                                      "is not supported by vescale_engine's fully_shard")
    return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in fsdp2})


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
