"""Tensor and expert parallelism in the planning tier: how a world of ranks splits into meshes
(`ParallelSizes`, the engine's config uses the same type; `make_mesh`), and the TP/EP-local
shapes a rank holds of each tensor of a shapes file (`local_model`), which the planner and
capacity/ then shard as they shard any tensor.

The shapes file says how the model is cut, in transformers' conventions (keys are tensor names
inside a group, or the module a `.weight` / `.bias` belongs to; `*` matches one name part):
- `"tp_plan": {"mlp.gate_proj": "colwise", "mlp.down_proj": "rowwise", ...}`, the model's
  `base_model_tp_plan` (transformers distributed/tensor_parallel.py): colwise splits a weight
  on its output dim (dim ndim-2) and a bias on its only dim, rowwise a weight on its input dim
  (the last) and keeps the bias whole, packed_colwise (fused gate/up) splits dim ndim-2 as two
  halves (each TP rank holds its slice of each). Tensors the plan does not name are replicated
  over the TP group.
- `"ep_plan": {"mlp.experts.gate_up_proj": "grouped_gemm", ...}` (`base_model_ep_plan`): fused
  expert tensors [E, ...], split on the expert dim: each EP rank holds E / ep experts
  (distributed/expert_parallel.py, `Shard(0)`).
- `"moe": {"experts_per_token": k, "hidden_size": H}`: what a token sends to the experts it is
  routed to, for the all-to-all dispatch bytes.

Meshes (`ParallelSizes`): world = replicate x dp_shard x tp, TP innermost. Dense tensors
(attention, router, shared experts, embeddings) are sharded over dp_shard. EP borrows its ranks
from the dp_shard x tp ranks of a replica, as transformers (`efsdp_size = fsdp_size * tp_size //
ep_size`), torchtitan's default (expert_tensor_parallel_degree 1) and DeepSpeed's AutoEP
(expert_tensor_parallel_size 1) lay them: with ep > 1 the experts are not TP-split, and each
expert unit is sharded over efsdp = dp_shard * tp / ep ranks. With ep == 1 the expert tensors
follow the TP plan like any other tensor.

A tensor cut by TP on a dim d > 0 keeps RaggedShard's cuts between whole slices of dims >= d
(docs/design.md, the lcm rule): `Group.cuts` holds that element count, which the planner's
block is a multiple of.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .model_plan import Group, ModelShapes, ShapesError

__all__ = ["TP_STYLES", "EP_STYLES", "ParallelSizes", "make_mesh", "MoE", "read_plans",
           "local_model", "EXPERT_SUFFIX"]

TP_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise", "rowwise",
             "rowwise_rep", "rowwise_split_input")
EP_STYLES = ("grouped_gemm",)
EXPERT_SUFFIX = ".experts"   # a group's expert unit is named after the group with this suffix


@dataclass(frozen=True)
class ParallelSizes:
    """How `world` ranks are laid out, the one type the engine's config, the planner's --tp/--ep
    and the capacity model share (docs/parallelism.md). Dense layers: (replicate, dp_shard, tp)
    with TP innermost, so a TP group is `tp` consecutive ranks and the data-parallel rank is
    rank // tp. Experts: (replicate, efsdp, ep): EP borrows its ranks from the dp_shard x tp
    ranks of a replica, so replicate x efsdp x ep is the world, and every rank stays a
    data-parallel rank with its own micro-batch. Sequence parallelism (DeepSpeed's Ulysses, sp
    consecutive ranks computing one sequence together) keeps sharding over every rank, as
    DeepSpeed's ZeRO shards over its sequence-data-parallel group: it changes only what counts
    as a data-parallel rank (world / sp). Torch-free."""
    world: int
    tp: int = 1
    ep: int = 1
    replicate: int = 1  # HSDP replicas (the engine at stage 0: every data-parallel rank)
    sp: int = 1  # sequence-parallel group size (never with tp or ep above 1)

    @property
    def dp(self) -> int:
        """Data-parallel ranks, the ranks that see different batches: the batch arithmetic's
        size (world / (tp x sp))."""
        return self.world // (self.tp * self.sp)

    @property
    def dp_shard(self) -> int:
        """The ranks a dense unit is sharded over (per replica): world / (replicate x tp)
        (sequence-parallel peers included)."""
        return self.world // self.tp // self.replicate

    @property
    def shard(self) -> int:
        """dp_shard, by the name engine/parallel_plan.py's build_meshes reads."""
        return self.dp_shard

    @property
    def efsdp(self) -> int:
        """The ranks each expert unit is sharded over (per replica): dp_shard x tp / ep. The
        engine refuses tp > 1 with ep > 1 and builds no expert mesh with ep == 1, so where it
        uses this, tp == 1 and it is dp_shard / ep."""
        return self.dp_shard * self.tp // self.ep

    @property
    def enabled(self) -> bool:
        """Whether tensor or expert parallelism is on (the engine then builds meshes)."""
        return self.tp > 1 or self.ep > 1

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.sp)


def make_mesh(world: int, tp: int = 1, ep: int = 1, replicate: int = 1) -> ParallelSizes:
    """The planner's --tp/--ep layout, or one line saying which size does not divide which."""
    for what, value in (("world size", world), ("--tp", tp), ("--ep", ep),
                        ("HSDP replicate size", replicate)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShapesError(f"{what} must be a positive integer, got {value!r}")
    if world % (replicate * tp):
        raise ShapesError(f"world size {world} is not divisible by tp {tp} x HSDP replicate "
                          f"{replicate} = {tp * replicate}")
    per_replica = world // replicate
    if per_replica % ep:
        raise ShapesError(f"ep {ep} does not divide the {per_replica} ranks of a replica "
                          f"(world size {world} / HSDP replicate {replicate}): EP borrows its "
                          f"ranks from data (and tensor) parallelism")
    return ParallelSizes(world, tp, ep, replicate)


@dataclass(frozen=True)
class MoE:
    experts_per_token: int
    hidden_size: int


def _pattern(key: str):
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part)
                                 for part in key.split(".")) + r"(\.[^.]+)?")


