"""The wrap policy: which submodules become FSDP units (the config's `wrap_policy`, or a default
read from the model), sharded over the mesh initialize gives (parallel_plan.build_meshes)."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import optim
from ..fsdp.api import fully_shard
from ..fsdp.lending import gather_on_read
from ..fsdp.lookup import rank_local_units, unit_of, units_under
from ..fsdp.policy import MixedPrecisionPolicy
from . import extensions
from .leaf_modules import units_with_whole_leaves

__all__ = ["WrapChoice", "ExpertUnits", "wrap_model", "describe", "choose_units",
           "default_units", "declared_unsplittable", "size_threshold", "refuse_with_experts",
           "DEFAULT_UNITS"]

LOG = logging.getLogger("vescale_engine")

# The size rule's unit: about 1/DEFAULT_UNITS of the model, so that what forward holds gathered
# (the unit it computes, the one prefetched, the root's own parameters) is about a quarter of
# the model instead of all of it, while a step still issues only a few dozen collectives; at
# most MAX_DEFAULT_UNIT_PARAMS (PyTorch FSDP1's size-based default), so that a huge model
# without structure does not get 8 huge units.
DEFAULT_UNITS = 8
MAX_DEFAULT_UNIT_PARAMS = 100_000_000
# Above this padding (over the parameters) a Shampoo run is warned: its rows:B blocks are too
# coarse for the ranks (Llama-3-70B at 64 ranks, B = 1024: 238%, benchmarks/shampoo_balance.py).
SHAMPOO_PADDING_WARNING = 0.25
CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True)
class WrapChoice:
    """The units below the root (innermost first) and the rule that chose them."""
    rule: str
    modules: tuple
    detail: str  # the classes or the threshold, for the log line


@dataclass(frozen=True)
class ExpertUnits:
    """The experts modules split by expert parallelism, the mesh their units shard over (the
    expert-data-parallel ranks) and what their summed gradients are divided by: the dense
    data-parallel size, as each rank's loss is a mean over its own micro-batch (torchtitan's
    and transformers' rule)."""
    modules: tuple
    mesh: object
    divide_factor: float


def wrap_model(model: nn.Module, cfg, mesh, experts: ExpertUnits | None = None) -> nn.Module:
    """Shard the units `choose_units` picks, innermost first, then the root; rank 0 logs the
    choice in one line. With `experts` (expert parallelism) each experts module is a unit of
    its own on the experts' mesh first; the router and shared experts stay in the enclosing
    dense unit. An integration's `extra_units` gives other layers units of their own
    (DeepSpeed MoE experts, over their expert-data-parallel group: extensions.py)."""
    extra = extensions.first_answer("extra_units", model, cfg, mesh)  # errors before our
    if extra is not None and experts is not None:                      # collectives
        raise ValueError("a model whose layers split their experts themselves (DeepSpeed's "
                         "deepspeed.moe.layer.MoE) cannot also use expert_parallel.autoep_size")
    kwargs = _fully_shard_keywords(model, cfg, mesh)
    for extension in extensions.registered("before_wrap"):  # DeepSpeed's leaf modules
        extension.before_wrap(model, cfg)
    choice = choose_units(model, cfg.wrap.module_classes, cfg.wrap.min_params)
    choice = WrapChoice(choice.rule, units_with_whole_leaves(model, choice.modules),
                        choice.detail)
    if experts is not None:
        for module in experts.modules:
            fully_shard(module, **{**kwargs, "mesh": experts.mesh},
                        gradient_divide_factor=experts.divide_factor)
        split = {id(m) for m in experts.modules}
        choice = WrapChoice(choice.rule, tuple(m for m in choice.modules if id(m) not in split),
                            choice.detail)
    if extra is not None:
        choice = WrapChoice(choice.rule, extra.units(model, choice.modules), choice.detail)
    for module in choice.modules:
        own = extra.sharding(module, kwargs["sharding"]) if extra is not None else {}
        fully_shard(module, **{**kwargs, **own})
    # the root stays unsharded from forward into backward, which starts with it (FSDP2's
    # default for the root: reshard_after_forward=None)
    fully_shard(model, **{**kwargs, "reshard_after_forward": None})
    gather_on_read(units_under(model))  # a parameter read in forward, as DeepSpeed gathers it
    if dist.get_rank() == 0:
        _report(cfg, model, choice)
    return model


