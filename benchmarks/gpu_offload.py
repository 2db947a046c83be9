"""Offload on one device (world size 1): peak device memory and step time of a bf16 Llama, ours
(`zero_optimization.offload_optimizer`, and with `offload_param` too where the engine accepts
it) vs DeepSpeed ZeRO-3 offload (DeepSpeedCPUAdam) vs PyTorch FSDP2 `CPUOffloadPolicy`.

Models are built from config (benchmarks/capacity_check.py's `model_shapes` and `build_model`,
random init, no download): Llama-3.2-1B's and Llama-3.2-3B's dimensions (tied embedding, head
dimension 128). bf16 compute, fp32 master weights and gradient reduction, clipping 1.0, AdamW
(lr 1e-4, betas 0.9/0.95, weight decay 0.1), micro-batch --batch x --seq, decoder layers one
unit each. Ours and DeepSpeed get the same DeepSpeed config (bf16, ZeRO-3, offload sections
with pin_memory); FSDP2 is `fully_shard` per layer and at the root with
`CPUOffloadPolicy(pin_memory=True)` (all parameters, gradients and optimizer state on the host,
torch's AdamW stepping there). A variant the engine refuses at `initialize` (ours with
offload_param while it is not built) is skipped with its one-line reason, printed and recorded.

Each (model, system, round) runs in a fresh process, systems in turn within a round, the first
of them swapping every round; medians over rounds of each run's median step time. Peak device
memory: torch.cuda.max_memory_allocated over the training steps (the optimizer state is made in
the first of them); on CPU (the dry run: --device cpu --smoke) peak RSS. Writes
gpu_offload_DEVICE.md and gpu_offload_DEVICE.json into --out.

    python benchmarks/gpu_offload.py --out benchmarks/results/gpu_check_cuda     # on a GPU
    python benchmarks/gpu_offload.py --device cpu --smoke --out /tmp/x           # dry run
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from ranks import free_port, run_one, write_report  # noqa: E402

SYSTEMS = ("vescale", "vescale_param", "deepspeed", "deepspeed_param", "fsdp2")
LABELS = {"vescale": "veScale, offload_optimizer",
          "vescale_param": "veScale, offload_optimizer + offload_param",
          "deepspeed": "DeepSpeed ZeRO-3, offload_optimizer",
          "deepspeed_param": "DeepSpeed ZeRO-3, offload_optimizer + offload_param",
          "fsdp2": "FSDP2, CPUOffloadPolicy"}
# Llama-3.2-1B and -3B (config.json of meta-llama/Llama-3.2-{1B,3B}); smoke: a tiny one
MODELS = {"1b": dict(name="llama-3.2-1b", vocab=128256, H=2048, layers=16, Hq=2048, Hkv=512,
                     F=8192, tied=True),
          "3b": dict(name="llama-3.2-3b", vocab=128256, H=3072, layers=28, Hq=3072, Hkv=1024,
                     F=8192, tied=True),
          "smoke": dict(name="smoke-llama", vocab=256, H=64, layers=2, Hq=64, Hkv=32, F=128,
                        tied=True)}
HEAD_DIM = {"1b": 64, "3b": 128, "smoke": 32}  # Llama-3.2-1B: 32 heads of 64; 3B: 24 of 128
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
TARGETS = {"fsdp2": 0.8, "deepspeed": 1.0}  # our step time / theirs; memory: <= FSDP2's


def _config(system, args) -> dict:
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if system.endswith("_param"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 6, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": dict(ADAMW)}, "zero_optimization": zero}
    if system.startswith("vescale"):
        config["vescale"] = {"wrap_policy": {"module_classes": ["Layer"]}}
    return config


def worker(args):
    import torch
    import torch.distributed as dist
    import capacity_check

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = os.path.join(args.out, f"gpu_offload_{args.model}_shapes.json")
    capacity_check.HEAD_DIM = HEAD_DIM[args.model]  # read by build_model's forward
    torch.manual_seed(0)
    model = capacity_check.build_model(path)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.embed_tokens.weight.shape[0]
    config = _config(args.system, args)
    if args.system.startswith("vescale"):
        from vescale_engine import initialize
        try:
            engine, *_ = initialize(model=model, config=config)
        except ValueError as err:  # a refused config: skip the variant, saying why
            if args.system == "vescale_param" and "offload_param" in str(err):
                print(json.dumps({"system": args.system, "skipped": str(err).splitlines()[0]}))
                return
            raise
        step = _engine_step(engine)
    elif args.system.startswith("deepspeed"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        step = _engine_step(engine)
    else:
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                            fully_shard)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0,
                                world_size=1)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (1,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=ADAMW["betas"],
                                eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])

        def step(ids):
            loss = model(ids[:-1], ids[1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (args.batch * args.seq + 1,), generator=gen).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for k in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss = step(data)
        sync()
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"system": args.system, "params": params, "step_s": statistics.median(times),
                      "peak_bytes": peak, "loss": float(loss)}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine_step(engine):
    def step(ids):
        loss = engine(ids[:-1], ids[1:])
        engine.backward(loss)
        engine.step()
        return loss
    return step


def launch(model, system, args) -> dict:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": ROOT}
    if args.device == "cpu":
        env.update(VESCALE_BACKEND="gloo", DS_ACCELERATOR="cpu")
    flags = ["--worker", "--system", system, "--model", model, "--device", args.device,
             "--out", args.out, *[f"--{k}={getattr(args, k)}" for k in
                                  ("batch", "seq", "steps", "warmup")]]
    row = run_one(__file__, flags, timeout=args.timeout, env=env)
    if "error" in row:
        raise SystemExit(f"{model} {system} failed:\n{row['error']}")
    return row


def summarize(runs: dict) -> dict:
    """Per system, medians over rounds (or the reason it was skipped), and the targets."""
    out = {}
    for system, rows in runs.items():
        if any("skipped" in r for r in rows):
            out[system] = {"skipped": rows[0]["skipped"]}
            continue
        out[system] = {"step_s": statistics.median(r["step_s"] for r in rows),
                       "peak_bytes": statistics.median(r["peak_bytes"] for r in rows),
                       "loss": rows[-1]["loss"], "params": rows[-1]["params"],
                       "runs_step_s": [r["step_s"] for r in rows]}
    checks = {}
    for ours in ("vescale", "vescale_param"):
        if "step_s" not in out.get(ours, {}):
            continue
        checks[f"{ours}_peak_vs_fsdp2"] = out[ours]["peak_bytes"] / out["fsdp2"]["peak_bytes"]
        checks[f"{ours}_step_vs_fsdp2"] = out[ours]["step_s"] / out["fsdp2"]["step_s"]
        theirs = "deepspeed_param" if ours == "vescale_param" else "deepspeed"
        checks[f"{ours}_step_vs_{theirs}"] = out[ours]["step_s"] / out[theirs]["step_s"]
    return {"systems": out, "ratios": checks}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", nargs="+", default=["1b", "3b"], choices=list(MODELS))
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 2 steps after 1 warm-up, one round")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    if args.worker:
        return worker(args)
    if args.smoke:
        args.models, args.batch, args.seq, args.steps, args.warmup, args.rounds = \
            ["smoke"], 1, 16, 2, 1, 1
    os.makedirs(args.out, exist_ok=True)
    import capacity_check
    results = {}
    for model in args.models:
        with open(os.path.join(args.out, f"gpu_offload_{model}_shapes.json"), "w") as f:
            json.dump(capacity_check.model_shapes(**MODELS[model]), f)
        runs = {s: [] for s in SYSTEMS}
        for r in range(args.rounds):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                if runs[system] and "skipped" in runs[system][0]:
                    continue
                row = launch(model, system, args)
                runs[system].append(row)
                print(f"{model} round {r + 1} {system}: "
                      + (f"skipped: {row['skipped']}" if "skipped" in row else
                         f"step {row['step_s']:.3f} s, peak {row['peak_bytes'] / 1e9:.2f} GB"),
                      flush=True)
        results[model] = summarize(runs)
    with open(os.path.join(args.out, f"gpu_offload_{args.device}.json"), "w") as f:
        json.dump({"device": args.device, "command": " ".join(sys.argv[1:]),
                   "batch": args.batch, "seq": args.seq, "steps": args.steps,
                   "rounds": args.rounds, "models": results}, f, indent=1)
    write_report(os.path.join(args.out, f"gpu_offload_{args.device}.md"), _table(results, args))


def _table(results, args) -> list:
    memory = "peak device memory (GB)" if args.device == "cuda" else "peak RSS (GB)"
    lines = [f"# Offload on one {args.device} device, world size 1", "",
             f"`python benchmarks/gpu_offload.py {' '.join(sys.argv[1:])}`", "",
             f"bf16 Llama (built from config), micro-batch {args.batch} x {args.seq}, "
             f"{args.rounds} round(s) of {args.warmup} warm-up + {args.steps} timed steps; "
             "medians. Targets: ours' device memory <= FSDP2's, step time <= "
             f"{TARGETS['fsdp2']}x FSDP2's and <= DeepSpeed's.", ""]
    for model, res in results.items():
        lines += [f"## {MODELS[model]['name']}", "",
                  f"| system | step (s) | {memory} | last loss |", "|---|---:|---:|---:|"]
        for system in SYSTEMS:
            row = res["systems"][system]
            lines.append(f"| {LABELS[system]} | skipped: {row['skipped']} | | |" if "skipped"
                         in row else f"| {LABELS[system]} | {row['step_s']:.3f} | "
                         f"{row['peak_bytes'] / 1e9:.2f} | {row['loss']:.4f} |")
        lines += [""] + [f"- {k}: {v:.3f}" for k, v in res["ratios"].items()] + [""]
    return lines


if __name__ == "__main__":
    main()
