"""Whole-model planning from a shapes file, and the padding of the alternatives beside ours.

The shapes format is the one in `examples/models/*.json` (docs/design.md, "Shapes files"):
`{"name": ..., "groups": [{"name": ..., "repeat": N, "tensors": [{"name": ..., "shape": [...]}]}]}`,
with an optional "description" (the published config the shapes come from; not read) and an
optional "architecture" (the few hyper-parameters FLOPs need beyond the weights: layers, heads,
head dims, experts; `Architecture` says which; plan/step_time/compute.py reads them).
Each group is one FSDP unit, planned once however often it repeats (identical decoder layers),
and groups listing the same tensors are planned once between them.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from .granularity import Granularity, parse_granularity
from .planner import (DEFAULT_ALIGN_BYTES, DEFAULT_MAX_BUFFERS, PlanError, TensorSpec, check_plan,
                      plan_buffer, plan_unit, shard_lower_bound)

__all__ = ["ShapesError", "Group", "ModelShapes", "Architecture", "parse_architecture", "read_json", "load_shapes", "model_specs", "ModelPlan",
           "plan_model", "fsdp2_padding_ratio", "fsdp2_shard_dim", "fsdp2_unsupported",
           "zero3_padding_ratio", "Alternative", "alternatives", "single_buffer_ratio",
           "single_buffer_lower_bound_ratio", "per_block_size_ratio", "DTYPE_BYTES",
           "DEFAULT_MAX_BUFFERS"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


class ShapesError(ValueError):
    """A shapes file or a planning request that cannot be planned; the message names where."""


@dataclass(frozen=True)
class Group:
    name: str
    repeat: int
    tensors: tuple  # ((name, shape), ...)
    # TP/EP-local groups only (parallel.local_model): per tensor, the elements a block must be
    # a multiple of (a TP cut on a dim > 0: the slice of the dims from it on; else 1) ...
    cuts: tuple = ()
    expert: bool = False        # ... whether it is an expert unit (sharded over efsdp) ...
    within: str | None = None   # ... and the group whose layer it sits in (forward order)

    def specs(self, granularity: Granularity, where: str) -> list:
        specs = []
        for i, (name, shape) in enumerate(self.tensors):
            try:
                block = granularity.block_size(shape)
            except ValueError as err:
                raise ShapesError(f"{where}: group {self.name!r}, tensor {name!r}: {err}") from None
            specs.append(TensorSpec(name, shape, math.lcm(block, self.cuts[i]) if self.cuts
                                    else block))
        return specs

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)


@dataclass(frozen=True)
class Architecture:
    """A shapes file's optional "architecture" section: what FLOPs need that the weights' shapes
    do not say (Hugging Face config names in brackets). The sequence length is not here: it is a
    training setting, not the model's."""
    layers: int              # decoder layers (num_hidden_layers)
    hidden: int              # hidden_size
    heads: int               # query heads (num_attention_heads)
    head_dim: int            # query/key dim per head (head_dim; MLA: qk_nope + qk_rope)
    vocab: int               # vocab_size
    kv_heads: int = 0        # key/value heads (num_key_value_heads); 0: as many as heads
    v_head_dim: int = 0      # value dim per head (MLA's v_head_dim); 0: head_dim
    experts: int = 0         # routed experts (n_routed_experts / num_local_experts); 0: dense
    experts_per_token: int = 0   # routed experts each token visits (num_experts_per_tok)
    shared_experts: int = 0      # always-on experts (n_shared_experts)
    tied_embeddings: bool = False  # the head is the embedding matrix (tie_word_embeddings)

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim


_ARCH_REQUIRED = ("layers", "hidden", "heads", "head_dim", "vocab")
_ARCH_OPTIONAL = ("kv_heads", "v_head_dim", "experts", "experts_per_token", "shared_experts")


