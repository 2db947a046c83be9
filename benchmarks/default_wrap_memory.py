"""Per-rank memory of one training step at W = 64 with the default wrap policy vs blocks wrapped.

One process pretends to be rank 0 of W ranks with PyTorch's fake process group (collectives
return at once and move nothing between ranks, but do write the gathered buffer), builds the
example GPT (examples/gpt_model.py, 8 blocks of width 1024, vocabulary 11008: 112M parameters,
449 MB in fp32) and runs `vescale_engine.initialize` + one forward, backward and optimizer
step under each config:

- default:        `"vescale": {}` (no wrap_policy: the default policy picks the units)
- no_section:     no "vescale" section at all (what a DeepSpeed config is)
- blocks:         `"wrap_policy": {"module_classes": ["Block"]}` (the reference)
- one_unit:       `"wrap_policy": {"min_params": 10**12}`: no unit below the root, what the
                  default was before the default policy (the control)

Two measurements per run: peak RSS growth (VmHWM reset through /proc/self/clear_refs right
before the forward, growth = VmHWM after the phase - VmRSS before the forward), and the
library's own accounting: the peak over the step of the full-size bytes all DBuffers hold
(`DBuffer.full_bytes_held`, sampled after every full-size allocation, where it can only
have grown). Each run is a fresh subprocess, configs alternated, medians of --repeats runs.

    python benchmarks/default_wrap_memory.py                  # W = 64, 3 repeats
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
from ranks import (command_line, cpu_model, git_describe, peak, reset_peak,  # noqa: E402
                   run_one, write_report)
MB = 1e6
MODEL = dict(vocab_size=11008, block_size=256, n_layer=8, n_head=16, n_embd=1024)
MICRO, SEQ = 1, 64  # few activations: the step's memory is mostly parameters
CONFIGS = {
    "default": {"vescale": {}},
    "no_section": {},
    "blocks": {"vescale": {"wrap_policy": {"module_classes": ["Block"]}}},
    "one_unit": {"vescale": {"wrap_policy": {"min_params": 10 ** 12}}},
}
TARGET = 1.10  # default's peak within 10% of blocks'


def base_config(name: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3}, **CONFIGS[name]}


# ---------------------------------------------------------------------------------------------
# Worker: one measurement in this process.

class GatheredPeak:
    """Peak of the full-size bytes every DBuffer holds, sampled after each full-size
    allocation (the only moment the total grows)."""

    def __init__(self, module):
        from vescale_engine import fsdp
        from vescale_engine.shard import dbuffer
        self.buffers = [b for m in module.modules() if fsdp.unit_of(m)
                        for b in fsdp.unit_of(m).buffers]
        self.peak = 0
        original = dbuffer.DBuffer._allocate

        def allocate(buf, name):
            tensor = original(buf, name)
            self.peak = max(self.peak, self.held())
            return tensor
        dbuffer.DBuffer._allocate = allocate

    def held(self) -> int:
        return sum(b.full_bytes_held for b in self.buffers)


def worker(name: str, world_size: int) -> dict:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import logging

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gpt_model import GPT, GPTConfig
    import vescale_engine
    from vescale_engine.fsdp import unit_of

    torch.manual_seed(0)
    torch.set_num_threads(2)
    os.environ.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    log = []
    handler = logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())
    logging.getLogger("vescale_engine").addHandler(handler)
    logging.getLogger("vescale_engine").setLevel(logging.INFO)

    model = GPT(GPTConfig(**MODEL))
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = vescale_engine.initialize(model=model, config=base_config(name))
    units = [unit_of(m) for m in engine.module.modules() if unit_of(m)]
    gathered = GatheredPeak(engine.module)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=gen)
    tgt = torch.roll(idx, -1, dims=1)

    before = reset_peak()
    phases = {}
    loss = engine(idx, tgt)
    phases["fwd"] = peak()
    reset_peak()
    engine.backward(loss)
    phases["bwd"] = peak()
    reset_peak()
    engine.step()
    phases["step"] = peak()
    row = {"config": name, "world_size": world_size, "params": params,
           "units": len(units), "largest_unit": max(u.numel for u in units),
           "gathered_peak_mb": gathered.peak / MB,
           "wrap_log": [line for line in log if line.startswith("wrap policy")]}
    for phase, value in phases.items():
        row[f"{phase}_mb"] = (value - before) / MB
    row["growth_mb"] = max(row[f"{p}_mb"] for p in phases)
    dist.destroy_process_group()
    return row


# ---------------------------------------------------------------------------------------------
# Driver: fresh subprocess per measurement, configs alternated, medians.

def measure(name, world_size, timeout):
    """One worker run in a fresh process: its row, or the config's keys and its error."""
    return {"config": name, "world_size": world_size,
            **run_one(__file__, ["--worker", name, str(world_size)], timeout,
                      env={"OMP_NUM_THREADS": "2"})}


