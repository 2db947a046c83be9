"""The runtime's own cost per step, apart from the model: many tiny fully_shard units (so hooks,
collectives and bookkeeping dominate), or a few wide ones, under torchrun. Prints rank 0's
median step time; run two trees alternately to compare them (benchmarks/results/
runtime_seams_ab.md).

    OMP_NUM_THREADS=1 PYTHONPATH=<tree> torchrun --nproc_per_node 2 benchmarks/runtime_overhead.py
    UNITS=8 DIM=1024 ... (a few wide units); STEPS=N (default 60, the first 10 not timed)
    CALLS=1 ...: also the Python calls per step (cProfile over 5 steps after the timed ones),
    in all and inside vescale_engine: a count, not a time, so two trees compare exactly where
    wall-clock noise on a shared machine (10% here) hides a few percent
"""
import cProfile
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def main():
    dist.init_process_group("gloo")
    from vescale_engine import fully_shard
    torch.manual_seed(0)
    units, dim = int(os.environ.get("UNITS", "48")), int(os.environ.get("DIM", "32"))
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(units)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4 if dim <= 64 else 64, dim)
    times = []
    for _ in range(int(os.environ.get("STEPS", "60"))):
        start = time.perf_counter()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"median step {statistics.median(times[10:]) * 1e3:.2f} ms "
              f"({units} units of Linear({dim}, {dim}), {dist.get_world_size()} ranks)")
    if os.environ.get("CALLS") == "1":
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        profile.disable()
        stats = pstats.Stats(profile).stats
        ours = sum(n for (f, _, _), (_, n, *_) in stats.items() if "vescale_engine" in f)
        total = sum(n for _, n, *_ in stats.values())
        if dist.get_rank() == 0:
            print(f"Python calls per step: {total / 5:.0f} ({ours / 5:.0f} in vescale_engine)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
