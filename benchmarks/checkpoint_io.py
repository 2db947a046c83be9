"""Checkpoint save/load time and bytes written: vescale_engine vs DeepSpeed ZeRO-3, 2 ranks, gloo
(or `--device cuda --world 1`: one GPU, NCCL, as the GPU check runs it).

The example model (examples/gpt_model.py, default GPTConfig) and config
(examples/configs/vescale_default.json; DeepSpeed gets the same JSON without the "vescale" key
and with torch's AdamW). Each system trains one step (so optimizer state exists), then saves
`--repeats` times (a new tag each time) and loads the last one `--repeats` times into a fresh
engine. Reported: median seconds (slowest rank) and bytes on disk per checkpoint.

veScale Engine runs twice: with synchronous saves and with background saves ("checkpoint":
{"writer": {"decoupled": true}}). For both, the stall (how long `save_checkpoint` keeps the
training loop: every rank's call, the slowest) and the end-to-end time of `--steps` training
steps with a save every `--every` steps against the same steps without saves, alternated
`--e2e-rounds` times (a background save's write overlaps the steps after it; on CPU its thread
shares the cores the ranks compute on).

    python benchmarks/checkpoint_io.py            # writes benchmarks/results/checkpoint_io.md
    python benchmarks/checkpoint_io.py --smoke    # tiny model, writes checkpoint_io_smoke.md
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from ranks import add_worker_flags, command_line, cpu_model, run_ranks, write_report  # noqa: E402
CONFIG = os.path.join(ROOT, "examples", "configs", "vescale_default.json")
SYSTEMS = ("vescale", "vescale_async", "deepspeed")
LABELS = {"vescale": "vescale (synchronous)", "vescale_async": "vescale (background)",
          "deepspeed": "deepspeed"}


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(args.rank)
    with open(CONFIG) as f:
        config = json.load(f)
    config["train_micro_batch_size_per_gpu"] = 2
    # the example config leaves the schedule's length to its script ("auto")
    config["scheduler"]["params"].update(total_num_steps=100, warmup_num_steps=10)
    cfg = GPTConfig(**({"vocab_size": 512, "block_size": 32, "n_layer": 2, "n_embd": 128,
                        "n_head": 2} if args.smoke else {}))

    def make():
        torch.manual_seed(0)
        model = GPT(cfg)
        if args.system.startswith("vescale"):
            import vescale_engine
            ours = dict(config)
            if args.system == "vescale_async":
                ours["checkpoint"] = {"writer": {"decoupled": True}}
            return vescale_engine.initialize(model=model, config=ours)[0]
        import deepspeed
        ds = {k: v for k, v in config.items() if k != "vescale"}
        ds["optimizer"] = {"type": "AdamW", "params": {**config["optimizer"]["params"],
                                                       "torch_adam": True}}
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                    config=ds)[0]

    engine = make()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size),
                        generator=torch.Generator().manual_seed(dist.get_rank())).to(args.device)

    def step():
        logits_or_loss = engine(idx, idx)
        loss = logits_or_loss[1] if isinstance(logits_or_loss, tuple) else logits_or_loss
        engine.backward(loss)
        engine.step()

    step()
    params = sum(p.numel() for p in GPT(cfg).parameters())  # the engines hold shards

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        took = torch.tensor(time.perf_counter() - start, device=args.device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took.item()

    ours = args.system.startswith("vescale")
    wait = engine.wait_for_checkpoint if ours else (lambda: None)
    saves, sizes = [], []
    for i in range(args.repeats):
        tag = f"bench{i}"
        saves.append(timed(lambda: engine.save_checkpoint(args.dir, tag=tag)))
        wait()  # the stall of one save, not of the one before it
        sizes.append(_dir_bytes(os.path.join(args.dir, tag)))
    runs = {False: [], True: []}
    if ours:  # --steps steps without saves and with a save every --every steps, alternated
        for _ in range(args.e2e_rounds):
            for with_saves in (False, True):
                def train():
                    for i in range(1, args.steps + 1):
                        step()
                        if with_saves and i % args.every == 0:
                            engine.save_checkpoint(args.dir, tag=f"run{i}")
                    wait()  # the last write counts
                runs[with_saves].append(timed(train))
    runs = {k: statistics.median(v) if v else None for k, v in runs.items()}
    fresh = make()
    loads = [timed(lambda: fresh.load_checkpoint(args.dir, tag=f"bench{args.repeats - 1}"))
             for _ in range(args.repeats)]
    # every rank reports (run_ranks wants a line from each); the times are the slowest rank's
    print(json.dumps({"system": args.system, "params": params,
                      "save_s": statistics.median(saves), "load_s": statistics.median(loads),
                      "bytes": statistics.median(sizes), "steps_s": runs.get(False),
                      "steps_with_saves_s": runs.get(True)}), flush=True)


def run_system(system, args):
    """One system's 2 ranks (fresh processes) over a scratch directory; rank 0's report."""
    scratch = tempfile.mkdtemp(prefix=f"ckpt-bench-{system}-")
    try:
        flags = ["--dir", scratch, "--repeats", str(args.repeats), "--steps", str(args.steps),
                 "--every", str(args.every), "--e2e-rounds", str(args.e2e_rounds)] + \
            (["--smoke"] if args.smoke else [])
        flags += ["--device", args.device, "--world", str(args.world)]
        return run_ranks(__file__, system, args.world, flags, device=args.device)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, quick check")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps of the end-to-end runs")
    parser.add_argument("--every", type=int, default=5, help="a save every N of those steps")
    parser.add_argument("--e2e-rounds", type=int, default=3,
                        help="end-to-end runs without and with saves, alternated (medians)")
    parser.add_argument("--out", default=None, help="markdown output path")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2, help="ranks (one GPU each on cuda)")
    add_worker_flags(parser, SYSTEMS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = [run_system(s, args) for s in SYSTEMS]
    out = args.out or os.path.join(HERE, "results", "checkpoint_io_smoke.md" if args.smoke
                                   else "checkpoint_io.md")
    command = command_line(__file__)
    where = "NCCL, GPU" if args.device == "cuda" else "gloo, CPU"
    lines = [f"# Checkpoint save/load, {args.world} ranks ({where})"
             f"{' — smoke run' if args.smoke else ''}",
             "", f"Command: `{command}`  ", f"CPU: {cpu_model()}", "",
             f"Model: examples/gpt_model.py ({results[0]['params']:,} parameters), config "
             "examples/configs/vescale_default.json; one training step, then "
             f"{args.repeats} saves and {args.repeats} loads; medians, slowest rank.", "",
             "| system | save: stall (s) | load (s) | bytes on disk |", "|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {LABELS[r['system']]} | {r['save_s']:.3f} | {r['load_s']:.3f} | "
                     f"{int(r['bytes']):,} |")
    by = {r["system"]: r for r in results}
    sync, back = by["vescale"], by["vescale_async"]
    lines += ["", f"End to end: {args.steps} steps, a save every {args.every} steps, against "
              f"the same steps without saves, {args.e2e_rounds} runs of each alternated "
              "(medians; seconds, slowest rank):", "",
              "| saves | without saves | with saves | ratio |", "|---|---:|---:|---:|"]
    for r in (sync, back):
        lines.append(f"| {LABELS[r['system']]} | {r['steps_s']:.2f} | "
                     f"{r['steps_with_saves_s']:.2f} | "
                     f"{r['steps_with_saves_s'] / r['steps_s']:.3f}x |")
    lines += ["", f"Background / synchronous stall: {back['save_s'] / sync['save_s']:.3f}x "
              "(target <= 0.1x); end to end with saves, background: "
              f"{back['steps_with_saves_s'] / back['steps_s']:.3f}x the run without saves "
              "(target <= 1.05x)."]
    lines += ["", "vescale: DCP files (true shapes; loads on any world size), fsynced, CRC32 of "
              "every file and item taken while writing and checked while reading; the tied head is written under both names so that a plain model's "
              "state_dict loads. DeepSpeed: torch.save per rank (same world size only)."]
    write_report(out, lines)


if __name__ == "__main__":
    main()
