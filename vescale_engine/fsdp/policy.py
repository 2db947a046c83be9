"""What a user chooses for a unit: the mixed-precision policy, how its parameters are laid out
(ShardingPolicy: granularity, buffers, alignment, the face between steps), what it keeps in
memory (MemoryPolicy) and how its parameters and gradients travel (CommunicationPolicy).
Frozen dataclasses at the bottom of the FSDP runtime, each checked once when made and passed
whole; nothing here knows units."""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch

from .. import torch_compat
from ..plan.granularity import parse_granularity
from ..plan.planner import DEFAULT_ALIGN_BYTES, DEFAULT_MAX_BUFFERS
from .faces import ParameterFace, RaggedFace

__all__ = ["MixedPrecisionPolicy", "ShardingPolicy", "MemoryPolicy", "CommunicationPolicy",
           "as_policy", "granularity_of", "policy_of"]


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

    def buffer_dtypes(self, dtype: torch.dtype) -> tuple:
        """(compute, reduction, unreduced gradient) dtypes of a buffer of `dtype` parameters:
        gradients accumulate in the reduce dtype when it is the wider one (as FSDP2's)."""
        param_dtype = self.param_dtype or dtype
        reduce_dtype = self.reduce_dtype_for(dtype)
        grad_dtype = reduce_dtype if reduce_dtype.is_floating_point and \
            reduce_dtype.itemsize > param_dtype.itemsize else param_dtype
        return param_dtype, reduce_dtype, grad_dtype

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


