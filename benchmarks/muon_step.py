"""Muon step time and bytes communicated per step: vescale_engine vs DeepSpeed ZeRO-3 with its
Muon optimizer (deepspeed 0.19's `"optimizer": {"type": "Muon"}`), on gloo.

Same GPT (examples/gpt_model.py), seed and data; both through their engine with the same
DeepSpeed-style config except each engine's own section. Ours runs in both modes: `gather`
(each matrix gathered on a load-balanced root, Newton-Schulz there, scattered back) and
`tensor` (the planner keeps every matrix whole on one rank: no optimizer communication).
DeepSpeed ZeRO-3 + Muon needs `reduce_scatter: false`: it all-reduces full gradients and
all-gathers them again for Newton-Schulz, round-robin over ranks.

Which parameters get Muon is made the same on both sides: DeepSpeed applies Muon to every 2-D
parameter whose name lacks "embed"/"lm_head" (so the GPT's wte/wpe too), and our adamw_patterns
are set to match. Both run the same Newton-Schulz: torch.optim.Muon's quintic iteration in bf16
(DeepSpeed's `ns_method: "standard"`; its default `"gram"` is a different, cheaper algorithm
for very rectangular matrices (Gram Newton-Schulz), which would compare algorithms rather than
how the matrices are distributed).

Bytes are counted by wrapping torch.distributed's collectives before either engine is imported:
what one rank sends under the usual algorithms (ring all-gather/reduce-scatter (w-1)/w of the
full buffer, all-reduce twice that, all-to-all everything not addressed to itself, broadcast
the buffer from the source, a point-to-point send its tensor: on gloo vescale_engine's
all-gather and reduce-scatter are such sends). Reported per rank, median over steps.

    python benchmarks/muon_step.py                  # full run (the lead's)
    python benchmarks/muon_step.py --smoke          # tiny model, few steps: a check that it runs
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from ranks import alternate, benchmark_parser, run_ranks, write_report  # noqa: E402
SYSTEMS = ("vescale-gather", "vescale-tensor", "deepspeed")
LABELS = {"vescale-gather": "vescale_engine Muon (gather mode)",
          "vescale-tensor": "vescale_engine Muon (tensor mode)",
          "deepspeed": "DeepSpeed ZeRO-3 + Muon"}
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
TARGET = 1.3  # DeepSpeed step time / ours


class ByteCounter:
    """Wraps torch.distributed's collectives (both namespaces engines call them through) and
    adds up what this rank sends."""

    def __init__(self):
        self.sent = 0

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        def nbytes(t):
            return t.numel() * t.element_size()

        def world(kwargs, args, position):
            group = kwargs.get("group", args[position] if len(args) > position else None)
            return dist.get_world_size(group)

        rules = {  # name -> (bytes sent by this rank, from args and kwargs)
            "all_gather_into_tensor": lambda a, k: nbytes(a[1] if len(a) > 1 else k["input_tensor"])
            * (world(k, a, 2) - 1),
            "all_gather_single": lambda a, k: nbytes(a[1]) * (world(k, a, 2) - 1),
            "_all_gather_base": lambda a, k: nbytes(a[1] if len(a) > 1 else k["input_tensor"])
            * (world(k, a, 2) - 1),
            "all_gather": lambda a, k: nbytes(a[1] if len(a) > 1 else k["tensor"])
            * (world(k, a, 2) - 1),
            "reduce_scatter_tensor": lambda a, k: _rs(nbytes(a[1] if len(a) > 1 else k["input"]),
                                                      world(k, a, 3)),
            "reduce_scatter_single": lambda a, k: _rs(nbytes(a[1]), world(k, a, 3)),
            "_reduce_scatter_base": lambda a, k: _rs(nbytes(a[1] if len(a) > 1 else k["input"]),
                                                     world(k, a, 3)),
            "all_reduce": lambda a, k: 2 * _rs(nbytes(a[0] if a else k["tensor"]),
                                               world(k, a, 2)),
            "broadcast": lambda a, k: nbytes(a[0] if a else k["tensor"]),
            "all_to_all_single": _all_to_all_bytes,
            # point-to-point: what vescale_engine's gloo all-gather/reduce-scatter post
            "isend": lambda a, k: nbytes(a[0] if a else k["tensor"]),
            "send": lambda a, k: nbytes(a[0] if a else k["tensor"]),
        }
        for name, rule in rules.items():
            for module in (dist, c10d):
                original = getattr(module, name, None)
                if original is not None and not hasattr(original, "_counted"):
                    setattr(module, name, self._wrap(original, rule))

    def _wrap(self, fn, rule):
        def counted(*args, **kwargs):
            self.sent += int(rule(args, kwargs))
            return fn(*args, **kwargs)
        counted._counted = True
        return counted


def _rs(total_bytes, world):
    return total_bytes * (world - 1) // world


def _all_to_all_bytes(args, kwargs):
    import torch.distributed as dist
    source = args[1] if len(args) > 1 else kwargs["input"]
    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
    group = kwargs.get("group")
    row = source.numel() // max(1, source.shape[0]) if source.dim() else 1
    total = source.numel() * source.element_size()
    if not splits:
        return total * (dist.get_world_size(group) - 1) // dist.get_world_size(group)
    return total - splits[dist.get_rank(group)] * row * source.element_size()


def _config(system, args) -> dict:
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 6, "gradient_clipping": 1.0}
    if system == "deepspeed":
        config["optimizer"] = {"type": "Muon", "params": dict(MUON, betas=[0.9, 0.95],
                                                              eps=1e-8, ns_method="standard")}
        config["zero_optimization"] = {"stage": 3, "reduce_scatter": False,
                                       "overlap_comm": False, "contiguous_gradients": True,
                                       "stage3_param_persistence_threshold": 0}
    else:
        config["optimizer"] = {"type": "Muon", "params": dict(
            MUON, ns_dtype="bf16", mode=system.split("-")[1], adamw_betas=[0.9, 0.95],
            adamw_patterns=["*norm*", "ln*", "*bias", "lm_head.*"])}
        config["zero_optimization"] = {"stage": 3}
        config["vescale"] = {"wrap_policy": {"module_classes": ["Block"]},
                             "granularity": {"default": "rows:1"}}
    return config


def worker(args):
    import torch
    counter = ByteCounter()
    counter.install()  # before the engines import (and keep references to) the collectives
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)
    if args.system == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        from vescale_engine import initialize
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_embd=args.dim,
                    n_head=max(1, args.dim // 64), block_size=args.seq)
    model = GPT(cfg)
    config = _config(args.system, args)
    if args.system == "deepspeed":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
    else:
        engine, *_ = initialize(model=model, config=config)
    padding = None
    if args.system != "deepspeed":
        from vescale_engine.fsdp import sharded_parameters
        buffers = {id(sp.buffer): sp.buffer for _, sp in sharded_parameters(engine.module)}
        padding = sum(b.layout.padding for b in buffers.values()) / \
            sum(b.layout.numel for b in buffers.values())
    gen = torch.Generator().manual_seed(1 + args.rank)
    times, opt_times, step_bytes, opt_bytes, losses = [], [], [], [], []
    for step in range(args.warmup + args.steps):
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        before = counter.sent
        t0 = time.perf_counter()
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        t1, mid = time.perf_counter(), counter.sent
        engine.step()
        t2 = time.perf_counter()
        if step >= args.warmup:
            times.append(t2 - t0)
            opt_times.append(t2 - t1)
            step_bytes.append(counter.sent - before)
            opt_bytes.append(counter.sent - mid)
        losses.append(loss.item())
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": args.rank, "step_s": statistics.median(times),
                      "opt_s": statistics.median(opt_times),
                      "step_bytes": statistics.median(step_bytes),
                      "opt_bytes": statistics.median(opt_bytes), "losses": losses,
                      "padding": padding, "params": sum(p.numel() for p in GPT(cfg).parameters())}),
          flush=True)


def launch(system, world, args):
    flags = ["--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq),
             "--batch", str(args.batch), "--vocab", str(args.vocab), "--steps", str(args.steps),
             "--warmup", str(args.warmup)]
    results = run_ranks(__file__, system, world, flags)
    return {"step_s": max(r["step_s"] for r in results),
            "opt_s": max(r["opt_s"] for r in results),
            "step_bytes": statistics.mean(r["step_bytes"] for r in results),
            "opt_bytes": statistics.mean(r["opt_bytes"] for r in results),
            "losses": results[0]["losses"], "padding": results[0]["padding"],
            "params": results[0]["params"]}


def main():
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS, layers=4, dim=256, seq=128,
                              steps=8, one_world=False)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, 2 steps, 1 round (checks that everything runs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.layers, args.dim, args.seq, args.vocab = 2, 64, 32, 512
        args.batch, args.steps, args.warmup, args.rounds = 2, 2, 1, 1
    name = "muon_step_smoke.md" if args.smoke else "muon_step.md"
    args.out = args.out or os.path.join(HERE, "results", name)
    worlds = [int(w) for w in args.worlds.split(",")]
    lines = ["# Muon: step time and bytes per step, vescale_engine vs DeepSpeed ZeRO-3 + Muon", "",
             f"Produced by `python benchmarks/muon_step.py {' '.join(sys.argv[1:])}` on this "
             f"machine's CPUs (gloo, OMP_NUM_THREADS=1 per rank). GPT {args.layers} layers, width "
             f"{args.dim}, sequence {args.seq}, vocabulary {args.vocab}, micro-batch "
             f"{args.batch} per rank, fp32; Muon lr {MUON['lr']}, momentum {MUON['momentum']}, "
             f"Newton-Schulz in bf16 on both; median over {args.rounds} alternated round(s) of the "
             f"per-run median ({args.steps} steps after {args.warmup} warm-up). Bytes: what one "
             "rank sends (see the script's docstring for the rules).", ""]
    if args.smoke:
        lines += ["**Smoke run** (tiny model, too few steps for the timings to mean anything).",
                  ""]
    lines += ["| ranks | system | step (s) | engine.step (s) | MB sent per step | of which "
              "optimizer step | padding |", "|---:|---|---:|---:|---:|---:|---:|"]
    summary = []
    for world in worlds:
        runs = alternate(SYSTEMS, args.rounds, lambda system: launch(system, world, args),
                         lambda run: f"step {run['step_s']:.3f} s, "
                                     f"{run['step_bytes'] / 1e6:.2f} MB", f"{world} ranks, ")
        med = {s: {k: statistics.median(x[k] for x in runs[s])
                   for k in ("step_s", "opt_s", "step_bytes", "opt_bytes")} for s in SYSTEMS}
        for s in SYSTEMS:
            pad = runs[s][0]["padding"]
            lines.append(f"| {world} | {LABELS[s]} | {med[s]['step_s']:.3f} | "
                         f"{med[s]['opt_s']:.3f} | {med[s]['step_bytes'] / 1e6:.2f} | "
                         f"{med[s]['opt_bytes'] / 1e6:.2f} | "
                         f"{'n/a' if pad is None else f'{pad:.1%}'} |")
        best = min(med["vescale-gather"]["step_s"], med["vescale-tensor"]["step_s"])
        speedup = med["deepspeed"]["step_s"] / best
        summary.append(f"- {world} ranks: DeepSpeed step / our best mode = **{speedup:.2f}x** "
                       f"(target >= {TARGET}: {'met' if speedup >= TARGET else 'MISSED'}); "
                       f"gather mode {med['deepspeed']['step_s'] / med['vescale-gather']['step_s']:.2f}x, "
                       f"tensor mode {med['deepspeed']['step_s'] / med['vescale-tensor']['step_s']:.2f}x; "
                       f"engine.step alone (clipping + optimizer): DeepSpeed / ours = "
                       f"{med['deepspeed']['opt_s'] / med['vescale-gather']['opt_s']:.2f}x gather, "
                       f"{med['deepspeed']['opt_s'] / med['vescale-tensor']['opt_s']:.2f}x tensor; "
                       f"bytes per step ours (gather) / DeepSpeed = "
                       f"{med['vescale-gather']['step_bytes'] / max(1, med['deepspeed']['step_bytes']):.2f}.")
    lines += ["", *summary]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
