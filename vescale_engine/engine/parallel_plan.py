"""Tensor and expert parallelism, applied to a built model before it is wrapped
(docs/parallelism.md).

- The rank layout as device meshes (config.ParallelSizes): dense layers on ("dp_replicate",
  "dp_shard", "tp") with TP innermost, experts on ("dp_replicate", "efsdp", "ep") with EP
  innermost, borrowed from the data-parallel shard dim.
- The tensor-parallel plan: vescale.tensor_parallel (module patterns -> colwise / rowwise,
  applied with torch's parallelize_module), else the model's own (transformers'
  base_model_tp_plan, applied by the transformers integration's `tensor_parallel`:
  extensions.py).
- The experts split on their expert dim over the EP group by the model's expert plan
  (transformers' base_model_ep_plan: `grouped_gemm` shards, `ep_dispatch_experts` all-to-all
  token dispatch; the integration's `expert_parallel`).
- `check_plan`: what must fail before any collective (no plan, patterns that match nothing,
  heads or experts the group size does not divide), without touching the model.
- `require_same_batch`: the ranks of a TP group compute one batch together, so they must be
  given the same one; checked once, on the first forward, as DeepSpeed does.
"""
from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import _connect
from . import extensions
from .config import ParallelSizes

__all__ = ["Meshes", "ParallelPlan", "build_meshes", "check_plan", "apply_parallel_plan",
           "require_same_batch", "batch_fingerprint"]

OUR_STYLES = ("colwise", "rowwise")
EP_DISPATCH = "ep_dispatch_experts"  # transformers' style for a fused experts module


@dataclass(frozen=True)
class Meshes:
    """The dense mesh and, with EP, the experts' mesh over the same ranks; no dense mesh when
    the units shard over the whole world (no TP, EP or replicas: the default group)."""
    sizes: ParallelSizes
    dense: object  # DeviceMesh ("dp_replicate", "dp_shard", "tp"), or None
    experts: object = None  # DeviceMesh ("dp_replicate", "efsdp", "ep"), with EP

    def dense_dp(self):
        """The mesh the dense units shard over: (dp_replicate, dp_shard) with HSDP (and at
        ZeRO stage 0, every rank a replica), else dp_shard (its ranks hold the same TP
        coordinate), or None: the whole world."""
        if self.dense is None:
            return None
        return self.dense["dp_replicate", "dp_shard"] if self.sizes.replicate > 1 \
            else self.dense["dp_shard"]

    def expert_dp(self):
        """The mesh the experts' units shard over: (dp_replicate, efsdp), else efsdp."""
        return self.experts["dp_replicate", "efsdp"] if self.sizes.replicate > 1 \
            else self.experts["efsdp"]

    @property
    def tp(self):
        return self.dense["tp"]

    @property
    def ep(self):
        return self.experts["ep"]


