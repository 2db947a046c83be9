"""Step time and peak memory, ours vs PyTorch FSDP2, on one device (world size 1).

The same GPT (about 1B parameters by default: 18 blocks of width 2048, 32k vocabulary) in bf16
compute with fp32 master weights and fp32 gradient reduction, wrapped per block then at the
root, AdamW (ours: vescale_engine.optim.AdamW on flat shards; FSDP2: torch.optim.AdamW, fused
on CUDA), clipping at 1.0. Each (system, round) runs in a fresh process, systems alternate, and
the table reports medians over rounds of each run's median step time, plus peak memory
(CUDA: max_memory_allocated; CPU: peak RSS) and the last loss (the two must agree).

    python benchmarks/gpu_step_time.py --out benchmarks/results/gpu            # on a GPU
    python benchmarks/gpu_step_time.py --device cpu --layers 2 --dim 64 --vocab 256 \
        --seq 64 --batch 2 --steps 3 --rounds 1 --out /tmp/x                  # dry run
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
from ranks import run_one, write_report  # noqa: E402
SYSTEMS = ("veScale", "FSDP2")


def worker(args):
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch
    import torch.distributed as dist
    from gpt_model import GPT, GPTConfig

    device = torch.device(args.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                          n_head=max(1, args.dim // 128), n_embd=args.dim)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.system == "veScale":
        import vescale_engine
        from vescale_engine import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = vescale_engine.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        clip = vescale_engine.clip_grad_norm_
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                fused=device.type == "cuda")
        clip = torch.nn.utils.clip_grad_norm_
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        clip(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 1e6 if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"system": args.system, "params": n_params, "step_s": statistics.median(times),
                      "peak_mb": peak, "loss": loss.item(), "device_name": name}), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    flags = [f"--{k}={getattr(args, k)}" for k in
             ("device", "layers", "dim", "vocab", "seq", "batch", "steps", "warmup")]
    runs = {s: [] for s in SYSTEMS}
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29517"),
           "PYTHONPATH": ROOT}
    for r in range(args.rounds):
        for system in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):  # alternate who goes first
            row = run_one(__file__, ["--worker", "--system", system,
                                     "--out", os.path.abspath(args.out), *flags], 900, env=env)
            if "error" in row:
                raise SystemExit(f"{system} failed:\n{row['error']}")
            runs[system].append(row)
            print(f"round {r + 1} {system}: {runs[system][-1]}", flush=True)
    rows = {s: {"step_s": statistics.median(x["step_s"] for x in runs[s]),
                "peak_mb": statistics.median(x["peak_mb"] for x in runs[s]),
                "loss": runs[s][-1]["loss"], "params": runs[s][-1]["params"]} for s in SYSTEMS}
    ratio = rows["veScale"]["step_s"] / rows["FSDP2"]["step_s"]
    mem = rows["veScale"]["peak_mb"] / rows["FSDP2"]["peak_mb"]
    table = [f"# Step time and peak memory on one {args.device} device, world size 1",
             "", f"`python benchmarks/gpu_step_time.py {' '.join(sys.argv[1:])}`", "",
             f"GPT with {rows['FSDP2']['params'] / 1e6:,.1f} M parameters ({args.layers} blocks, "
             f"width {args.dim}, vocab {args.vocab}), batch {args.batch} x {args.seq}, bf16 "
             f"compute, fp32 master and reduction; {args.rounds} alternated rounds of "
             f"{args.warmup} warm-up + {args.steps} timed steps; medians.", "",
             "| system | step (s) | peak memory (MB) | last loss |", "|---|---:|---:|---:|"]
    table += [f"| {s} | {rows[s]['step_s']:.4f} | {rows[s]['peak_mb']:.0f} | "
              f"{rows[s]['loss']:.4f} |" for s in SYSTEMS]
    table += ["", f"veScale / FSDP2: step time {ratio:.3f}x, peak memory {mem:.3f}x"]
    write_report(os.path.join(args.out, f"gpu_step_time_{args.device}.md"), table)
    # what benchmarks/step_time_check.py compares `vescale plan --time` with
    with open(os.path.join(args.out, f"gpu_step_time_{args.device}.json"), "w") as f:
        json.dump({"device": args.device, "device_name": runs["FSDP2"][-1]["device_name"],
                   **{k: getattr(args, k) for k in ("layers", "dim", "vocab", "seq", "batch")},
                   "step_s": {s: rows[s]["step_s"] for s in SYSTEMS}}, f, indent=1)


if __name__ == "__main__":
    main()