def _count(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


@dataclass(frozen=True)
class ShardingPolicy:
    """How a unit's parameters are laid out: fully_shard's keywords of the same names, checked
    when the policy is made. `granularity`: the planner's atomic block per parameter, one
    policy ("element", "rows:K", "tile:RxC", "tensor") or {"default": policy, "overrides":
    {parameter-name glob: policy}}, names relative to the module fully_shard gets;
    `max_buffers`: how many DBuffers a unit may be split into when its blocks' sizes couple
    (the lcm trap); `align_bytes`: each tensor's start in the buffer; `face`: what the module
    holds for a parameter between steps (fsdp/faces.py: a RaggedDTensor of its global shape,
    FSDP2's; the DeepSpeed integration's plain pieces are another); `rank_local`: ranks
    outside the shard group hold different tensors under the same names (DeepSpeed MoE's
    experts, one set per expert-parallel rank), so the gradient norm sums the unit's shards
    over the world, and files that keep one tensor per name refuse the module."""
    granularity: object = "rows:1"
    max_buffers: int = DEFAULT_MAX_BUFFERS
    align_bytes: int = DEFAULT_ALIGN_BYTES
    face: ParameterFace = RaggedFace()
    rank_local: bool = False

    def __post_init__(self):
        granularity_of(self.granularity)  # an unparsable policy: its ValueError now
        _count("max_buffers", self.max_buffers, 1)
        _count("align_bytes", self.align_bytes, 1)
        if not isinstance(self.face, ParameterFace):
            raise TypeError(f"face must be a ParameterFace (fsdp/faces.py), got {self.face!r}")
        if not isinstance(self.rank_local, bool):
            raise ValueError(f"rank_local must be a bool, got {self.rank_local!r}")

    @property
    def resolve(self):
        """fqn -> Granularity."""
        return granularity_of(self.granularity)


@dataclass(frozen=True)
class MemoryPolicy:
    """What a unit keeps in memory beyond FSDP2's own switches (reshard_after_forward,
    offload_policy). `grads_in_place`: backward writes each gradient over its own full
    parameter once that parameter's gradient is complete (one full-size buffer in backward
    instead of two); turn it off for a model whose backward still reads a parameter's value
    after the parameter's gradient is done (a detached use, say: autograd then raises
    "modified by an inplace operation" rather than computing with a wrong value).
    `max_reuse_distance` (DeepSpeed's stage3_max_reuse_distance, in elements): a unit stays
    gathered from its forward to its backward when fewer elements than this are gathered in
    between (every later unit's parameters, in forward and again in backward); 0 keeps only the
    last unit, which backward starts with. More speed (no re-gather), more memory."""
    grads_in_place: bool = True
    max_reuse_distance: int = 0

    def __post_init__(self):
        if not isinstance(self.grads_in_place, bool):
            raise ValueError(f"grads_in_place must be a bool, got {self.grads_in_place!r}")
        _count("max_reuse_distance", self.max_reuse_distance, 0)


def policy_of(cls, given, keywords: dict):
    """`given` (a policy of `cls`, or None) or one made from fully_shard's `keywords` of its
    fields; both, with a keyword away from its default, is one ValueError naming it."""
    if given is None:
        return cls(**keywords)
    if not isinstance(given, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(given).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, value in keywords.items():
        if value is not defaults[name] and value != defaults[name]:
            raise ValueError(f"{name}={value!r} was passed beside a {cls.__name__}: set it in "
                             "the policy instead")
    return given


@dataclass(frozen=True)
class CommunicationPolicy:
    """How a unit's weights and gradients travel: fully_shard's keywords of the same names,
    checked together when the policy is made (each problem one ValueError naming them).
    `quantized_weights` (elements per group, e.g. 256): the forward and backward all-gathers
    send block-wise int8 weights with one fp32 scale per group (ZeRO++'s qwZ; shard/quantize.py);
    master weights, gradients and every gathered or saved state stay exact.
    `quantized_gradients` (the same group size when both are set): gradients cross the network
    as int8 groups (all-to-all), summed in fp32 by their owner (ZeRO++'s qgZ).
    `quantization_format` "fp8_e4m3": the weights travel as FP8, a tensor whose blocks are whole
    rows of a width that is a multiple of 128 with one scale per (block rows x 128) tile
    (granularity "tile:128x128" or "rows:128": DeepSeek-V3's weight tiles), the others by int8
    groups; gradients stay int8. `fp8_matmul` (with "fp8_e4m3"): each nn.Linear whose weight
    travels as tiles computes its forward from the gathered FP8 values and tile scales (its
    input quantized by 1 x 128 tiles; fsdp/fp8_linear.py), keeping them beside its full
    parameters (1 byte per element more while gathered); backward computes from the
    dequantized weight. `hpz_partition_size` N > 1 (ZeRO++'s hpZ, over the world only): each
    forward all-gather leaves every rank a secondary copy of 1/N of the gathered parameters,
    so that backward re-gathers them inside its group of N consecutive ranks (a node) instead
    of over every rank, for 1/N of the unit's full parameters per rank, for life.
    `native_collectives`: the backend's own all-gather and reduce-scatter on gloo too (NCCL
    always gets them; on gloo the default is faster point-to-point exchanges), so that the
    path GPUs take runs on CPU."""
    quantized_weights: int | None = None
    quantized_gradients: int | None = None
    quantization_format: str = "int8"
    fp8_matmul: bool = False
    hpz_partition_size: int = 1
    native_collectives: bool = False

    def __post_init__(self):
        for kind, size in (("weights", self.quantized_weights),
                           ("gradients", self.quantized_gradients)):
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or
                                     size < 1):
                raise ValueError(f"quantized_{kind} must be a group size in elements (an int "
                                 f">= 1), got {size!r}")
        size = self.hpz_partition_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"hpz_partition_size must be an int >= 1, got {size!r}")
        if self.quantization_format not in ("int8", "fp8_e4m3"):
            raise ValueError(f"quantization_format must be 'int8' or 'fp8_e4m3', got "
                             f"{self.quantization_format!r}")
        if self.quantization_format != "int8" and self.quantized_weights is None:
            raise ValueError(f"quantization_format={self.quantization_format!r} is what the "
                             "weights travel as: set quantized_weights too (gradients are int8)")
        if self.fp8_matmul and self.quantization_format != "fp8_e4m3":
            raise ValueError("fp8_matmul=True computes from weights gathered as FP8 tiles: set "
                             "quantized_weights and quantization_format='fp8_e4m3'")
        if self.fp8_matmul and size > 1:
            raise ValueError("fp8_matmul=True with hpz_partition_size > 1 is not supported yet "
                             "(backward's gathers from the secondary copies carry no FP8 "
                             "values)")
        sizes = {self.quantized_weights, self.quantized_gradients} - {None}
        if len(sizes) > 1:
            raise ValueError(f"quantized_weights={self.quantized_weights} and "
                             f"quantized_gradients={self.quantized_gradients}: one group size "
                             "serves both (the planner lays the unit out for one)")

    @property
    def quantized(self) -> tuple:
        """What travels as int8 groups: "weights" and/or "gradients"."""
        return tuple(kind for kind, size in (("weights", self.quantized_weights),
                                             ("gradients", self.quantized_gradients))
                     if size is not None)

    @property
    def quantize_group(self) -> int | None:
        """Elements per group (one size serves both)."""
        return self.quantized_weights or self.quantized_gradients
