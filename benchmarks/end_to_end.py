"""End to end: vescale_engine.initialize vs PyTorch FSDP2 vs DeepSpeed ZeRO-3, 2 ranks on gloo.

The same GPT (examples/gpt_model.py), seed, data and config in all: micro-batch per rank,
gradient accumulation, global-norm clipping 1.0 and AdamW (lr 1e-3, betas 0.9/0.95, weight decay
0.1). veScale Engine runs through `initialize` twice, with examples/configs/vescale_default.json's
"vescale" section (each Block a unit, rows:1) and either that file's zero_optimization section
(units reshard after forward, as FSDP2 does: compared with FSDP2) or the zero_optimization
section DeepSpeed gets (compared with DeepSpeed). FSDP2 is `fully_shard` per block and on the
root, torch AdamW and torch's clipping. DeepSpeed runs `deepspeed.initialize` with the
zero_optimization section of examples/configs/deepspeed_zero3.json unchanged and
`torch_adam: true` (torch's AdamW: the same update as the others, so the losses can be compared,
and no JIT-built CPU op). Each run is fresh processes; systems are alternated round by round and
medians reported. A step is one optimizer step (all its micro-batches). Bytes sent per step are
read from the loopback interface's counter (every rank's traffic, /proc/net/dev), so they count
what each system really moves, whatever its collectives are called.

    python benchmarks/end_to_end.py            # writes benchmarks/results/end_to_end.{md,png}
    python benchmarks/end_to_end.py --small --rounds 1 --steps 2   # a quick smoke run

The glibc heap matters on CPU (see benchmarks/results/fsdp_step_time_mmap.md): a run with
MALLOC_MMAP_THRESHOLD_ set records it in the results' command line.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from ranks import (alternate, benchmark_parser, command_line, cpu_model, rss,  # noqa: E402
                   run_ranks, write_report)

SYSTEMS = ("vescale", "vescale_zero3", "fsdp2", "deepspeed")
LABELS = {"vescale": "veScale Engine, vescale_default.json", "fsdp2": "PyTorch FSDP2",
          "vescale_zero3": "veScale Engine, DeepSpeed's zero_optimization",
          "deepspeed": "DeepSpeed ZeRO-3"}
CHART_NAMES = {"vescale": "veScale\n(vescale_default)", "vescale_zero3": "veScale\n(ZeRO-3 config)",
               "fsdp2": "PyTorch FSDP2", "deepspeed": "DeepSpeed ZeRO-3"}
OURS = ("vescale", "vescale_zero3")
# step time targets, ours / theirs, each against our run with the same zero_optimization
TARGETS = {"fsdp2": ("vescale", 0.92), "deepspeed": ("vescale_zero3", 0.85)}
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                         "weight_decay": 0.1}}
CLIP = 1.0
LOSS_TOLERANCE = 1e-5
SMALL = dict(layers=2, dim=128, seq=64, batch=2)


def _config(system, args) -> dict:
    """The shared DeepSpeed-style config, with each engine's own section from examples/."""
    def example(name):
        with open(os.path.join(ROOT, "examples", "configs", name)) as f:
            return json.load(f)
    config = {"train_micro_batch_size_per_gpu": args.batch,
              "gradient_accumulation_steps": args.accum, "gradient_clipping": CLIP,
              "steps_per_print": 10 ** 6, "optimizer": json.loads(json.dumps(OPTIMIZER))}
    zero3 = example("deepspeed_zero3.json")["zero_optimization"]
    if system in OURS:
        default = example("vescale_default.json")
        config.update(zero_optimization=default["zero_optimization"] if system == "vescale"
                      else zero3, vescale=default["vescale"])
    else:
        config["zero_optimization"] = zero3
        config["optimizer"]["params"]["torch_adam"] = True
    return config


