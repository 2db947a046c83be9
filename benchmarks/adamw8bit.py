"""AdamW8bit vs fp32 AdamW on the example GPT (examples/train_gpt.py: char-level Tiny
Shakespeare, examples/configs/vescale_default.json): optimizer-state bytes, step time, and the
loss curves of both on one PNG.

Both runs use the example's config with only the optimizer type changed (same lr, betas, weight
decay, warm-up + cosine schedule, clipping, seed and batches). The final loss is the mean of the
last 10 steps; the target is AdamW8bit within 2% of fp32 AdamW, and state memory <= 0.3x.

    python benchmarks/adamw8bit.py               # the example's 300 steps on 2 ranks (the lead's)
    python benchmarks/adamw8bit.py --smoke       # 20 steps of a smaller model: a check it runs
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from ranks import (benchmark_parser, example_setup, loss_chart, run_ranks,  # noqa: E402
                   write_report)
SYSTEMS = ("AdamW", "AdamW8bit")


def worker(args):
    import torch
    sys.path.insert(0, ROOT)
    from vescale_engine import initialize

    torch.set_num_threads(1)
    config, data, model = example_setup(args)
    config["optimizer"]["type"] = args.system
    if args.system == "AdamW8bit":
        config["optimizer"]["params"]["block"] = args.block
    params = sum(p.numel() for p in model.parameters())  # before sharding replaces them
    engine, opt, _, _ = initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(args.rank)
    micro = engine.train_micro_batch_size_per_gpu()
    losses, times = [], []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (micro,), generator=gen)
        batch = torch.stack([data[s:s + args.seq + 1] for s in starts])
        t0 = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / engine.world_size)
    if args.system == "AdamW8bit":
        state_bytes = opt.state_bytes()
    else:
        state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                          for t in s.values())
    torch.distributed.barrier()
    print(json.dumps({"rank": args.rank, "losses": losses, "state_bytes": state_bytes,
                      "step_s": statistics.median(times[min(2, len(times) - 1):]),
                      "params": params}), flush=True)


def launch(system, args):
    results = run_ranks(__file__, system, args.world, [
        "--steps", str(args.steps), "--layers", str(args.layers), "--dim", str(args.dim),
        "--seq", str(args.seq), "--block", args.block], timeout_s=7200)
    return {"losses": results[0]["losses"], "state_bytes": sum(r["state_bytes"] for r in results),
            "step_s": max(r["step_s"] for r in results), "params": results[0]["params"]}


def main():
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS, layers=4, dim=128, seq=128,
                              steps=300, timed=False)
    parser.add_argument("--block", default="block:256", help="AdamW8bit quantization block")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.steps, args.layers, args.dim, args.seq = 20, 2, 64, 64
    stem = "adamw8bit_smoke" if args.smoke else "adamw8bit"
    runs = {system: launch(system, args) for system in SYSTEMS}
    png = os.path.join(HERE, "results", stem + ".png")
    os.makedirs(os.path.dirname(png), exist_ok=True)
    loss_chart(runs, png, "example GPT: fp32 AdamW vs block-wise 8-bit AdamW")
    final = {s: sum(r["losses"][-10:]) / len(r["losses"][-10:]) for s, r in runs.items()}
    gap = (final["AdamW8bit"] - final["AdamW"]) / final["AdamW"]
    ratio = runs["AdamW8bit"]["state_bytes"] / runs["AdamW"]["state_bytes"]
    lines = ["# AdamW8bit vs fp32 AdamW on the example GPT", "",
             f"Produced by `python benchmarks/adamw8bit.py {' '.join(sys.argv[1:])}`: "
             f"examples/configs/vescale_default.json with only the optimizer type changed, "
             f"{args.world} ranks on gloo, GPT {args.layers} layers width {args.dim} sequence "
             f"{args.seq} ({runs['AdamW']['params'] / 1e6:.2f}M parameters), {args.steps} steps, "
             f"AdamW8bit block {args.block}, dynamic map.", ""]
    if args.smoke:
        lines += ["**Smoke run** (small model, 20 steps: checks that it runs; numbers are not "
                  "the result).", ""]
    lines += ["| optimizer | state bytes (all ranks) | step time (s, median) | final loss "
              "(last 10 steps) |", "|---|---:|---:|---:|"]
    for s in SYSTEMS:
        lines.append(f"| {s} | {runs[s]['state_bytes']:,} | {runs[s]['step_s']:.4f} | "
                     f"{final[s]:.4f} |")
    lines += ["", f"- State memory AdamW8bit / AdamW: **{ratio:.3f}** (target <= 0.3: "
                  f"{'met' if ratio <= 0.3 else 'MISSED'}).",
              f"- Final loss gap: **{gap:+.2%}** (target within 2%: "
              f"{'met' if abs(gap) <= 0.02 else 'MISSED'}).",
              f"- Loss curves: `{os.path.relpath(png, ROOT)}`."]
    write_report(os.path.join(HERE, "results", stem + ".md"), lines)


if __name__ == "__main__":
    main()