def _fully_shard_keywords(model: nn.Module, cfg, mesh) -> dict:
    """fully_shard's keywords for every unit: the config's policies, the granularity the
    optimizer needs, DeepSpeed's mixed precision."""
    given = ((cfg.raw.get("vescale") or {}).get("granularity") or {})  # a default set or not
    wrap, precision = cfg.wrap, cfg.precision
    granularity = optim.sharding_granularity(  # the granularity the optimizer needs
        cfg.optimizer, {"overrides": wrap.granularity_overrides,
                        **({"default": wrap.granularity} if "default" in given else {})}, model)
    compute, reduce = precision.param_dtype, precision.reduce_dtype or precision.param_dtype
    # cfg.sharding.face, ZeRO3Pieces: DeepSpeed ZeRO-3's view of a sharded parameter (a plain
    # tensor that deepspeed.zero.GatheredParameters fills in place), which the DeepSpeed-aware
    # libraries the engine serves (transformers, PEFT, TRL) rely on
    return dict(mesh=mesh, reshard_after_forward=wrap.reshard_after_forward,
                sharding=dataclasses.replace(cfg.sharding, granularity=granularity),
                memory=cfg.memory, communication=cfg.communication,
                mp_policy=MixedPrecisionPolicy(
                    param_dtype=getattr(torch, compute) if compute else None,
                    # DeepSpeed's: gradients reduced in the compute dtype unless told, each
                    # rounded to it (bf16 weights' gradients are bf16 there)
                    reduce_dtype=getattr(torch, reduce) if reduce else None,
                    keep_wide_grads=False,
                    cast_forward_inputs=False))  # the model's inputs as DeepSpeed gives them


def _report(cfg, model: nn.Module, choice: WrapChoice) -> None:
    """Rank 0's lines on the wrap: the units chosen, coarse Shampoo blocks, FP8 matmuls."""
    LOG.info(describe(choice, model))
    _warn_coarse_shampoo(cfg, model, choice)
    if cfg.communication.fp8_matmul:
        routed = sum(u.fp8_linears for u in units_under(model))
        (LOG.info if routed else LOG.warning)(
            f"vescale.fp8_matmul: {routed} nn.Linear layers compute their forward from "
            "FP8 weight tiles" + ("" if routed else " (none has a weight gathered as "
                                  "tiles: see the warning above)"))


def refuse_with_experts(module: nn.Module, what: str) -> None:
    """One line instead of a checkpoint that would keep one expert-parallel rank's experts
    under names that every rank's experts share (the same on every rank: no collective)."""
    if rank_local_units(module):
        raise NotImplementedError(
            f"{what}: not supported yet for models with DeepSpeed MoE layers or other "
            "rank-local units (ShardingPolicy.rank_local: each expert-parallel rank holds "
            "different experts under the same names, and the file would keep only one rank's)")


def _padding(units) -> tuple:
    """(padding elements, parameter elements) of the units' buffers."""
    layouts = [b.layout for u in units for b in u.buffers]
    return sum(lay.padding for lay in layouts), sum(lay.numel for lay in layouts)


def _warn_coarse_shampoo(cfg, model, choice) -> None:
    """Shampoo's rows:B blocks are atomic: on many ranks they can pad the shards far beyond
    the model; say so once, with what pads less."""
    if (cfg.optimizer or {}).get("type") != "Shampoo":
        return
    padding, numel = _padding([unit_of(m) for m in (*choice.modules, model)])
    if padding > SHAMPOO_PADDING_WARNING * numel:
        block = (cfg.optimizer.get("params") or {}).get("max_preconditioner_dim", 1024)
        LOG.warning(f"Shampoo: its rows:{block} blocks pad the sharded model by "
                    f"{100 * padding / numel:.0f}% on {dist.get_world_size()} ranks (a run of "
                    f"{block} rows is atomic: too coarse for this many ranks); a smaller "
                    f"optimizer.params.max_preconditioner_dim or larger units pad less, and "
                    f"`vescale plan --memory --optimizer Shampoo --max-preconditioner-dim B` "
                    f"estimates each")


