"""ZeRO-Offload of the optimizer on CPU: the host optimizer step, step time and bytes copied per
step, veScale Engine (`zero_optimization.offload_optimizer`) vs DeepSpeed ZeRO-3 + offload
(DeepSpeedCPUAdam), 2 ranks on gloo; and the two host AdamW kernels alone.

The model is a Llama built from a shapes file (default benchmarks/capacity_models/dense.json, a
scaled-down Llama-3-70B; `build_model` of benchmarks/capacity_check.py), fp32, random init, one
sequence of --seq tokens per rank and step, clipping 1.0, AdamW (lr 3e-4, betas 0.9/0.95, weight
decay 0.1). Both engines get the same DeepSpeed config: examples/configs/deepspeed_zero3.json's
zero_optimization section plus `offload_optimizer: {device: cpu, pin_memory: true}`; ours adds
a "vescale" section wrapping each decoder layer (the rest is the root). DeepSpeed builds its
DeepSpeedCPUAdam for that config (C++ op, JIT-built once into ~/.cache/torch_extensions).

What is timed, per optimizer step (perf_counter around the calls, wrapped on the instances):
- host kernel: ours, every call of optim/adamw.py's `adamw_math` on host tensors (torch's fused
  CPU AdamW over whole flat shards); DeepSpeed, `DeepSpeedCPUAdam.step` (its C++ kernel over
  each sub-group's flat fp32 partition);
- optimizer step: ours, `AdamW.step` (kernel plus the copies to and from the host shards);
  DeepSpeed, `DeepSpeedZeroOptimizer_Stage3.step` (its gradient copies, norm, clipping,
  kernel and the copy back into the partitions);
- engine.step and the whole step (forward, backward, engine.step).
Bytes copied per step: ours, the change of `engine.optimizer.offload.stats` over the step,
against `vescale plan --memory --offload-optimizer`'s estimate (capacity.estimate's
traffic.pcie) for the same shapes file and setup, both read at run time. DeepSpeed's copies
are host-to-host on CPU and not counted: its estimate (traffic.zero3.pcie) is shown beside.

The kernels alone: one flat fp32 shard of N elements (--kernel-sizes), threads = cores, ours'
`adamw_math` vs DeepSpeedCPUAdam.step, alternated round by round in one fresh process; both
start from the same values and their first updates are compared (same math).

Each run is fresh processes, the systems run in turn round by round (ranks.alternate), medians
over rounds of each run's median; the machine's load average is recorded for every run.

    python benchmarks/offload.py                      # writes benchmarks/results/offload.md
    python benchmarks/offload.py --smoke --out /tmp/offload.md     # tiny: a check that it runs
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
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from ranks import (add_worker_flags, alternate, command_line, cpu_model,  # noqa: E402
                   git_describe, run_one, run_ranks, write_report)

SYSTEMS = ("vescale", "deepspeed")
LABELS = {"vescale": "veScale Engine, offload_optimizer", "deepspeed":
          "DeepSpeed ZeRO-3, offload_optimizer (DeepSpeedCPUAdam)"}
MODEL = os.path.join(HERE, "capacity_models", "dense.json")
ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
TARGET = 0.8  # ours' host optimizer step (engine.step) / DeepSpeed's
KERNEL_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
KERNEL_MARGIN = 0.10  # DeepSpeed's op this much faster than ours: say so
SMOKE = dict(seq=16, steps=2, warmup=1, rounds=1, kernel_sizes=[1 << 12], kernel_rounds=1,
             kernel_reps=2)
SMOKE_MODEL = dict(name="smoke-llama", vocab=256, H=64, layers=2, Hq=64, Hkv=32, F=128)


def _config(system, args) -> dict:
    with open(os.path.join(ROOT, "examples", "configs", "deepspeed_zero3.json")) as f:
        zero = json.load(f)["zero_optimization"]
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": args.ratio}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": dict(ADAMW)}, "zero_optimization": zero}
    if system == "vescale":
        config["vescale"] = {"wrap_policy": {"module_classes": ["Layer"]}}
    elif args.ratio != 1:
        raise SystemExit("--ratio: DeepSpeed's offload ratio is measured at 1 only")
    return config


class Timer:
    """Wraps a callable; `total` is the seconds spent inside it since the last `take()`."""

    def __init__(self, fn, when=lambda *a, **k: True):
        self.fn, self.when, self.total = fn, when, 0.0

    def __call__(self, *args, **kwargs):
        if not self.when(*args, **kwargs):
            return self.fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    from capacity_check import build_model

    torch.set_num_threads(1)
    if args.system == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        from vescale_engine import initialize
    torch.manual_seed(0)
    model = build_model(args.model)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.embed_tokens.weight.shape[0]
    config = _config(args.system, args)
    stats = None
    if args.system == "deepspeed":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        zero = engine.optimizer
        if type(zero.optimizer).__name__ != "DeepSpeedCPUAdam":
            raise SystemExit(f"DeepSpeed stepped with {type(zero.optimizer).__name__}, "
                             "not DeepSpeedCPUAdam")
        kernel = zero.optimizer.step = Timer(zero.optimizer.step)
        opt_step = zero.step = Timer(zero.step)
    else:
        from vescale_engine.optim import adamw as ours_adamw
        engine, *_ = initialize(model=model, config=config)
        if getattr(engine.optimizer, "offload", None) is None:
            raise SystemExit("veScale: the engine's optimizer does not offload")
        stats = engine.optimizer.offload.stats
        # the kernel on host tensors only (with ratio < 1 the device buffers step too)
        kernel = ours_adamw.adamw_math = Timer(
            ours_adamw.adamw_math, lambda params, *a, **k: params[0].device.type == "cpu" and
            _is_host(engine.optimizer, params[0]))
        opt_step = engine.optimizer.step = Timer(engine.optimizer.step)
    gen = torch.Generator().manual_seed(1 + args.rank)
    rows = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.seq + 1,), generator=gen)
        before = (stats.bytes_to_host, stats.bytes_to_device) if stats else (0, 0)
        kernel.take(), opt_step.take()
        t0 = time.perf_counter()
        loss = engine(ids[:-1], ids[1:])
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        if step >= args.warmup:
            rows.append({"step_s": t2 - t0, "engine_step_s": t2 - t1, "kernel_s": kernel.take(),
                         "optimizer_step_s": opt_step.take(), "loss": float(loss),
                         "to_host": stats.bytes_to_host - before[0] if stats else None,
                         "to_device": stats.bytes_to_device - before[1] if stats else None})
    dist.barrier()
    dist.destroy_process_group()
    out = {k: statistics.median(r[k] for r in rows) for k in
           ("step_s", "engine_step_s", "kernel_s", "optimizer_step_s")}
    out.update(rank=args.rank, params=params, losses=[r["loss"] for r in rows],
               to_host=sorted({r["to_host"] for r in rows}, key=str),
               to_device=sorted({r["to_device"] for r in rows}, key=str))
    print(json.dumps(out), flush=True)


def _is_host(optimizer, tensor) -> bool:
    """Whether `tensor` lies in one of the offload's host allocations (not a device shard that
    happens to be on the CPU, as every shard is in this CPU benchmark)."""
    ptr = tensor.untyped_storage().data_ptr()
    return any(h.storage.untyped_storage().data_ptr() == ptr
               for h in optimizer.offload._hosts.values())


def estimate(args) -> dict:
    """`vescale plan --memory --offload-optimizer RATIO`'s estimate for the benchmark's shapes
    file and setup: per rank, bytes to the host and back per step, ours and ZeRO-3's."""
    sys.path.insert(0, ROOT)
    from vescale_engine.plan import capacity, model_plan
    setup = capacity.Setup(args.world, param_dtype="fp32", offload_optimizer=args.ratio)
    est = capacity.estimate(model_plan.load_shapes(args.model), setup)
    return {"ours": est["traffic"]["pcie"], "zero3": est["traffic"]["zero3"]["pcie"]}


