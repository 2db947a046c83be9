"""Shampoo's root work per rank on the example models: how evenly the planner's equal shards
spread the eigendecompositions of a root recomputation (sum of k^3 over the L and R of the
blocks each rank holds), at the default max_preconditioner_dim 1024 (rows:1024 sharding), from
`vescale_engine.plan.capacity` (what `vescale plan --memory --optimizer Shampoo` prints). Pure
Python, no torch: computed from the plans, the same numbers each rank's Shampoo.root_work()
gives (tests/test_shampoo.py checks them rank by rank).

    python benchmarks/shampoo_balance.py    # writes benchmarks/results/shampoo_balance.md
"""
from __future__ import annotations

import glob
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vescale_engine.plan import capacity, model_plan  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = sorted(glob.glob(os.path.join(HERE, "..", "examples", "models", "*.json")))
RESULTS = os.path.join(HERE, "results", "shampoo_balance.md")
WORLD_SIZES = (8, 64, 256, 1024)
TARGET = 1.10   # busiest rank's work over the mean (issue 26)


def rows():
    out = []
    for path in MODELS:
        model = model_plan.load_shapes(path)
        cache, uses = capacity.PlanCache(), capacity.tensor_uses(path)
        for world in WORLD_SIZES:
            began = time.perf_counter()
            est = capacity.estimate(model, capacity.Setup(world_size=world, optimizer="Shampoo"),
                                    uses, cache)
            ours = est["memory"]["ours"]
            out.append(dict(model=os.path.basename(path)[:-5], world=world,
                            padding=ours["padding_ratio"], seconds=time.perf_counter() - began,
                            **ours["shampoo_root_work"]))
    return out


def table(results) -> str:
    lines = ["| model | ranks | busiest / mean | ranks with no block | padding | "
             f"within {TARGET:g}x |", "|---|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['world']:,} | {r['max_over_mean']:.3f} | "
                     f"{r['idle_ranks']} | {100 * r['padding']:.1f}% | "
                     f"{'yes' if r['max_over_mean'] <= TARGET else 'no'} |")
    return "\n".join(lines)


def main():
    results = rows()
    met = sum(r["max_over_mean"] <= TARGET for r in results)
    text = (f"# Shampoo root work per rank on the example models\n\n"
            f"Produced by `python benchmarks/shampoo_balance.py` (estimated from the plans, no "
            f"torch). Work: sum of k^3 over the k x k L and R of every Shampoo block a rank "
            f"holds (max_preconditioner_dim 1024, rows:1024 sharding, whole matrices for "
            f"stacks whose rows are not a multiple of 1024), summed over the model's units; "
            f"padding: ours' padding ratio for this sharding.\n\n{table(results)}\n\n"
            f"- Within {TARGET:g}x of the mean: **{met} of {len(results)}** cells.\n"
            f"- Where it misses, a rank's fair share is a few row runs of 1024 rows or less: "
            f"a run is atomic, so ranks hold 0, 1 or 2 of them, and a repeated layer repeats "
            f"its layout, so the same ranks are the busy ones in every layer.\n")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
