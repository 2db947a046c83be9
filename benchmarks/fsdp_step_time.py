"""Step time and peak memory: vescale_engine.fully_shard vs PyTorch FSDP2, 2 ranks on gloo.

The same GPT (examples/gpt_model.py, ~34M parameters), seed, data and AdamW; each block a unit,
then the root. Runs are alternated (ours, FSDP2, compute floor, ours, ...) and medians
reported. The compute floor is one process doing one rank's work (its micro-batch forward and
backward and an AdamW step over the whole model) with no communication.

    python benchmarks/fsdp_step_time.py        # writes benchmarks/results/fsdp_step_time.md
"""
from __future__ import annotations

import json
import os
from importlib import metadata
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from ranks import (alternate, benchmark_parser, command_line, cpu_model, run_ranks,  # noqa: E402
                   write_report)

SYSTEMS = ("vescale", "fsdp2", "floor")


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)
    world = 1 if args.system == "floor" else args.world
    if world > 1:  # run_ranks set torchrun's environment
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.dim, n_head=args.dim // 64,
                    block_size=args.seq)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    if args.system == "vescale":
        from vescale_engine import optim as vopt
        from vescale_engine.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = vopt.AdamW(model.parameters(), lr=1e-3)
    elif args.system == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + args.rank)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        t0 = time.perf_counter()
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rank": args.rank, "step_s": statistics.median(times), "rss_mb": rss_mb,
                      "losses": losses, "params": params}), flush=True)


def launch(system, args):
    flags = [f"--{k}={getattr(args, k)}" for k in
             ("world", "layers", "dim", "seq", "batch", "steps", "warmup")]
    results = run_ranks(__file__, system, 1 if system == "floor" else args.world, flags,
                        timeout_s=1800)
    return {"step_s": max(r["step_s"] for r in results),
            "rss_mb": max(r["rss_mb"] for r in results),
            "losses": results[0]["losses"], "params": results[0]["params"]}


def main():
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS, layers=8, dim=512, seq=256,
                              steps=8)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "fsdp_step_time.md"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    runs = alternate(SYSTEMS, args.rounds, lambda system: launch(system, args),
                     lambda run: f"step {run['step_s']:.3f} s, peak RSS {run['rss_mb']:.0f} MB")
    med = {s: {k: statistics.median(x[k] for x in runs[s]) for k in ("step_s", "rss_mb")}
           for s in SYSTEMS}
    ratio = med["vescale"]["step_s"] / med["fsdp2"]["step_s"]
    mem_ok = med["vescale"]["rss_mb"] <= med["fsdp2"]["rss_mb"]
    same_loss = max(abs(a - b) for a, b in zip(runs["vescale"][0]["losses"],
                                               runs["fsdp2"][0]["losses"]))
    cmd = command_line(__file__, env_keys=("MALLOC_MMAP_THRESHOLD_",))
    lines = [
        "# fully_shard step time and memory: vescale_engine vs PyTorch FSDP2", "",
        f"Produced by `{cmd}` on {cpu_model()} (torch {metadata.version('torch')}), "
        f"{args.world} ranks on gloo, OMP_NUM_THREADS=1 per rank, GPT with "
        f"{runs['vescale'][0]['params'] / 1e6:.1f}M parameters ({args.layers} layers, width "
        f"{args.dim}, sequence {args.seq}, micro-batch {args.batch} per rank), fp32, AdamW; "
        f"median over {args.rounds} alternated rounds of the per-run median step ({args.steps} "
        f"steps after {args.warmup} warm-up).", "",
        "| system | step time (s) | vs compute floor | peak RSS per rank (MB) |",
        "|---|---:|---:|---:|"]
    for s, label in (("vescale", "vescale_engine.fully_shard"), ("fsdp2", "PyTorch FSDP2"),
                     ("floor", "compute floor (1 process, no communication)")):
        lines.append(f"| {label} | {med[s]['step_s']:.3f} | "
                     f"{med[s]['step_s'] / med['floor']['step_s']:.2f}x | "
                     f"{med[s]['rss_mb']:.0f} |")
    lines += ["",
              f"- Step time vescale / FSDP2: **{ratio:.3f}** (target <= 0.92: "
              f"{'met' if ratio <= 0.92 else 'MISSED'}).",
              f"- Peak memory vescale <= FSDP2: {'met' if mem_ok else 'MISSED'}.",
              f"- Largest loss difference between the two over the run: {same_loss:.2e}."]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