# ---------------------------------------------------------------------------------------------
# The kernels alone, in one process: threads = cores.

def kernel_worker(args):
    import torch
    sys.path.insert(0, ROOT)
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from vescale_engine.optim.adamw import adamw_math

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    b1, b2 = ADAMW["betas"]
    rows = []
    for n in args.kernel_sizes:
        gen = torch.Generator().manual_seed(n)
        start, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        ours = {"p": start.clone(), "m": torch.zeros(n), "v": torch.zeros(n),
                "step": torch.zeros(())}
        theirs = torch.nn.Parameter(start.clone())
        theirs.grad = grad
        ds = DeepSpeedCPUAdam([theirs], lr=ADAMW["lr"], betas=(b1, b2), eps=ADAMW["eps"],
                              weight_decay=ADAMW["weight_decay"], adamw_mode=True)

        def ours_step():
            ours["step"].add_(1)
            adamw_math([ours["p"]], [grad], [ours["m"]], [ours["v"]], [ours["step"]],
                       lr=ADAMW["lr"], beta1=b1, beta2=b2, eps=ADAMW["eps"],
                       weight_decay=ADAMW["weight_decay"])

        ours_step()
        ds.step()
        with torch.no_grad():  # same math: the first updates agree to a few fp32 ulps
            _, exponent = torch.frexp(ours["p"])
            ulp = torch.ldexp(torch.ones(()), exponent - 24)  # spacing of fp32 at the value
            gap = float(((ours["p"] - theirs).abs() / ulp).max())
        times = {"ours": [], "deepspeed": []}
        for r in range(args.kernel_rounds):
            order = (("ours", ours_step), ("deepspeed", ds.step))
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                for _ in range(args.kernel_reps):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.kernel_reps)
        rows.append({"numel": n, "ours_s": statistics.median(times["ours"]),
                     "deepspeed_s": statistics.median(times["deepspeed"]),
                     "first_update_gap": gap})
        del ours, theirs, ds, start, grad
    print(json.dumps({"threads": threads, "rows": rows}), flush=True)


