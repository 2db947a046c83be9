"""Step time with and without compile: veScale Engine's engine.compile() vs its eager step, and
PyTorch FSDP2 with each block compiled (torchtitan's way) vs FSDP2 eager, 2 ranks on gloo (or
`--device cuda --world 1`: one GPU, NCCL, as the GPU check runs it).

The same GPT (examples/gpt_model.py), seed, data and AdamW in all. Ours: `initialize` with one
unit per Block, then `engine.compile(backend="inductor")` (each innermost unit's forward
compiled, the hooks eager). FSDP2: `block.compile(backend="inductor")` on each Block, then
`fully_shard` per block and on the root. Compilation happens in the warm-up steps (not timed);
systems alternate round by round; medians of the slowest rank.

    python benchmarks/compile_step.py          # writes benchmarks/results/compile_step.md
    python benchmarks/compile_step.py --layers 2 --dim 128 --seq 64 --rounds 1 --steps 2
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from ranks import (alternate, benchmark_parser, command_line, cpu_model, run_ranks,  # noqa: E402
                   write_report)

SYSTEMS = ("vescale", "vescale_compiled", "fsdp2", "fsdp2_compiled")
LABELS = {"vescale": "veScale Engine, eager", "vescale_compiled": "veScale Engine, engine.compile()",
          "fsdp2": "PyTorch FSDP2, eager", "fsdp2_compiled": "PyTorch FSDP2, blocks compiled"}


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(args.rank)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.dim, n_head=max(1, args.dim // 64),
                    block_size=args.seq)
    model = GPT(cfg)
    compiled = args.system.endswith("_compiled")
    if args.system.startswith("vescale"):
        from vescale_engine import initialize
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 0.0,
                  "steps_per_print": 10 ** 6,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}
        engine, *_ = initialize(model=model, config=config)
        if compiled:
            engine.compile(backend="inductor")

        def step(idx):
            loss = engine(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss
    else:
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("nccl" if cuda else "gloo")
        model.to(args.device)
        for block in model.blocks:
            if compiled:
                block.compile(backend="inductor")
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

        def step(idx):
            loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
    gen = torch.Generator().manual_seed(1 + args.rank)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1),
                            generator=gen).to(args.device)
        start = time.perf_counter()
        loss = step(idx)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    print(json.dumps({"rank": args.rank, "step_s": statistics.median(times),
                      "losses": losses}), flush=True)


def launch(system, args):
    flags = [f"--{k}={getattr(args, k)}" for k in
             ("world", "layers", "dim", "seq", "batch", "steps", "warmup", "device")]
    results = run_ranks(__file__, system, args.world, flags, timeout_s=1800,
                        device=args.device)
    return {"step_s": max(r["step_s"] for r in results), "losses": results[0]["losses"]}


def main():
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS, layers=4, dim=256, seq=128,
                              steps=8)
    parser.set_defaults(warmup=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "compile_step.md"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    runs = alternate(SYSTEMS, args.rounds, lambda system: launch(system, args),
                     lambda run: f"step {run['step_s']:.4f} s")
    med = {s: statistics.median(r["step_s"] for r in runs[s]) for s in SYSTEMS}
    ours = med["vescale_compiled"] / med["vescale"]
    against = med["vescale_compiled"] / med["fsdp2_compiled"]
    gap = max(abs(a - b) for a, b in zip(runs["vescale_compiled"][0]["losses"],
                                         runs["vescale"][0]["losses"]))
    lines = ["# Step time with and without compile: veScale Engine vs PyTorch FSDP2", "",
             f"Produced by `{command_line(__file__)}` on {cpu_model()}, {args.world} ranks on "
             f"{'NCCL, one GPU each' if args.device == 'cuda' else 'gloo'}, "
             f"OMP_NUM_THREADS=1 per rank; GPT of {args.layers} layers, width {args.dim}, "
             f"sequence {args.seq}, micro-batch {args.batch} per rank, fp32, AdamW, inductor; "
             f"median over {args.rounds} alternated rounds of the per-run median step "
             f"({args.steps} steps after {args.warmup} warm-up steps, which compile).", "",
             "| system | step time (s) |", "|---|---:|"]
    lines += [f"| {LABELS[s]} | {med[s]:.4f} |" for s in SYSTEMS]
    lines += ["",
              f"- Ours compiled / ours eager: **{ours:.3f}** (target <= 0.9: "
              f"{'met' if ours <= 0.9 else 'missed'}).",
              f"- Ours compiled / FSDP2 compiled: **{against:.3f}** (target <= 1: "
              f"{'met' if against <= 1 else 'missed'}).",
              f"- FSDP2 compiled / FSDP2 eager: {med['fsdp2_compiled'] / med['fsdp2']:.3f}.",
              f"- Largest loss difference, ours compiled vs eager: {gap:.2e}."]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
