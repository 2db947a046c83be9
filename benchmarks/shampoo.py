"""Shampoo vs AdamW on the example GPT (examples/train_gpt.py: char-level Tiny Shakespeare,
examples/configs/vescale_default.json), 2 ranks on gloo, the systems alternated: step time,
peak memory, optimizer-state bytes, the collectives of a step and the bytes they move, and the
loss after the same steps and tokens (one PNG of both curves).

Both runs use the example's config with only the optimizer changed (same schedule, clipping,
seed and batches; for Shampoo the example's `granularity` entry is dropped, so the engine
shards with Shampoo's own `shampoo:B`). AdamW keeps the example's tuned lr (2e-3); Shampoo's lr is `--shampoo-lr`.
Shampoo shards rows:B (B = --block, default 1024: every matrix of this model is one block);
its step adds no collective, so the bytes per step differ from AdamW's only by the padding of
the other granularity (reported: the shard elements each all-gather / reduce-scatter moves).

    python benchmarks/shampoo.py              # 300 steps, 2 rounds alternated
    python benchmarks/shampoo.py --smoke      # 20 steps of a smaller model: a check it runs
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from ranks import (alternate, benchmark_parser, cpu_model, example_setup,  # noqa: E402
                   loss_chart, peak, reset_peak, run_ranks, write_report)
SYSTEMS = ("AdamW", "Shampoo")


def worker(args):
    import torch
    sys.path.insert(0, ROOT)
    from vescale_engine import initialize
    from vescale_engine.shard.stats import STATS

    torch.set_num_threads(1)
    config, data, model = example_setup(args)
    if args.system == "Shampoo":
        config["optimizer"] = {"type": "Shampoo", "params": {
            "lr": args.shampoo_lr, "betas": [0.9, 0.99], "weight_decay": 0.1,
            "max_preconditioner_dim": args.block, "precondition_frequency": args.frequency}}
        # the example writes rows:1, which would cut Shampoo's blocks (an error): unset, the
        # engine picks Shampoo's own granularity (shampoo:B)
        config["vescale"].pop("granularity", None)
    engine, opt, _, _ = initialize(model=model, config=config)
    shard_elements = sum(p.numel() for p in engine.module.parameters())
    gen = torch.Generator().manual_seed(args.rank)
    micro = engine.train_micro_batch_size_per_gpu()
    losses, times, counts = [], [], None
    baseline = reset_peak()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (micro,), generator=gen)
        batch = torch.stack([data[s:s + args.seq + 1] for s in starts])
        STATS.reset()
        t0 = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        counts = (STATS.all_gathers, STATS.reduce_scatters, STATS.all_reduces)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / engine.world_size)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                      for t in s.values())
    torch.distributed.barrier()
    print(json.dumps({"rank": args.rank, "losses": losses, "state_bytes": state_bytes,
                      "step_s": statistics.median(times[min(2, len(times) - 1):]),
                      "peak_bytes": peak() - baseline, "collectives": counts,
                      "shard_elements": shard_elements}), flush=True)


def launch(system, args):
    results = run_ranks(__file__, system, args.world, [
        "--steps", str(args.steps), "--layers", str(args.layers), "--dim", str(args.dim),
        "--seq", str(args.seq), "--block", str(args.block), "--frequency", str(args.frequency),
        "--shampoo-lr", str(args.shampoo_lr)], timeout_s=7200)
    return {"losses": results[0]["losses"], "state_bytes": sum(r["state_bytes"] for r in results),
            "step_s": max(r["step_s"] for r in results),
            "peak_bytes": max(r["peak_bytes"] for r in results),
            "collectives": results[0]["collectives"],
            "shard_elements": max(r["shard_elements"] for r in results)}


def main():
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS, layers=4, dim=128, seq=128,
                              steps=300, timed=False)
    parser.add_argument("--block", type=int, default=1024, help="max_preconditioner_dim")
    parser.add_argument("--frequency", type=int, default=20, help="precondition_frequency")
    parser.add_argument("--shampoo-lr", type=float, default=2e-3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", help="the report's .md path (default benchmarks/results/; the "
                                      "PNG beside it)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.steps, args.layers, args.dim, args.seq, args.rounds = 20, 2, 64, 64, 1
    stem = "shampoo_smoke" if args.smoke else "shampoo"
    rounds = alternate(SYSTEMS, args.rounds, lambda s: launch(s, args),
                       lambda r: f"step {r['step_s']:.4f} s, loss {r['losses'][-1]:.4f}")
    runs = {s: rounds[s][-1] for s in SYSTEMS}  # losses are deterministic: any round
    step_s = {s: statistics.median(r["step_s"] for r in rounds[s]) for s in SYSTEMS}
    peak_b = {s: statistics.median(r["peak_bytes"] for r in rounds[s]) for s in SYSTEMS}
    report = args.out or os.path.join(HERE, "results", stem + ".md")
    png = report[:-3] + ".png"
    os.makedirs(os.path.dirname(png), exist_ok=True)
    loss_chart(runs, png, "example GPT on Tiny Shakespeare: AdamW vs Shampoo")
    final = {s: sum(r["losses"][-10:]) / len(r["losses"][-10:]) for s, r in runs.items()}
    lines = ["# Shampoo vs AdamW on the example GPT", "",
             f"Produced by `python benchmarks/shampoo.py {' '.join(sys.argv[1:])}` on "
             f"{cpu_model()} ({os.cpu_count()} cores; load average {_load()}): "
             f"examples/configs/vescale_default.json with only the optimizer changed, "
             f"{args.world} ranks on gloo, GPT {args.layers} layers width {args.dim} sequence "
             f"{args.seq}, {args.steps} steps, {args.rounds} alternated rounds; Shampoo B = "
             f"{args.block}, F = {args.frequency}, lr {args.shampoo_lr}; AdamW lr 2e-3.", ""]
    if args.smoke:
        lines += ["**Smoke run** (small model, 20 steps: checks that it runs; numbers are not "
                  "the result).", ""]
    lines += ["| optimizer | step time (s, median) | peak RSS growth (bytes, worst rank) | "
              "state bytes (all ranks) | collectives per step (AG, RS, AR) | shard elements "
              "per rank | final loss (last 10) |", "|---|---:|---:|---:|---|---:|---:|"]
    for s in SYSTEMS:
        r = runs[s]
        lines.append(f"| {s} | {step_s[s]:.4f} | {peak_b[s]:,.0f} | {r['state_bytes']:,} | "
                     f"{tuple(r['collectives'])} | {r['shard_elements']:,} | {final[s]:.4f} |")
    lines += ["", "- Bytes per step: each all-gather and reduce-scatter moves (W - 1) x the shard "
              "elements x the dtype size per rank, so equal collective counts and shard "
              "elements mean equal bytes; Shampoo's optimizer step itself sends nothing "
              "(tests/core/optim/test_shampoo.py counts it).",
              f"- Loss curves: `{os.path.relpath(png, ROOT)}`."]
    write_report(report, lines)


def _load() -> str:
    """The 1, 5 and 15 minute load averages now (a shared machine's noise, for the header)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