def run_kernels(args) -> dict:
    flags = ["--kernel-worker", "--kernel-rounds", str(args.kernel_rounds), "--kernel-reps",
             str(args.kernel_reps), "--kernel-sizes", *map(str, args.kernel_sizes)]
    load = os.getloadavg()[0]
    row = run_one(__file__, flags, timeout=1800, env={"DS_ACCELERATOR": "cpu",
                                                        "PYTHONPATH": ROOT})
    if "error" in row:
        raise SystemExit(f"kernel benchmark failed:\n{row['error']}")
    return {**row, "load": (load, os.getloadavg()[0])}


# ---------------------------------------------------------------------------------------------
# The driver and the report.

def launch(system, args) -> dict:
    flags = ["--model", args.model, "--seq", str(args.seq), "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--ratio", str(args.ratio)]
    load = os.getloadavg()[0]
    ranks = run_ranks(__file__, system, args.world, flags, timeout_s=1200)
    return {"ranks": ranks, "load": (load, os.getloadavg()[0]),
            **{k: max(r[k] for r in ranks) for k in
               ("step_s", "engine_step_s", "kernel_s", "optimizer_step_s")}}


def _med(runs, key):
    return statistics.median(run[key] for run in runs)


def _mb(b):
    return f"{b / 1e6:.2f}"


def _ms(seconds: float) -> str:
    """Milliseconds to 0.1, or two significant digits below that (a smoke run's host kernel
    can take 40 us: never shown as 0.0)."""
    ms = 1e3 * seconds
    return f"{ms:.1f}" if ms >= 0.1 else f"{ms:.2g}"


