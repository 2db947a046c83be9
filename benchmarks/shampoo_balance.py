"""Shampoo's root work per rank on the example models: how evenly the planner's equal shards
spread the eigendecompositions of a root recomputation (sum of k^3 over the L and R of the
blocks each rank holds), at the default max_preconditioner_dim 1024 (rows:1024 sharding), from
`vescale_engine.plan.capacity` (what `vescale plan --memory --optimizer Shampoo` prints), and
the same at B = 256 (`--max-preconditioner-dim 256`): smaller row runs, more of them per rank. Pure
Python, no torch: computed from the plans, the same numbers each rank's Shampoo.root_work()
gives (tests/core/optim/test_shampoo.py checks them rank by rank).

    python benchmarks/shampoo_balance.py    # writes benchmarks/results/shampoo_balance.md
"""
from __future__ import annotations

import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vescale_engine.plan import capacity, model_plan  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = sorted(glob.glob(os.path.join(HERE, "..", "examples", "models", "*.json")))
RESULTS = os.path.join(HERE, "results", "shampoo_balance.md")
WORLD_SIZES = (8, 64, 256, 1024)
BLOCKS = (1024, 256)   # max_preconditioner_dim: the default, and a finer one
TARGET = 1.10   # busiest rank's work over the mean (issue 26)


def rows():
    out = []
    for path in MODELS:
        model = model_plan.load_shapes(path)
        cache, uses = capacity.PlanCache(), capacity.tensor_uses(path)
        for block in BLOCKS:
            for world in WORLD_SIZES:
                setup = capacity.Setup(world_size=world, optimizer="Shampoo",
                                       shampoo_block=block)
                ours = capacity.estimate(model, setup, uses, cache)["memory"]["ours"]
                out.append(dict(model=os.path.basename(path)[:-5], block=block, world=world,
                                padding=ours["padding_ratio"], **ours["shampoo_root_work"]))
    return out


def table(results) -> str:
    lines = ["| model | B | ranks | busiest / mean | ranks with no block | padding | "
             f"within {TARGET:g}x |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['block']} | {r['world']:,} | {r['max_over_mean']:.3f} | "
                     f"{r['idle_ranks']} | {100 * r['padding']:.1f}% | "
                     f"{'yes' if r['max_over_mean'] <= TARGET else 'no'} |")
    return "\n".join(lines)


def main():
    results = rows()
    met = {b: sum(r["max_over_mean"] <= TARGET for r in results if r["block"] == b)
           for b in BLOCKS}
    cells = len(results) // len(BLOCKS)
    text = (f"# Shampoo root work per rank on the example models\n\n"
            f"Produced by `python benchmarks/shampoo_balance.py` (estimated from the plans, no "
            f"torch). Work: sum of k^3 over the k x k L and R of every Shampoo block a rank "
            f"holds (B = max_preconditioner_dim, rows:B sharding, whole matrices for stacks "
            f"whose rows are not a multiple of B), summed over the model's units; padding: "
            f"ours' padding ratio for this sharding.\n\n{table(results)}\n\n"
            + "".join(f"- B = {b}: within {TARGET:g}x of the mean in **{met[b]} of {cells}** "
                      f"cells.\n" for b in BLOCKS)
            + "- Where it misses, a rank's fair share is a few row runs of B rows or less: a "
            "run is atomic, so ranks hold 0, 1 or 2 of them, and a repeated layer repeats its "
            "layout, so the same ranks are the busy ones in every layer.\n")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