def _loopback_bytes() -> int | None:
    """Bytes sent so far over the loopback interface (every local process's traffic)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])  # transmit bytes
    except OSError:
        pass
    return None


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)
    if args.system == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    elif args.system in OURS:
        from vescale_engine import initialize  # the engine's modules load here, not lazily
    else:
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
    rss_start = rss() / 2 ** 20  # MiB, after imports, before the model
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.dim, n_head=max(1, args.dim // 64),
                    block_size=args.seq)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    persistent = 0.0
    gathered = [None]  # DeepSpeed: share of the parameters still gathered after forward
    config = _config(args.system, args)
    if args.system == "deepspeed":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        # Parameters under stage3_param_persistence_threshold elements stay whole on every rank.
        persistent = sum(p.ds_numel for p in engine.module.parameters()
                         if getattr(p, "ds_persist", False)) / params
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        def note_gathered(module, inputs, output):  # runs after DeepSpeed's own release hook
            gathered[0] = sum(p.ds_numel for p in module.parameters()
                              if p.ds_status == ZeroParamStatus.AVAILABLE) / params
        engine.module.register_forward_hook(note_gathered)
    elif args.system in OURS:
        engine, *_ = initialize(model=model, config=config)
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), **OPTIMIZER["params"])

    def fsdp2_step(batches):
        losses = []
        for k, idx in enumerate(batches):
            model.set_requires_gradient_sync(k == len(batches) - 1)  # accumulate locally
            loss = model(idx[:, :-1], idx[:, 1:])
            (loss / len(batches)).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return losses

    def engine_step(batches):
        losses = []
        for idx in batches:
            loss = engine(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        return losses

    train_step = fsdp2_step if args.system == "fsdp2" else engine_step
    gen = torch.Generator().manual_seed(1 + args.rank)  # each rank its own data
    times, losses, sent = [], [], []
    for step in range(args.warmup + args.steps):
        batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
                   for _ in range(args.accum)]
        b0 = _loopback_bytes()
        t0 = time.perf_counter()
        micro = train_step(batches)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            b1 = _loopback_bytes()
            if b0 is not None and b1 is not None:
                sent.append(b1 - b0)
        losses.append(float(torch.stack(micro).mean()))
    dist.barrier()
    dist.destroy_process_group()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rank": args.rank, "step_s": statistics.median(times), "rss_mb": rss_mb,
                      "rss_start_mb": rss_start, "losses": losses, "params": params,
                      "persistent": persistent, "gathered_after_forward": gathered[0],
                      "sent_mb": statistics.median(sent) / 2 ** 20 if sent else None}),
          flush=True)


def launch(system, args):
    """One run: `args.world` fresh ranks with torchrun's environment (which DeepSpeed and our
    launcher discovery both read)."""
    flags = ["--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq),
             "--batch", str(args.batch), "--accum", str(args.accum), "--steps",
             str(args.steps), "--warmup", str(args.warmup)]
    results = run_ranks(__file__, system, args.world, flags)
    return {"step_s": max(r["step_s"] for r in results),
            "rss_mb": max(r["rss_mb"] for r in results),
            "rss_start_mb": max(r["rss_start_mb"] for r in results),
            "losses": results[0]["losses"], "params": results[0]["params"],
            "persistent": results[0]["persistent"], "sent_mb": results[0]["sent_mb"],
            "gathered_after_forward": results[0]["gathered_after_forward"]}


def _chart(med, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = ["#1f77b4", "#aec7e8", "#7f7f7f", "#ff7f0e"]
    for ax, key, title in ((axes[0], "step_s", "median step time (s)"),
                           (axes[1], "rss_mb", "peak RSS per rank (MB)")):
        values = [med[s][key] for s in SYSTEMS]
        bars = ax.bar(range(len(SYSTEMS)), values, color=colors)
        ax.bar_label(bars, fmt="%.3f" if key == "step_s" else "%.0f")
        ax.set_xticks(range(len(SYSTEMS)), [CHART_NAMES[s] for s in SYSTEMS], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _report(runs, args, chart_name):
    med = {s: {k: statistics.median(x[k] for x in runs[s])
               for k in ("step_s", "rss_mb", "rss_start_mb")} for s in SYSTEMS}
    first = {s: runs[s][0]["losses"] for s in SYSTEMS}
    gaps = {s: max(abs(a - b) / abs(b) for a, b in zip(first[s], first["vescale"]))
            for s in SYSTEMS if s != "vescale"}
    cmd = command_line(__file__, env_keys=("MALLOC_MMAP_THRESHOLD_",))
    import torch
    try:
        import deepspeed
        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = "not installed"

    def sent(s):
        values = [x["sent_mb"] for x in runs[s] if x["sent_mb"] is not None]
        return f"{statistics.median(values):.0f}" if values else "n/a"

    lines = [
        "# End to end: veScale Engine vs PyTorch FSDP2 vs DeepSpeed ZeRO-3", "",
        f"Produced by `{cmd}` on {os.cpu_count()} cores of {cpu_model()} (torch {torch.__version__},"
        f" DeepSpeed {ds_version}), {args.world} ranks on gloo, OMP_NUM_THREADS=1 per rank. GPT "
        f"with {runs['vescale'][0]['params'] / 1e6:.1f}M parameters ({args.layers} layers, "
        f"width {args.dim}, sequence {args.seq}), micro-batch {args.batch} per rank, gradient "
        f"accumulation {args.accum}, clipping {CLIP}, fp32 AdamW (torch's in FSDP2 and "
        f"DeepSpeed, ours in veScale). Step = one optimizer step; median over {args.rounds} "
        f"alternated rounds of each run's median ({args.steps} steps after {args.warmup} "
        "warm-up). Peak RSS: the larger rank's ru_maxrss; RSS at start: after imports, before "
        "the model is built (DeepSpeed's import costs memory too). Sent per step: bytes through "
        "the loopback interface during a step, all ranks together.", "",
        "veScale runs twice, with the same \"vescale\" section (examples/configs/"
        "vescale_default.json): once with that file's zero_optimization (units reshard after "
        "forward, as FSDP2's do), once with the zero_optimization section DeepSpeed gets "
        "(examples/configs/deepspeed_zero3.json, whose stage3_max_reuse_distance keeps our "
        "units gathered from forward into backward; DeepSpeed keeps its parameters gathered "
        "too, see below and the bytes sent). Each target compares the run with the same "
        "zero_optimization section.", ""]
    if args.small or args.rounds < 3:
        lines += ["**Smoke run** (tiny model or a single round): it shows the script works, "
                  "not how the systems compare; run the command without --small for that.", ""]
    lines += [
        "| system | step time (s) | peak RSS per rank (MB) | RSS at start (MB) | "
        "sent per step (MB) |",
        "|---|---:|---:|---:|---:|"]
    for s in SYSTEMS:
        lines.append(f"| {LABELS[s]} | {med[s]['step_s']:.3f} | {med[s]['rss_mb']:.0f} | "
                     f"{med[s]['rss_start_mb']:.0f} | {sent(s)} |")
    lines.append("")
    for s, (ours, target) in TARGETS.items():
        ratio = med[ours]["step_s"] / med[s]["step_s"]
        lines.append(f"- Step time {LABELS[ours]} / {LABELS[s]}: **{ratio:.3f}** (target <= "
                     f"{target}: {'met' if ratio <= target else 'MISSED'}).")
    for ours in OURS:
        mem_ok = med[ours]["rss_mb"] <= med["fsdp2"]["rss_mb"]
        lines.append(f"- Peak memory {LABELS[ours]} <= FSDP2: {'met' if mem_ok else 'MISSED'} "
                     f"({med[ours]['rss_mb']:.0f} vs {med['fsdp2']['rss_mb']:.0f} MB).")
    lines += [f"- Losses agree (fp32 round-off, <= {LOSS_TOLERANCE:g} relative): "
              f"{'yes' if max(gaps.values()) <= LOSS_TOLERANCE else 'NO'}; largest relative "
              f"difference from {LABELS['vescale']}'s over the first round's "
              f"{len(first['vescale'])} steps (rank 0's micro-batch mean): " + ", ".join(
                  f"{LABELS[s]} {gaps[s]:.1e}" for s in gaps) + ".",
              f"- DeepSpeed kept {runs['deepspeed'][0]['persistent']:.0%} of the parameters "
              "whole on every rank (tensors under the example config's "
              "stage3_param_persistence_threshold); veScale and FSDP2 shard all of them. After "
              "the last forward of each DeepSpeed run, "
              + "/".join(f"{x['gathered_after_forward']:.0%}" for x in runs["deepspeed"])
              + " of its parameters were still gathered (a forward hook on the model, after "
              "DeepSpeed's own).", "",
              "Runs, step time in s (run order): " + "; ".join(
                  f"{s}: " + "/".join(f"{x['step_s']:.3f}" for x in runs[s]) for s in SYSTEMS),
              "", f"![step time and peak memory]({chart_name})"]
    return lines, med


def main():
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS, layers=8, dim=512, seq=256,
                              steps=8)
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--small", action="store_true",
                        help="a tiny model for a smoke run: " +
                             ", ".join(f"--{k} {v}" for k, v in SMALL.items()))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "end_to_end.md"),
                        help="Markdown file; the chart goes beside it as .png")
    args = parser.parse_args()
    if args.small:
        for key, value in SMALL.items():
            setattr(args, key, value)
    if args.worker:
        return worker(args)

    runs = alternate(SYSTEMS, args.rounds, lambda system: launch(system, args),
                     lambda run: f"step {run['step_s']:.3f} s, peak RSS {run['rss_mb']:.0f} MB")
    chart = os.path.splitext(args.out)[0] + ".png"
    lines, med = _report(runs, args, os.path.basename(chart))
    write_report(args.out, lines)
    _chart(med, chart)


if __name__ == "__main__":
    main()