def report(runs, kernels, est, args) -> tuple:
    import torch
    import deepspeed
    ours, ds = runs["vescale"], runs["deepspeed"]
    med = {s: {k: _med(runs[s], k) for k in ("kernel_s", "optimizer_step_s", "engine_step_s",
                                             "step_s")} for s in SYSTEMS}
    ratio = med["vescale"]["kernel_s"] / med["deepspeed"]["kernel_s"]
    ratio_copies = med["vescale"]["optimizer_step_s"] / med["deepspeed"]["kernel_s"]
    host_step = med["vescale"]["engine_step_s"] / med["deepspeed"]["engine_step_s"]
    # bytes per step, every rank and step of every run: one value each way, or a list
    to_host = sorted({b for run in ours for r in run["ranks"] for b in r["to_host"]})
    to_device = sorted({b for run in ours for r in run["ranks"] for b in r["to_device"]})
    bytes_equal = to_host == [est["ours"]["device_to_host"]] and \
        to_device == [est["ours"]["host_to_device"]]
    losses_gap = max(abs(a - b) / abs(b) for a, b in zip(ours[0]["ranks"][0]["losses"],
                                                         ds[0]["ranks"][0]["losses"]))
    lines = [
        "# ZeRO-Offload of the optimizer on CPU: veScale Engine vs DeepSpeed ZeRO-3 offload", "",
        f"Produced by `{command_line(__file__)}` at {git_describe()} on {cpu_model()} "
        f"({os.cpu_count()} cores; torch {torch.__version__}, DeepSpeed {deepspeed.__version__}),"
        f" {args.world} ranks on gloo, OMP_NUM_THREADS=1 per rank. Model: "
        f"`{os.path.relpath(args.model, ROOT)}` ({ours[0]['ranks'][0]['params'] / 1e6:.1f}M "
        f"parameters, fp32), {args.seq} tokens per rank and step, clipping 1.0, AdamW; "
        f"offload_optimizer ratio {args.ratio:g}. Medians over {args.rounds} alternated rounds "
        f"of each run's median ({args.steps} steps after {args.warmup} warm-up), the slower "
        "rank's. See the script's docstring for what each column times.", ""]
    if args.smoke:
        lines += ["**Smoke run** (tiny sizes, one round): it shows the script works, not how "
                  "the systems compare.", ""]
    lines += ["| system | host kernel (ms) | optimizer step (ms) | engine.step (ms) | "
              "whole step (ms) |", "|---|---:|---:|---:|---:|"]
    for s in SYSTEMS:
        lines.append(f"| {LABELS[s]} | " + " | ".join(
            _ms(med[s][k]) for k in ("kernel_s", "optimizer_step_s", "engine_step_s",
                                     "step_s")) + " |")
    lines += [
        "",
        f"- Host optimizer step as each engine runs it (engine.step: gradient norm, clipping, "
        f"the host kernel and the copies to and from the host), ours / DeepSpeed's: "
        f"**{host_step:.3f}** (target <= {TARGET}: {'met' if host_step <= TARGET else 'MISSED'}).",
        f"- The host kernels alone inside those steps (adamw_math vs DeepSpeedCPUAdam.step, both "
        f"bound by memory bandwidth): {ratio:.3f}; ours' AdamW.step (kernel and copies) / "
        f"DeepSpeedCPUAdam.step: {ratio_copies:.3f}.",
        f"- Whole step, ours / DeepSpeed's: {med['vescale']['step_s'] / med['deepspeed']['step_s']:.3f}.",
        f"- Bytes copied per step and rank, ours (offload.stats): to the host "
        f"{', '.join(_mb(b) for b in to_host)} MB, back {', '.join(_mb(b) for b in to_device)} "
        f"MB; estimate (`vescale plan --memory --offload-optimizer {args.ratio:g}`, rank 0): "
        f"{_mb(est['ours']['device_to_host'])} / {_mb(est['ours']['host_to_device'])} MB: "
        f"{'equal' if bytes_equal else 'NOT EQUAL'}. ZeRO-3's estimate for the same setup: "
        f"{_mb(est['zero3']['device_to_host'])} / {_mb(est['zero3']['host_to_device'])} MB "
        "(not measured: on CPU its copies are host to host).",
        f"- Losses, ours vs DeepSpeed (rank 0, first round): largest relative difference "
        f"{losses_gap:.1e}.", "",
        "Runs (run order; load average before/after each run, 2 cores): " + "; ".join(
            f"{s}: " + ", ".join(f"{1e3 * x['kernel_s']:.1f}/{1e3 * x['step_s']:.0f} ms "
                                 f"(load {x['load'][0]:.1f}/{x['load'][1]:.1f})"
                                 for x in runs[s]) for s in SYSTEMS)
        + " (host kernel / whole step).", "",
        f"## The kernels alone: one flat fp32 shard, {kernels['threads']} threads", "",
        f"Ours: optim/adamw.py's `adamw_math` (torch's fused CPU AdamW); DeepSpeed: "
        f"DeepSpeedCPUAdam.step (adamw_mode). Median over {args.kernel_rounds} alternated "
        f"rounds of {args.kernel_reps} steps each; load average {kernels['load'][0]:.1f} before,"
        f" {kernels['load'][1]:.1f} after. Gap: largest difference of the parameters after "
        "the first update, in units in the last place of fp32 (ulp) at the value.", "",
        "| elements | ours (ms) | DeepSpeed (ms) | ours / DeepSpeed | first-update gap (ulp) |",
        "|---:|---:|---:|---:|---:|"]
    faster = []
    for r in kernels["rows"]:
        kr = r["ours_s"] / r["deepspeed_s"]
        if kr > 1 + KERNEL_MARGIN:
            faster.append(f"{r['numel']:,}")
        lines.append(f"| {r['numel']:,} | {1e3 * r['ours_s']:.2f} | {1e3 * r['deepspeed_s']:.2f}"
                     f" | {kr:.3f} | {r['first_update_gap']:.0f} |")
    lines += ["", "- DeepSpeed's op is more than 10% faster than ours at: " +
              (", ".join(faster) + " elements" if faster else "no size measured") + "."]
    return lines, ratio, bytes_equal


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_flags(parser, SYSTEMS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64, help="tokens per rank and step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=MODEL, help="shapes file (capacity_check layout)")
    parser.add_argument("--ratio", type=float, default=1.0, help="offload_optimizer ratio")
    parser.add_argument("--kernel-sizes", type=int, nargs="+", default=list(KERNEL_SIZES))
    parser.add_argument("--kernel-rounds", type=int, default=3)
    parser.add_argument("--kernel-reps", type=int, default=5)
    parser.add_argument("--kernel-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a tiny model (written beside "
                        "--out) and tiny sizes: " + ", ".join(
                            f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "offload.md"))
    args = parser.parse_args()
    if args.smoke and not args.worker:  # a tiny shapes file beside the report
        from capacity_check import model_shapes
        args.model = os.path.splitext(os.path.abspath(args.out))[0] + "_smoke_model.json"
        with open(args.model, "w") as f:
            json.dump(model_shapes(**SMOKE_MODEL), f)
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.model = os.path.abspath(args.model)
    if args.worker:
        return worker(args)
    if args.kernel_worker:
        return kernel_worker(args)
    est = estimate(args)
    runs = alternate(SYSTEMS, args.rounds, lambda s: launch(s, args),
                     lambda x: f"host kernel {1e3 * x['kernel_s']:.1f} ms, optimizer step "
                               f"{1e3 * x['optimizer_step_s']:.1f} ms, step "
                               f"{1e3 * x['step_s']:.0f} ms (load {x['load'][0]:.1f})")
    kernels = run_kernels(args)
    lines, ratio, bytes_equal = report(runs, kernels, est, args)
    write_report(args.out, lines)
    if not bytes_equal:  # the estimate and the code disagree: a failure, not a number
        sys.exit("bytes copied per step differ from the estimate")


if __name__ == "__main__":
    main()
