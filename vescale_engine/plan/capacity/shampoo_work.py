"""Shampoo's root work on every rank, from the planner's layouts.

Every precondition_frequency steps each rank eigendecomposes the L and R of the Shampoo blocks
it holds (optim/shampoo.py), and no rank waits for another until the next collective, so the
slowest rank sets the pace. The planner gives every rank the same number of elements, not the
same work: a k x k statistic costs k^3, padding and 1-D tensors cost nothing. This sums, per
rank, k^3 over the L and R of the blocks it owns (whole row runs under `rows:B`), over every
unit instance of the model, and says how far the busiest rank is above the mean."""
from __future__ import annotations

from ..optim_spec import shampoo_root_work
from .ours import PlanCache
from .request import Setup
from .units import Unit, expand

__all__ = ["root_work_per_rank", "root_work_balance"]


def root_work_per_rank(root: Unit, others: list, setup: Setup, cache: PlanCache) -> list:
    """[work of rank r] over the ranks of the dense shard group (setup.group_size)."""
    keys = ([(root, 0)] if root.tensors else []) + expand(others)
    work = [0] * setup.shard_size
    for unit, _ in keys:
        shapes = {t.name: t.shape for t in unit.tensors}
        for buf in cache.plan(unit, setup).buffers:
            for p in buf.placements:
                shape = shapes[p.name]
                if len(shape) < 2:
                    continue
                start, numel = 0, p.numel
                for i, units in enumerate(p.units):
                    end = min(start + units * p.spec.block, numel)  # a last block is shorter
                    work[p.first_rank + i] += shampoo_root_work(
                        shape, start // shape[-1], end // shape[-1], setup.shampoo_block)
                    start = end
    return work


def root_work_balance(work: list) -> dict:
    """{max, mean, max_over_mean, idle_ranks} of per-rank root work."""
    mean = sum(work) / len(work)
    return {"max": max(work), "mean": mean,
            "max_over_mean": max(work) / mean if mean else 1.0,
            "idle_ranks": sum(1 for w in work if w == 0)}