def parse_architecture(path: str, raw) -> Architecture:
    """Validate an "architecture" section; errors are one line naming the file and field."""
    where = f"{path}: architecture"
    if not isinstance(raw, dict):
        raise ShapesError(f"{where}: expected an object, got {type(raw).__name__}")
    known = set(_ARCH_REQUIRED) | set(_ARCH_OPTIONAL) | {"tied_embeddings", "source"}
    for key in raw:
        if key not in known:   # a typo would otherwise silently become a default
            raise ShapesError(f"{where}.{key}: unknown field (expected one of "
                              f"{', '.join(sorted(known))})")
    values = {}
    for key in _ARCH_REQUIRED + _ARCH_OPTIONAL:
        if key not in raw:
            if key in _ARCH_REQUIRED:
                raise ShapesError(f"{where}.{key}: missing")
            continue
        v = raw[key]
        least = 1 if key in _ARCH_REQUIRED else 0
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ShapesError(f"{where}.{key}: must be an integer >= {least}, got {v!r}")
        values[key] = v
    tied = raw.get("tied_embeddings", False)
    if not isinstance(tied, bool):
        raise ShapesError(f"{where}.tied_embeddings: must be true or false, got {tied!r}")
    arch = Architecture(**values, tied_embeddings=tied)
    if arch.kv_heads and arch.heads % arch.kv_heads:
        raise ShapesError(f"{where}.kv_heads: {arch.kv_heads} does not divide heads "
                          f"{arch.heads}")
    if bool(arch.experts) != bool(arch.experts_per_token) or \
            arch.experts_per_token > arch.experts:
        raise ShapesError(f"{where}.experts_per_token: must be between 1 and experts "
                          f"({arch.experts}) for a MoE model and 0 for a dense one, got "
                          f"{arch.experts_per_token}")
    return arch


@dataclass(frozen=True)
class ModelShapes:
    name: str
    path: str
    groups: tuple
    architecture: Architecture | None = None   # the file's "architecture" section, if any

    @property
    def numel(self) -> int:
        return sum(g.numel * g.repeat for g in self.groups)


