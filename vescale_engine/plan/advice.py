"""What to do about a plan that pads a lot: `vescale plan` warns, one line per plan, when our
padding exceeds PADDING_WARNING_RATIO, and says which of the three remedies brings it down on
this model, each tried by planning it:

- a finer granularity (the same kind with fewer rows, a shorter block, a shallower tile; rows
  for whole matrices or tensors), coarsest first;
- fewer ranks per shard group: HSDP shards over world / R ranks and replicates R times (the
  same plan as `--world-size world / R`), the fewest replicas first;
- more buffers per unit (`--max-buffers`): four times as many.

Padding is large when a block is large next to a rank's share of a unit (e.g. a 128-row run of
a 28,672-column matrix at 512 ranks): more buffers cannot change that, the other two can. Pure
Python, like the planner.
"""
from __future__ import annotations

from dataclasses import replace

from .granularity import Granularity
from .model_plan import ModelPlan, ShapesError, plan_model
from .parallel import ParallelSizes, make_mesh

__all__ = ["PADDING_WARNING_RATIO", "finer_granularities", "padding_warning"]

PADDING_WARNING_RATIO = 0.25
_MORE_BUFFERS = 4      # times the plan's --max-buffers


def _halvings(n: int) -> list:
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out


def finer_granularities(granularity: Granularity) -> list:
    """Finer policies than `granularity`, coarsest first (empty for `element`)."""
    kind = granularity.kind
    if kind in ("rows", "block", "shampoo"):
        return [Granularity(kind, rows=r) for r in _halvings(granularity.rows)]
    if kind == "tile":
        return [Granularity("tile", rows=r, cols=granularity.cols)
                for r in _halvings(granularity.rows)]
    if kind in ("matrix", "tensor"):
        return ([Granularity("matrix")] if kind == "tensor" else []) + \
            [Granularity("rows", rows=r) for r in (1024, *_halvings(1024))]
    return []


def _replan(plan: ModelPlan, granularity=None, max_buffers=None, mesh=None) -> ModelPlan:
    mesh = mesh or plan.mesh
    world = mesh.dp_shard if mesh is not None else plan.world_size
    expert = mesh.efsdp if mesh is not None and mesh.ep > 1 else None
    out = plan_model(plan.model, world, granularity or plan.granularity,
                     align_bytes=plan.align_bytes, dtype=plan.dtype,
                     max_buffers=max_buffers or plan.max_buffers, expert_world_size=expert)
    return replace(out, mesh=mesh)


def _first_under(candidates, plan_of, threshold):
    """(candidate, its padding ratio) of the first candidate at or under `threshold`, else of
    the one padding least (None when there are none or none can be planned)."""
    best = None
    for candidate in candidates:
        try:
            ratio = plan_of(candidate).padding_ratio
        except (ShapesError, ValueError):   # a tile that does not fit, a mesh that does not
            continue
        if ratio <= threshold:
            return candidate, ratio
        if best is None or ratio < best[1]:
            best = (candidate, ratio)
    return best


def _pct(ratio: float) -> str:
    return f"{100 * ratio:.2f}%"


def padding_warning(plan: ModelPlan, threshold: float = PADDING_WARNING_RATIO) -> str | None:
    """One line when `plan` pads more than `threshold` of the parameters, else None."""
    if plan.padding_ratio <= threshold:
        return None
    mesh = plan.mesh or ParallelSizes(plan.world_size)
    helps, short, useless = [], [], []

    def sort(ratio, text):
        (helps if ratio <= threshold else short if ratio < plan.padding_ratio else
         useless).append(text)

    finer = _first_under(finer_granularities(plan.granularity),
                         lambda g: _replan(plan, granularity=g), threshold)
    if finer:
        flag = f"; Shampoo: --max-preconditioner-dim {finer[0].rows}" \
            if finer[0].kind == "shampoo" else ""
        sort(finer[1], f"a finer granularity ({finer[0]} pads {_pct(finer[1])}{flag})")
    replicas = [r for r in range(2, mesh.dp_shard + 1) if mesh.dp_shard % r == 0]
    groups = _first_under(replicas, lambda r: _replan(plan, mesh=make_mesh(
        mesh.world, mesh.tp, mesh.ep, mesh.replicate * r)), threshold)
    if groups:
        r = mesh.replicate * groups[0]
        shard = mesh.world // (r * mesh.tp)
        how = f"--world-size {shard}, or --memory --hsdp {r}" if (mesh.tp, mesh.ep) == (1, 1) \
            else f"--memory --hsdp {r}"
        sort(groups[1], f"fewer ranks per shard group ({shard} ranks x {r} HSDP replicas pad "
                        f"{_pct(groups[1])}: {how})")
    more = plan.max_buffers * _MORE_BUFFERS
    ratio = _replan(plan, max_buffers=more).padding_ratio
    sort(ratio, f"more buffers (--max-buffers {more} pads {_pct(ratio)})")
    parts = ([f"what helps: {', '.join(helps)}"] if helps else []) + \
        ([f"not enough: {', '.join(short)}"] if short else []) + \
        ([f"no help: {', '.join(useless)}"] if useless else [])
    return (f"warning: {plan.granularity} at {plan.world} ranks pads "
            f"{_pct(plan.padding_ratio)} of the parameters (over {100 * threshold:g}%: its blocks "
            f"are large next to a rank's share of a unit); {'; '.join(parts)}")