def report(rows, args, command) -> list:
    by = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)

    def med(name, key):
        vals = [r[key] for r in by.get(name, []) if key in r]
        return statistics.median(vals) if vals else None

    def first(name, key):
        return next((r[key] for r in by.get(name, []) if key in r), None)

    def fmt(v, spec=",.0f"):
        return "n/a" if v is None else format(v, spec)

    params = next((r["params"] for r in rows if "params" in r), 0)
    out = [f"# Default wrap policy: per-rank memory as rank 0 of W = {args.world_size} "
           "(fake process group, cpu)", "",
           f"Produced by `{command}` (torch {args.torch_version}, code at {args.git}, CPU: "
           f"{args.cpu}; {args.repeats} run(s) per config, each in a fresh subprocess, configs "
           "alternated; medians).", "",
           f"Model: examples/gpt_model.py GPTConfig({', '.join(f'{k}={v}' for k, v in MODEL.items())}): "
           f"{params:,} parameters ({params * 4 / MB:,.0f} MB fp32), tied head; micro-batch "
           f"{MICRO} x {SEQ} tokens; `vescale_engine.initialize` with AdamW and "
           "`zero_optimization.stage` 3, then one forward, backward and step. RSS growth: "
           "VmHWM - VmRSS before the forward (VmHWM reset before each phase); gathered peak: "
           "the peak over the step of `DBuffer.full_bytes_held` summed over all buffers "
           "(deterministic). MB = 10^6 bytes.", "",
           "| config | units | largest unit (params) | RSS growth MB | fwd / bwd / step MB | "
           "gathered peak MB |",
           "|---|---:|---:|---:|---:|---:|"]
    for name in CONFIGS:
        out.append("| " + " | ".join([
            f"`{name}`", fmt(first(name, "units"), "d"), fmt(first(name, "largest_unit"), ","),
            f"**{fmt(med(name, 'growth_mb'))}**",
            " / ".join(fmt(med(name, f"{p}_mb")) for p in ("fwd", "bwd", "step")),
            f"**{fmt(med(name, 'gathered_peak_mb'))}**"]) + " |")
    out += ["", "Targets:", ""]
    for key, label in (("growth_mb", "RSS growth"), ("gathered_peak_mb", "gathered peak")):
        ref = med("blocks", key)
        for name in ("default", "no_section"):
            v = med(name, key)
            if v is not None and ref:
                out.append(f"- {label}, `{name}` within {TARGET - 1:.0%} of `blocks`: "
                           f"**{'met' if v <= TARGET * ref else 'MISSED'}** ({v / ref:.2f}x)")
        v = med("one_unit", key)
        if v is not None and ref:
            out.append(f"- {label}, control `one_unit` exceeds it: "
                       f"**{'yes' if v > TARGET * ref else 'NO'}** ({v / ref:.2f}x)")
    out += ["", "The engine's log line (rank 0) per config:", ""]
    out += [f"- `{first(name, 'wrap_log')[0] if first(name, 'wrap_log') else 'none'}` "
            f"({name})" for name in CONFIGS]
    out += ["", "Runs (RSS growth MB, in run order): " + "; ".join(
        f"{name}: " + "/".join(fmt(r.get("growth_mb")) for r in rs) for name, rs in by.items())]
    errors = [r for r in rows if "error" in r]
    if errors:
        out += ["", "Failed runs:", ""]
        for r in errors:
            out += [f"- {r['config']}:", "", "```", r["error"], "```"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "default_wrap_memory.md"))
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "W"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    import torch
    args.torch_version = torch.__version__
    args.cpu = f"{cpu_model()}, {os.cpu_count()} CPUs"
    args.git = git_describe()
    rows = []
    for rep in range(args.repeats):
        for name in CONFIGS:
            r = measure(name, args.world_size, args.timeout)
            rows.append(r)
            msg = (f"{r['growth_mb']:,.0f} MB, gathered {r['gathered_peak_mb']:,.0f} MB"
                   if "growth_mb" in r else "FAILED: " + r["error"].splitlines()[-1])
            print(f"[{rep + 1}/{args.repeats}] {name:10s}: {msg}", flush=True)
    write_report(args.out, report(rows, args, command_line(__file__)))


if __name__ == "__main__":
    main()