def read_json(path: str, error: type = ValueError):
    """A JSON file's content; a file that cannot be read or parsed is one line naming it,
    raised as `error` (the caller's own error class)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as err:
        raise error(f"{path}: cannot read: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON: {err.msg} at line {err.lineno}") from None


def load_shapes(path: str) -> ModelShapes:
    """Read and validate a shapes file; errors are one line naming the file, group and tensor."""
    data = read_json(path, ShapesError)
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
        raise ShapesError(f"{path}: expected an object with a non-empty 'groups' list")
    groups, seen = [], set()
    for i, group in enumerate(data["groups"]):
        if not isinstance(group, dict):
            raise ShapesError(f"{path}: groups[{i}] is not an object")
        gname = group.get("name", f"groups[{i}]")
        where = f"{path}: group {gname!r}"
        if not isinstance(gname, str) or gname in seen:
            raise ShapesError(f"{where}: group names must be unique strings")
        seen.add(gname)
        repeat = group.get("repeat", 1)
        if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
            raise ShapesError(f"{where}: 'repeat' must be a positive integer, got {repeat!r}")
        tensors = group.get("tensors")
        if not isinstance(tensors, list) or not tensors:
            raise ShapesError(f"{where}: expected a non-empty 'tensors' list")
        parsed, names = [], set()
        for j, tensor in enumerate(tensors):
            tname = tensor.get("name") if isinstance(tensor, dict) else None
            if not isinstance(tname, str) or tname in names:
                raise ShapesError(f"{where}: tensors[{j}] needs a unique string 'name'")
            names.add(tname)
            shape = tensor.get("shape")
            if not isinstance(shape, list) or not shape or not all(
                    isinstance(d, int) and not isinstance(d, bool) for d in shape):
                raise ShapesError(f"{where}, tensor {tname!r}: 'shape' must be a non-empty list "
                                  f"of integers, got {shape!r}")
            if any(d <= 0 for d in shape):
                raise ShapesError(f"{where}, tensor {tname!r}: non-positive dimension in {shape}")
            parsed.append((tname, tuple(shape)))
        groups.append(Group(gname, repeat, tuple(parsed)))
    arch = data.get("architecture")
    arch = None if arch is None else parse_architecture(path, arch)
    return ModelShapes(str(data.get("name", path)), path, tuple(groups), arch)


@dataclass(frozen=True)
class ModelPlan:
    model: ModelShapes
    granularity: Granularity
    world_size: int
    align_bytes: int
    dtype: str
    max_buffers: int
    plans: tuple          # one UnitPlan per group
    specs: tuple          # one spec list per group
    plan_seconds: float
    expert_world_size: int | None = None   # expert groups' shard group (EP: efsdp)
    mesh: object = None   # with TP/EP, the parallel.ParallelSizes: world_size is then its dp_shard

    @property
    def world(self) -> int:
        """All ranks (world_size is the dense units' shard group)."""
        return self.mesh.world if self.mesh is not None else self.world_size

    def group_world(self, group: Group) -> int:
        return self.expert_world_size if group.expert and self.expert_world_size \
            else self.world_size

    @property
    def padding(self) -> int:
        return sum(p.padding * g.repeat for p, g in zip(self.plans, self.model.groups))

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.model.numel

    def verify(self) -> None:
        for group, plan, specs in zip(self.model.groups, self.plans, self.specs):
            try:
                check_plan(plan, specs)
            except PlanError as err:
                raise PlanError(f"group {group.name!r}: {err}") from None

    def to_json(self) -> dict:
        parallel = any(g.cuts for g in self.model.groups)   # a TP/EP-local model
        mesh = {} if self.mesh is None else {"mesh": {
            "tp": self.mesh.tp, "ep": self.mesh.ep, "dp": self.mesh.dp,
            "dp_shard": self.mesh.dp_shard, "efsdp": self.mesh.efsdp,
            **({"replicate": self.mesh.replicate} if self.mesh.replicate > 1 else {})}}
        return {
            "model": self.model.name,
            "world_size": self.world,
            **mesh,
            "granularity": str(self.granularity),
            "align_bytes": self.align_bytes,
            "dtype": self.dtype,
            "max_buffers": self.max_buffers,
            "padding_ratio": self.padding_ratio,
            "plan_seconds": self.plan_seconds,
            "groups": [{
                "name": group.name,
                "repeat": group.repeat,
                **({"expert": group.expert} if parallel else {}),
                # with a mesh (TP/EP, HSDP) the ranks a group's buffers are laid over
                **({"shard_group_size": self.group_world(group)}
                   if parallel or self.mesh is not None else {}),
                "buffers": [{
                    "shard_size": buf.shard_size,
                    "padding": buf.padding,
                    "tensors": [{"name": p.name, "offset": p.offset, "numel": p.numel,
                                 "block": p.block,
                                 "local_units": p.local_units(self.group_world(group)),
                                 **({"shape": list(p.spec.shape)} if parallel else {})}
                                for p in buf.placements],
                } for buf in plan.buffers],
            } for group, plan in zip(self.model.groups, self.plans)],
        }


def align_elements(align_bytes: int, dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ShapesError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPE_BYTES)})")
    if align_bytes < 1:
        raise ShapesError(f"alignment must be a positive number of bytes, got {align_bytes}")
    return max(1, align_bytes // DTYPE_BYTES[dtype])


def model_specs(model: ModelShapes, granularity) -> list:
    granularity = parse_granularity(granularity)
    return [g.specs(granularity, model.path) for g in model.groups]


def plan_model(model: ModelShapes, world_size: int, granularity, *,
               align_bytes: int = DEFAULT_ALIGN_BYTES, dtype: str = "bf16",
               max_buffers: int = DEFAULT_MAX_BUFFERS,
               expert_world_size: int | None = None) -> ModelPlan:
    """Plan every group of the model once, and groups with identical tensors (names, shapes and
    blocks: the same layer listed as several groups) once between them; the clock covers the
    planning of all of them. Expert groups (a TP/EP-local model's) are planned over
    `expert_world_size` ranks when it is given."""
    if world_size < 1 or (expert_world_size is not None and expert_world_size < 1):
        raise ShapesError(f"world size must be positive, got {world_size}")
    granularity = parse_granularity(granularity)
    align = align_elements(align_bytes, dtype)
    all_specs = model_specs(model, granularity)
    t0 = time.perf_counter()
    planned, plans = {}, []
    for group, specs in zip(model.groups, all_specs):
        m = expert_world_size if group.expert and expert_world_size else world_size
        key = (tuple(specs), m)
        if key not in planned:
            planned[key] = plan_unit(specs, m, align, max_buffers)
        plans.append(planned[key])
    seconds = time.perf_counter() - t0
    return ModelPlan(model, granularity, world_size, align_bytes, dtype, max_buffers,
                     tuple(plans), tuple(all_specs), seconds, expert_world_size)


# --------------------------------------------------------------------------------------------
# What the alternatives would pad, on the same shapes (padded elements over model elements).

def fsdp2_shard_dim(group: Group, shape: tuple, world_size: int) -> int:
    """The dim FSDP2 shards a tensor on: 0, except an expert unit's when its shard group is
    larger than its local experts (efsdp x ep > E): torchtitan's apply_fsdp shards those on
    dim 1 (`Shard(1)`), which FSDP2 requires to divide evenly."""
    return 1 if group.expert and world_size > shape[0] else 0


def fsdp2_unsupported(model: ModelShapes, world_size: int,
                      expert_world_size: int | None = None) -> str | None:
    """Why FSDP2 cannot shard the model this way (an uneven Shard(1)), or None."""
    for group in model.groups:
        m = expert_world_size if group.expert and expert_world_size else world_size
        for name, shape in group.tensors:
            if fsdp2_shard_dim(group, shape, m) == 1 and shape[1] % m:
                return (f"FSDP2 does not support uneven sharding on dim 1: {name} "
                        f"{list(shape)} over {m} ranks")
    return None


def _fsdp2_chunk(shape: tuple, dim: int, world: int, block: int) -> tuple:
    """(rows FSDP2 gives each rank of `shape` on `dim`, the rows it would need for no chunk
    boundary to cut a `block`-element block): each rank's piece is `shape` with `dim` cut to
    c rows (padded), so the cuts fall every c slices of `dim` within each leading index."""
    outer = math.prod(shape[:dim])
    size, inner = shape[dim], math.prod(shape[dim + 1:])
    native = -(-size // world)

    def whole(c):  # c rows per rank cut no block: one rank holds it all, or every cut (within
        # each leading index, and between them) falls on a block boundary
        return c >= size or (c * inner % block == 0 and (outer == 1 or size * inner % block == 0))
    if whole(native):
        return native, native
    if outer > 1 and size * inner % block:
        return native, size   # blocks straddle the leading index: only one rank holding it all
    step = block // math.gcd(block, inner)
    return native, min(-(-native // step) * step, size)


def _fsdp2_padding(model: ModelShapes, world_size: int, expert_world_size: int | None,
                   blocks: list | None) -> tuple:
    """(padded elements, padded elements keeping every block whole, the first tensor whose
    blocks FSDP2's chunks cut or None); `blocks`: per group, each tensor's block (None: no
    block constraint, the last two as the first)."""
    pad = whole_pad = 0
    cut = None
    for i, group in enumerate(model.groups):
        m = expert_world_size if group.expert and expert_world_size else world_size
        for j, (name, shape) in enumerate(group.tensors):
            dim = fsdp2_shard_dim(group, shape, m)
            per_row = math.prod(shape) // shape[dim]   # elements of one index of `dim`
            native, kept = _fsdp2_chunk(shape, dim, m, blocks[i][j] if blocks else 1)
            pad += group.repeat * (native * m - shape[dim]) * per_row
            whole_pad += group.repeat * (kept * m - shape[dim]) * per_row
            if kept != native and cut is None:
                cut = f"{group.name}/{name}"
    return pad, whole_pad, cut


def fsdp2_padding_ratio(model: ModelShapes, world_size: int,
                        expert_world_size: int | None = None) -> float:
    """PyTorch FSDP2: every parameter is Shard(0), dim 0 padded to a multiple of world size
    (expert units over their own shard group, on the dim fsdp2_shard_dim says)."""
    return _fsdp2_padding(model, world_size, expert_world_size, None)[0] / model.numel


def _zero3_padding(model: ModelShapes, world_size: int, expert_world_size: int | None,
                   blocks: list | None) -> tuple:
    """As _fsdp2_padding, for ZeRO-3's rule: each parameter's elements in `world` equal pieces
    (numel padded to a multiple of the world size); kept whole, each piece a whole number of
    blocks (or one rank holding the parameter)."""
    pad = whole_pad = 0
    cut = None
    for i, group in enumerate(model.groups):
        m = expert_world_size if group.expert and expert_world_size else world_size
        for j, (name, shape) in enumerate(group.tensors):
            n = math.prod(shape)
            block = blocks[i][j] if blocks else 1
            piece = -(-n // m)
            kept = piece if piece >= n or piece % block == 0 else \
                min(-(-piece // block) * block, n)
            pad += group.repeat * (piece * m - n)
            whole_pad += group.repeat * (kept * m - n)
            if kept != piece and cut is None:
                cut = f"{group.name}/{name}"
    return pad, whole_pad, cut


def zero3_padding_ratio(model: ModelShapes, world_size: int,
                        expert_world_size: int | None = None) -> float:
    """DeepSpeed ZeRO-3: every parameter's numel is padded to a multiple of world size
    (AutoEP's experts: of their expert-data-parallel group)."""
    return _zero3_padding(model, world_size, expert_world_size, None)[0] / model.numel


@dataclass(frozen=True)
class Alternative:
    """Another system's padding on a plan's shapes, beside ours: its own figure, whether its
    sharding rule cuts any of the plan's atomic blocks (then that figure ignores the block
    constraint) and the first tensor it cuts, and its padding when each tensor must be cut only
    at block boundaries under its own rule (FSDP2: dim-0 chunks rounded up to whole blocks;
    ZeRO-3: each parameter's even pieces rounded up to whole blocks). `unsupported`: why the
    system cannot shard the model this way at all (then no figures)."""
    system: str
    padding_ratio: float | None
    whole_blocks_padding_ratio: float | None
    cuts: str | None = None
    unsupported: str | None = None

    @property
    def ignores_blocks(self) -> bool:
        return self.cuts is not None

    def to_json(self) -> dict:
        if self.unsupported:
            return {"unsupported": self.unsupported}
        return {"padding_ratio": self.padding_ratio, "ignores_blocks": self.ignores_blocks,
                "first_cut_tensor": self.cuts,
                "whole_blocks_padding_ratio": self.whole_blocks_padding_ratio}


def alternatives(model_plan: ModelPlan) -> tuple:
    """(FSDP2's, ZeRO-3's) Alternative on the plan's (TP/EP-local) shapes and blocks."""
    model, worlds = model_plan.model, (model_plan.world_size, model_plan.expert_world_size)
    # the granularity's blocks (a TP-local tensor's planner block is also a multiple of its TP
    # cut: our layout's need, not the block constraint)
    blocks = [[model_plan.granularity.block_size(shape) for _, shape in g.tensors]
              for g in model.groups]
    out = []
    for system, count in (("fsdp2", _fsdp2_padding), ("zero3", _zero3_padding)):
        why = fsdp2_unsupported(model, *worlds) if system == "fsdp2" else None
        if why:
            out.append(Alternative(system, None, None, unsupported=why))
            continue
        pad, whole_pad, cut = count(model, *worlds, blocks)
        out.append(Alternative(system, pad / model.numel, whole_pad / model.numel, cut))
    return tuple(out)


def single_buffer_lower_bound_ratio(model_plan: ModelPlan) -> float:
    """Padding no single-buffer plan can beat: S >= total / world size, and S a multiple of the
    block of every tensor longer than 2S (docs/design.md, the lcm trap)."""
    align = align_elements(model_plan.align_bytes, model_plan.dtype)
    pad = 0
    for group, specs in zip(model_plan.model.groups, model_plan.specs):
        m = model_plan.group_world(group)
        S = shard_lower_bound([(s.numel, s.block, 1) for s in specs], m, align)
        pad += group.repeat * (m * S - sum(s.numel for s in specs))
    return pad / model_plan.model.numel


def per_block_size_ratio(model_plan: ModelPlan) -> float:
    """The simple alternative: one buffer for each distinct block size in a unit."""
    align = align_elements(model_plan.align_bytes, model_plan.dtype)
    pad = 0
    for group, specs in zip(model_plan.model.groups, model_plan.specs):
        m = model_plan.group_world(group)
        classes = {}
        for s in specs:
            classes.setdefault(s.block, []).append(s)
        pad += group.repeat * sum(plan_buffer(c, m, align).padding for c in classes.values())
    return pad / model_plan.model.numel


def single_buffer_ratio(model_plan: ModelPlan) -> float:
    """Our heuristic restricted to one buffer per unit (the paper's setting)."""
    plan = plan_model(model_plan.model, model_plan.world_size, model_plan.granularity,
                      align_bytes=model_plan.align_bytes, dtype=model_plan.dtype, max_buffers=1,
                      expert_world_size=model_plan.expert_world_size)
    return plan.padding_ratio