def _style(plan: list, name: str):
    """The style of the first plan key that names `name` or its module, else None."""
    for key, regex, style in plan:
        if regex.fullmatch(name):
            return style
    return None


def read_plans(path: str) -> tuple:
    """(tp plan, ep plan, MoE or None) of a shapes file; plans are [(key, regex, style)].
    A style or a key of the wrong type is one line naming the file and the key."""
    import json
    with open(path) as f:
        data = json.load(f)
    plans = []
    for field, styles in (("tp_plan", TP_STYLES), ("ep_plan", EP_STYLES)):
        raw = data.get(field, {})
        if not isinstance(raw, dict):
            raise ShapesError(f"{path}: {field!r} must be an object of pattern: style")
        plan = []
        for key, style in raw.items():
            if style not in styles:
                raise ShapesError(f"{path}: {field}[{key!r}]: unknown style {style!r} "
                                  f"(expected one of {', '.join(styles)})")
            plan.append((key, _pattern(key), style))
        plans.append(plan)
    moe = data.get("moe")
    if moe is not None:
        values = [moe.get(k) if isinstance(moe, dict) else None
                  for k in ("experts_per_token", "hidden_size")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ShapesError(f"{path}: 'moe' must be {{\"experts_per_token\": k, "
                              f"\"hidden_size\": H}} with positive integers, got {moe!r}")
        moe = MoE(*values)
    return plans[0], plans[1], moe


def _split(shape: tuple, dim: int, parts: int, what: str, halves: int = 1) -> tuple:
    if shape[dim] % (parts * halves):
        extra = f" x {halves} packed halves" if halves > 1 else ""
        raise ShapesError(f"{what}: dim {dim} of {list(shape)} ({shape[dim]}) is not divisible "
                          f"by {parts}{extra}")
    return shape[:dim] + (shape[dim] // parts,) + shape[dim + 1:]


def _tp_local(shape: tuple, style: str, tp: int, what: str) -> tuple:
    """(local shape, cut): the TP-local shape and the elements RaggedShard must not cut inside
    (1, or a whole slice of the dims from the split one on when it is not dim 0)."""
    ndim = len(shape)
    leaf_bias = what.endswith(".bias") or what.endswith("_bias")
    if style.startswith("rowwise"):
        if ndim == 1 or leaf_bias:
            return shape, 1                   # the bias of a rowwise layer: replicated
        dim = ndim - 1
    else:
        dim = ndim - 2 if ndim >= 2 else 0
    local = _split(shape, dim, tp, what, 2 if style == "packed_colwise" else 1)
    return local, (math.prod(local[dim:]) if dim > 0 else 1)


def local_model(model: ModelShapes, mesh: ParallelSizes, tp_plan: list, ep_plan: list) -> tuple:
    """(local ModelShapes, {group name: number of experts E}): every group with its tensors'
    TP-local shapes; with ep > 1 the tensors the EP plan names move to a group of their own,
    named `<group>.experts`, right after it, with [E / ep, ...] shapes. One-line errors for a
    plan that names no tensor, a dim TP does not divide, and an E that ep does not divide."""
    if mesh.tp > 1 and not tp_plan:
        raise ShapesError(f"{model.path}: --tp {mesh.tp} needs a 'tp_plan' in the shapes file "
                          f"(module pattern: colwise | rowwise | packed_colwise, as transformers'"
                          f" base_model_tp_plan)")
    if mesh.ep > 1 and not ep_plan:
        raise ShapesError(f"{model.path}: --ep {mesh.ep} needs an 'ep_plan' in the shapes file "
                          f"naming the fused expert tensors [E, ...] (style grouped_gemm)")
    groups, experts, used = [], {}, set()
    for group in model.groups:
        dense, dense_cuts, local_experts = [], [], []
        for name, shape in group.tensors:
            what = f"{model.path}: group {group.name!r}, tensor {name!r}"
            ep_style = _style(ep_plan, name) if mesh.ep > 1 else None
            if ep_style:
                used.add(ep_style)
                if len(shape) < 2:
                    raise ShapesError(f"{what}: an expert tensor is [E, ...], got {list(shape)}")
                if shape[0] % mesh.ep:
                    raise ShapesError(f"{what}: {shape[0]} experts are not divisible by ep "
                                      f"{mesh.ep}")
                experts[group.name] = shape[0]
                local_experts.append((name, (shape[0] // mesh.ep,) + tuple(shape[1:])))
                continue
            style = _style(tp_plan, name) if mesh.tp > 1 else None
            local, cut = (shape, 1) if style is None else _tp_local(tuple(shape), style,
                                                                    mesh.tp, what)
            dense.append((name, tuple(local)))
            dense_cuts.append(cut)
        if mesh.ep > 1 and local_experts and not dense:
            raise ShapesError(f"{model.path}: group {group.name!r} holds only expert tensors: "
                              f"its router and the layer around them belong in the same group")
        if dense:
            groups.append(Group(group.name, group.repeat, tuple(dense), tuple(dense_cuts)))
        if local_experts:
            groups.append(Group(group.name + EXPERT_SUFFIX, group.repeat, tuple(local_experts),
                                (1,) * len(local_experts), expert=True, within=group.name))
    if mesh.ep > 1 and not experts:
        raise ShapesError(f"{model.path}: --ep {mesh.ep}: the ep_plan names no tensor of the "
                          f"file")
    return ModelShapes(model.name, model.path, tuple(groups)), experts
