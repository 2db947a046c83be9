"""DeepSpeed's own MoE layer (`deepspeed.moe.layer.MoE`) under our engine: which modules hold
its experts, the expert-data-parallel group each is sharded over, and what we refuse.

DeepSpeed marks an expert's parameters `allreduce = False` and `group_name = "ep_size_N"`
(deepspeed/moe/experts.py). Its engine creates, once per N, the expert-parallel group (N
consecutive ranks; the layer's all-to-all runs there) and the expert-data-parallel group
(ranks r, r+N, r+2N, ...: the ranks that hold the same experts) by calling each layer's
`set_deepspeed_parallelism` (engine.py `_configure_distributed_model`, groups.py
`_create_expert_and_data_parallel`); we call it the same way. ZeRO-1/2 then partition and
reduce the experts over that group only, and divide their summed gradients by the whole
data-parallel size, as the dense ones (stage_1_and_2.py `average_tensor`). Here: each module
whose parameters are all experts of one group (DeepSpeed's `Experts`) becomes its own FSDP
unit over that group with `gradient_divide_factor` = the world size and a rank-local
ShardingPolicy (the gradient norm sums its shards over the world: every expert-parallel rank's
experts once); everything else stays on the world group.

Refused at initialize, with one line and before any collective of ours: expert tensor
parallelism, an ep_size that does not divide the world, HSDP or ZeRO stage 0 (a replicated
mesh), and expert parameters in a module that also holds dense ones (no unit could take them
alone). Checkpoints and gathered state dicts are refused when they are asked for
(engine/wrap.py's `refuse_with_experts`, for any rank-local unit): every expert-parallel
rank's experts have the same names, so a file would keep one rank's and silently lose the
others'. The engine reaches this module through its `extra_units` extension point
(engine/extensions.py; registered by extension.py).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from ...fsdp.policy import ShardingPolicy

__all__ = ["ExpertSharding", "expert_sharding", "is_expert_param"]


def is_expert_param(p) -> bool:
    """DeepSpeed's test (deepspeed.moe.utils.is_moe_param)."""
    return hasattr(p, "allreduce") and not p.allreduce


@dataclass(frozen=True)
class ExpertSharding:
    """The expert units: module -> its expert-data-parallel group, and the divisor."""
    groups: dict  # id(module) -> ProcessGroup, for the expert modules and modules inside them
    modules: tuple  # the outermost all-expert modules, each a unit unless units inside cover it
    divide_factor: int  # the dense data-parallel size (the world)

    def units(self, model: nn.Module, chosen) -> tuple:
        """The policy's units plus the expert modules, children before parents; an expert
        module whose parameters the chosen units inside it already hold is left out."""
        inside = {}
        for m in chosen:
            for p in m.parameters():
                inside[id(p)] = m
        extra = [m for m in self.modules
                 if not all(id(p) in inside for p in m.parameters())]
        for module in chosen:  # a policy unit inside an expert module shards with it
            for expert in self.modules:
                if any(module is sub for sub in expert.modules()):
                    self.groups[id(module)] = self.groups[id(expert)]
        wanted = {id(m) for m in (*chosen, *extra)}
        return tuple(m for m in _post_order(model) if id(m) in wanted)

    def sharding(self, module, sharding: ShardingPolicy) -> dict:
        """fully_shard's mesh, divisor and sharding policy for `module` ({} for a dense unit):
        its parameters are rank-local (each expert-parallel rank's experts its own)."""
        group = self.groups.get(id(module))
        if group is None:
            return {}
        return {"mesh": group, "gradient_divide_factor": self.divide_factor,
                "sharding": dataclasses.replace(sharding, rank_local=True)}


def expert_sharding(model: nn.Module, cfg, mesh) -> ExpertSharding | None:
    """None for a model without DeepSpeed expert parameters. Otherwise the checks (one-line
    ValueError, the same on every rank), then DeepSpeed's groups (made as its engine makes
    them when they do not exist yet: collective over the world)."""
    experts = {name: p for name, p in model.named_parameters() if is_expert_param(p)}
    if not experts:
        return None
    world = dist.get_world_size()
    layers = _moe_layers(model)
    for name, layer in layers:
        where = f"deepspeed.moe.layer.MoE {name or '(the model)'}"
        if layer.enable_expert_tensor_parallelism:
            raise ValueError(f"{where}: enable_expert_tensor_parallelism=True is not supported "
                             "by veScale Engine (experts are sharded data-parallel only)")
        if world % layer.ep_size:
            raise ValueError(f"{where}: ep_size {layer.ep_size} does not divide the world size "
                             f"{world}")
    if mesh is not None:
        raise ValueError("DeepSpeed MoE layers need ZeRO stage 1-3 without "
                         "vescale.hsdp_replicate_size (their experts shard over the "
                         "expert-data-parallel group); this config replicates "
                         f"(zero_optimization.stage {cfg.zero_stage}, hsdp_replicate_size "
                         f"{cfg.hsdp_replicate_size})")
    modules = _expert_modules(model, experts)
    names = sorted({_group_name(n, p) for n, p in experts.items()})
    from deepspeed import comm as ds_comm
    if layers and not ds_comm.is_initialized():  # the layer's all-to-all goes through it
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    for name, layer in layers:  # DeepSpeed's engine does this at initialize
        if layer.deepspeed_moe.ep_group is None:
            layer.set_deepspeed_parallelism(False)
    from deepspeed.utils import groups as ds_groups
    edp = ds_groups._get_expert_data_parallel_group_dict()
    missing = [n for n in names if n not in edp]
    if missing:  # only other code's experts can get here: rank-consistent, before our gathers
        raise ValueError(f"expert parameters of group {missing[0]!r} (allreduce=False) have "
                         "no DeepSpeed expert-data-parallel group: they must come from "
                         "deepspeed.moe.layer.MoE, or the group be created before initialize")
    return ExpertSharding({id(m): edp[g] for m, g in modules}, tuple(m for m, _ in modules),
                          world)


def _moe_layers(model):
    layer_module = sys.modules.get("deepspeed.moe.layer")
    if layer_module is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, layer_module.MoE)]


def _group_name(name, p) -> str:
    group = getattr(p, "group_name", None)
    if not isinstance(group, str) or not group.startswith("ep_size_"):
        raise ValueError(f"expert parameter {name} (allreduce=False) has group_name "
                         f"{group!r}, not DeepSpeed's 'ep_size_N'")
    return group


def _expert_modules(model, experts) -> list:
    """(module, group name) for the outermost modules whose parameters (recursively, each
    held only inside) are all experts of one group and that run a forward of their own."""
    expert_ids = {id(p): _group_name(n, p) for n, p in experts.items()}
    owners = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(module))
    found, covered = [], set()

    def visit(module):
        params = list(module.parameters())
        groups = {expert_ids.get(id(p)) for p in params}
        inside = {id(m) for m in module.modules()}
        if (params and len(groups) == 1 and None not in groups
                and type(module).forward is not nn.Module.forward
                and all(owners[id(p)] <= inside for p in params)):
            found.append((module, groups.pop()))
            covered.update(id(p) for p in params)
            return
        for child in module.children():
            visit(child)

    visit(model)
    for name, p in experts.items():
        if id(p) not in covered:
            raise ValueError(f"expert parameter {name} (allreduce=False) is in a module that "
                             "also holds dense parameters (or shares it outside): no FSDP unit "
                             "can shard it over its expert-data-parallel group alone")
    return found


def _post_order(model):
    order = []

    def visit(module):
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order