def build_meshes(sizes: ParallelSizes, device_type: str) -> Meshes:
    """The meshes of `sizes`, every mesh the engine uses (collective: every rank makes the same
    groups in the same order); none for plain sharding over the world."""
    from torch.distributed.device_mesh import DeviceMesh
    if not sizes.enabled and sizes.replicate == 1:
        return Meshes(sizes, None)
    ranks = torch.arange(sizes.world)
    dense = DeviceMesh(device_type, ranks.reshape(sizes.replicate, sizes.shard, sizes.tp),
                       mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    experts = None
    if sizes.ep > 1:
        experts = DeviceMesh(device_type, ranks.reshape(sizes.replicate, sizes.efsdp, sizes.ep),
                             mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    return Meshes(sizes, dense, experts)


@dataclass(frozen=True)
class ParallelPlan:
    """What `apply_parallel_plan` does, decided by `check_plan`."""
    tp_source: str | None = None  # "vescale.tensor_parallel" or "the model's base_model_tp_plan"
    tp_plan: dict = field(default_factory=dict)  # ours: patterns; the model's: expanded names
    ep_plan: dict = field(default_factory=dict)  # the model's, expanded names
    expert_modules: tuple = ()  # names of the modules whose experts are split (own units)


def check_plan(model: nn.Module, sizes: ParallelSizes, config_plan: dict) -> ParallelPlan:
    """The plan for `model` under `sizes`, every problem one ValueError line naming the key and
    the module; no collective, the model untouched."""
    plan = ParallelPlan()
    if sizes.tp > 1:
        plan = _tensor_parallel_plan(model, sizes.tp, config_plan)
    if sizes.ep > 1:
        ep_plan, experts = _expert_parallel_plan(model, sizes.ep)
        plan = ParallelPlan(plan.tp_source, plan.tp_plan, ep_plan, experts)
    return plan


def _tensor_parallel_plan(model, tp: int, config_plan: dict) -> ParallelPlan:
    key = f"tensor_parallel.autotp_size {tp}"
    if config_plan:
        names = {name: module for name, module in model.named_modules() if name}
        for pattern, style in config_plan.items():
            hits = [n for n in names if _matches(pattern, n)]
            if not hits:
                raise ValueError(f"vescale.tensor_parallel[{pattern!r}]: matches no module of "
                                 f"{type(model).__name__}")
            for name in hits:
                if not isinstance(names[name], nn.Linear):
                    raise ValueError(f"vescale.tensor_parallel[{pattern!r}]: {name} is a "
                                     f"{type(names[name]).__name__}; {style} splits nn.Linear")
                cut = names[name].out_features if style == "colwise" else \
                    names[name].in_features
                if cut % tp:
                    dim = "out_features" if style == "colwise" else "in_features"
                    raise ValueError(f"vescale.tensor_parallel[{pattern!r}]: {name}.{dim} "
                                     f"{cut} is not divisible by {key}")
        return ParallelPlan("vescale.tensor_parallel", dict(config_plan))
    rules = getattr(model, "tp_plan", None)
    expand = getattr(model, "_expand_parallel_plan", None)
    _require_plan_support(model, key, "base_model_tp_plan", rules, expand,
                          "vescale.tensor_parallel")
    if not rules:
        raise ValueError(f"{key}: {type(model).__name__} has no tensor-parallel plan; give one "
                         "in vescale.tensor_parallel (module pattern -> colwise or rowwise) or "
                         "use a transformers model whose config has base_model_tp_plan")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(f"{key}: the model's {attr} {heads} is not divisible by it (each "
                             "rank computes whole heads)")
    return ParallelPlan("the model's base_model_tp_plan", expand(dict(rules)))


def _expert_parallel_plan(model, ep: int):
    key = f"expert_parallel.autoep_size {ep}"
    rules = getattr(model, "ep_plan", None)
    expand = getattr(model, "_expand_parallel_plan", None)
    _require_plan_support(model, key, "base_model_ep_plan", rules, expand, None)
    if not rules:
        raise ValueError(f"{key}: {type(model).__name__} has no expert-parallel plan (transformers "
                         "MoE models with fused experts have base_model_ep_plan: Mixtral, "
                         "Qwen3-MoE, DeepSeek-V3, ...)")
    plan = expand(dict(rules))
    modules = dict(model.named_modules())
    experts = tuple(name for name, style in plan.items() if style == EP_DISPATCH)
    if not experts:
        raise ValueError(f"{key}: the expert plan of {type(model).__name__} names no "
                         f"{EP_DISPATCH} module")
    for name in experts:
        count = getattr(modules[name], "num_experts", None)
        if not isinstance(count, int):
            raise ValueError(f"{key}: {name} ({type(modules[name]).__name__}) has no "
                             "num_experts")
        if count % ep:
            raise ValueError(f"{key} does not divide the {count} experts of {name}")
    return plan, experts


def _require_plan_support(model, key, plan_name, rules, expand, alternative) -> None:
    """A model whose config has a TP/EP plan, with a transformers that cannot apply it: the
    plans are expanded and applied with `PreTrainedModel._expand_parallel_plan` and
    `transformers.distributed` (transformers 5.23 and later; the releases before have the
    plans but another, incompatible TP API)."""
    if not rules or expand is not None:
        return
    # the version of the library the model comes from (transformers, for a plan of its own)
    library = sys.modules.get(type(model).__module__.split(".")[0])
    version = getattr(library, "__version__", "?")
    instead = f"give the plan in {alternative} or " if alternative else ""
    raise ValueError(f"{key}: the model's {plan_name} is applied with transformers' "
                     "PreTrainedModel._expand_parallel_plan (transformers 5.23 and later), which "
                     f"transformers {version} does not have: {instead}upgrade transformers")


def _matches(pattern: str, name: str) -> bool:
    """torch's parallelize_module rule: the pattern and the name split at dots, atom by atom
    (fnmatch), so `layers.*.mlp.up` matches `layers.3.mlp.up` and not `layers.3.x.mlp.up`."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a)
                                            for a, p in zip(atoms, parts))


def apply_parallel_plan(model: nn.Module, plan: ParallelPlan, meshes: Meshes) -> None:
    """Split the model's weights into DTensors on the tp / ep meshes (each rank keeps its own
    piece of the weights it was built with: every rank must build the same model; a model on
    meta gets DTensors on meta, their values come after wrapping) and hook the forwards that
    move activations between the ranks."""
    _connect()  # a model's own plans are applied by an integration (transformers')
    if plan.tp_source == "vescale.tensor_parallel":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, meshes.tp,
                           {pattern: styles[style]() for pattern, style in plan.tp_plan.items()})
    elif plan.tp_source is not None:
        extensions.the_one("tensor_parallel", plan.tp_source)(model, meshes.tp, plan.tp_plan)
    if plan.ep_plan:
        extensions.the_one("expert_parallel", "the model's expert plan")(
            model, meshes.ep, meshes.tp, plan.ep_plan)


def batch_fingerprint(args, kwargs, device) -> torch.Tensor:
    """A few float64 numbers that differ between two batches with near certainty: the count
    of tensors, their elements, their sum and a position-weighted sum (reordered rows differ)."""
    values = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    out = torch.zeros(4, dtype=torch.float64, device=device)
    out[0] = len(values)
    for t in values:
        flat = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        weights = torch.arange(flat.numel(), device=device, dtype=torch.float64) % 9973 + 1
        out[1] += flat.numel()
        out[2] += flat.sum()
        out[3] += (flat * weights).sum()
    return out


def require_same_batch(args, kwargs, tp_group, device) -> None:
    """Every rank of `tp_group` got the batch its first rank got, or every rank of it raises
    (one all-gather of four numbers)."""
    mine = batch_fingerprint(args, kwargs, device)
    size = dist.get_world_size(tp_group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=tp_group)
    ranks = dist.get_process_group_ranks(tp_group)
    differ = [r for r, fp in zip(ranks, gathered) if not torch.equal(fp, gathered[0])]
    if differ:
        raise ValueError(f"data inconsistency within the tensor-parallel group {ranks}: rank(s) "
                         f"{differ} got a different batch from rank {ranks[0]}; the ranks of a "
                         "TP group must get the same batch (data-parallel rank = rank // "
                         "autotp_size, as the dataloader initialize returns does)")