def describe(choice: WrapChoice, model: nn.Module) -> str:
    """One line: the rule, how many units, the largest (by parameters it gathers)."""
    units = [unit_of(m) for m in (*choice.modules, model)]
    largest = max(units, key=lambda u: u.numel)
    padding, numel = _padding(units)
    return (f"wrap policy: {choice.rule} ({choice.detail}) -> {len(units)} FSDP "
            f"unit{'s' if len(units) > 1 else ''} "
            f"({len(choice.modules)} + the root); largest {largest.name.split('#')[0]} with "
            f"{largest.numel:,} parameters of {sum(u.numel for u in units):,}; padding "
            f"{100 * padding / max(1, numel):.1f}%")


def choose_units(model: nn.Module, module_classes=(), min_params=None) -> WrapChoice:
    """The config's policy when it sets one (as it always did), else `default_units`."""
    if module_classes:
        names = set(module_classes)
        modules = _post_order(model, lambda m, pending: type(m).__name__ in names)
        if not modules:
            raise ValueError(f"vescale.wrap_policy.module_classes {list(module_classes)} match "
                             "no module of the model")
        return WrapChoice("vescale.wrap_policy.module_classes", modules,
                          ", ".join(module_classes))
    if min_params is not None:
        return WrapChoice("vescale.wrap_policy.min_params",
                          _post_order(model, lambda m, pending: pending >= min_params),
                          f">= {min_params:,} parameters")
    return default_units(model)


def _post_order(model, wanted) -> tuple:
    """Modules `wanted(module, parameters not yet in a unit below it)` picks, children before
    parents, never the root; a module with no such parameters is skipped."""
    chosen = []

    def visit(module):
        pending = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            pending += visit(child)
        if module is not model and pending and wanted(module, pending):
            chosen.append(module)
            return 0
        return pending

    visit(model)
    return tuple(chosen)


# -- the default: what a user would choose --------------------------------------------------------

def default_units(model: nn.Module) -> WrapChoice:
    """Without a wrap_policy: (1) the classes the model declares unsplittable (Hugging Face's
    `_no_split_modules`, e.g. LlamaDecoderLayer), else (2) the repeated children of a
    ModuleList / Sequential (a GPT's blocks) when they hold at least half the parameters, else
    (3) subtrees of about 1/DEFAULT_UNITS of the model. By default a unit is never a module
    that shares a parameter with a module outside it (the tie would break) nor one whose
    forward never runs (a ModuleList: nothing would gather it)."""
    tree = _Tree(model)
    declared = declared_unsplittable(model)
    if declared:
        modules = _post_order(model, lambda m, pending: type(m).__name__ in declared
                              and tree.can_be_unit(m))
        if modules:
            return tree.keep_root_nonempty(WrapChoice(
                "the model's _no_split_modules", modules, ", ".join(sorted(declared))))
    modules = _repeated_children(model, tree)
    if 2 * sum(tree.params_in(m) for m in modules) >= tree.total:
        classes = sorted({type(m).__name__ for m in modules})
        return tree.keep_root_nonempty(WrapChoice(
            "repeated children of a ModuleList", modules, ", ".join(classes)))
    threshold = size_threshold(tree.total)
    return tree.keep_root_nonempty(WrapChoice(
        "size threshold", _size_units(model, threshold, tree),
        f"~{threshold:,} parameters per unit"))


