"""gloo's own all-gather and reduce-scatter against the point-to-point exchanges that
vescale_engine.collectives runs on gloo instead, on one buffer of a GPT block's size.

Every repetition runs all four variants in turn (so machine noise falls on all alike) after a
barrier; the median of each is reported, from the slowest rank.

    python benchmarks/collectives.py        # writes benchmarks/results/collectives.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from ranks import run_ranks, write_report  # noqa: E402

VARIANTS = ("gloo all_gather_into_tensor", "exchange all-gather",
            "gloo reduce_scatter_tensor", "exchange reduce-scatter")


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    from vescale_engine.shard import collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    S = args.numel // world
    shard, full = torch.randn(S), torch.randn(world * S)
    gathered, reduced = torch.empty(world * S), torch.empty(S)
    runs = {
        VARIANTS[0]: lambda: dist.all_gather_into_tensor(gathered, shard),
        VARIANTS[1]: lambda: collectives.all_gather(gathered, shard, None).wait(),
        VARIANTS[2]: lambda: dist.reduce_scatter_tensor(reduced, full),
        VARIANTS[3]: lambda: collectives.reduce_scatter(reduced, full, None).wait(),
    }
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(json.dumps({"median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()}}),
          flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--numel", type=int, default=3_150_336,
                        help="buffer elements (default: one block of the benchmark GPT)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "collectives.md"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    flags = ["--numel", str(args.numel), "--reps", str(args.reps)]
    results = run_ranks(os.path.abspath(__file__), "gloo", args.world, flags)
    median = {n: max(r["median_ms"][n] for r in results) for n in VARIANTS}
    mb = args.numel * 4 / 1e6
    lines = [
        "# Collectives on gloo: gloo's own vs vescale_engine's point-to-point exchanges", "",
        f"Produced by `python benchmarks/collectives.py{''.join(' ' + a for a in sys.argv[1:])}` "
        f"on a 2-core CPU machine, {args.world} "
        f"ranks, OMP_NUM_THREADS=1 per rank, one fp32 buffer of {args.numel:,} elements "
        f"({mb:.1f} MB, one block of the benchmark GPT); median of {args.reps} alternated "
        "repetitions, slowest rank.", "",
        "| collective | gloo (ms) | exchange (ms) | exchange / gloo |",
        "|---|---:|---:|---:|",
    ]
    for label, native, exchange in (("all-gather", VARIANTS[0], VARIANTS[1]),
                                    ("reduce-scatter", VARIANTS[2], VARIANTS[3])):
        lines.append(f"| {label} | {median[native]:.2f} | {median[exchange]:.2f} | "
                     f"{median[exchange] / median[native]:.2f}x |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