def declared_unsplittable(model: nn.Module) -> set:
    """Class names listed in `_no_split_modules` anywhere in the tree (Hugging Face sets it on
    the model class and, in transformers 5, merges the submodels' lists at post_init) that
    name a module the model has."""
    declared = set()
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set, frozenset)):
            declared.update(n for n in names if isinstance(n, str))
    present = {type(m).__name__ for m in model.modules()}
    return declared & present


def size_threshold(total_params: int) -> int:
    """Parameters per unit for the size rule (see DEFAULT_UNITS)."""
    return max(1, min(math.ceil(total_params / DEFAULT_UNITS), MAX_DEFAULT_UNIT_PARAMS))


def _repeated_children(model, tree) -> tuple:
    """The outermost groups of two or more same-class children (holding parameters) of a
    ModuleList / Sequential; nothing inside a chosen child is looked at."""
    chosen = []

    def visit(module):
        picked = set()
        if isinstance(module, CONTAINERS):
            by_class = {}
            for child in module.children():
                if tree.params_in(child) and tree.can_be_unit(child):
                    by_class.setdefault(type(child), []).append(child)
            for group in by_class.values():
                if len(group) > 1:
                    picked.update(map(id, group))
        for child in module.children():
            if id(child) in picked:
                chosen.append(child)
            else:
                visit(child)

    visit(model)
    return tuple(chosen)


def _size_units(model, threshold, tree) -> tuple:
    """Post-order: a module whose not-yet-wrapped parameters reach `threshold` becomes a unit;
    where many smaller subtrees add up past it (siblings, or the children of a ModuleList),
    the largest of them become units first, until what is left is at most `threshold`. So no
    unit, the root included (it stays gathered through the whole forward), holds much more
    than `threshold` unless one module's own parameters do."""
    chosen = []

    def visit(module):
        """(parameters not in a unit yet, the unwrapped subtrees that could hold them)"""
        pending = tree.own_params(module)
        pieces = []
        for child in module.children():
            n, child_pieces = visit(child)
            pending += n
            pieces += child_pieces
        carved = set()
        for n, piece in sorted(pieces, key=lambda c: -c[0]):
            if pending <= threshold:
                break
            chosen.append(piece)
            carved.add(id(piece))
            pending -= n
        pieces = [(n, piece) for n, piece in pieces if id(piece) not in carved]
        if module is model or not tree.can_be_unit(module):
            return pending, pieces
        if pending >= threshold:
            chosen.append(module)
            return 0, []
        return pending, [(pending, module)] if pending else []

    visit(model)
    return tuple(chosen)


class _Tree:
    """Parameter counts (each shared parameter once) and ownership of one model."""

    def __init__(self, model):
        self.model = model
        self.owners = {}  # id(parameter) -> ids of the modules that hold it
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    self.owners.setdefault(id(p), set()).add(id(module))
        self.total = sum(p.numel() for p in model.parameters())
        self._counted = set()

    def params_in(self, module) -> int:
        return sum(p.numel() for p in module.parameters())

    def own_params(self, module) -> int:
        """The module's own parameters not counted before (a tied weight counts once)."""
        n = 0
        for p in module.parameters(recurse=False):
            if id(p) not in self._counted:
                self._counted.add(id(p))
                n += p.numel()
        return n

    def can_be_unit(self, module) -> bool:
        """The module runs forward (a ModuleList never does, so its hooks would never gather
        it) and no parameter of it is also held by a module outside it (a tie would break)."""
        if type(module).forward is nn.Module.forward:
            return False
        inside = {id(m) for m in module.modules()}
        return all(self.owners[id(p)] <= inside for p in module.parameters())

    def keep_root_nonempty(self, choice: WrapChoice) -> WrapChoice:
        """The root is always a unit and must keep a parameter: if the chosen units hold all
        of them, the last (outermost) one stays with the root."""
        inside = {id(p) for m in choice.modules for p in m.parameters()}
        if choice.modules and all(id(p) in inside for p in self.model.parameters()):
            return WrapChoice(choice.rule, choice.modules[:-1], choice.detail)
        return choice
