"""Quantized communication (ZeRO++'s `zero_quantized_weights`, `zero_quantized_gradients`, both,
FP8 weights with 128x128 tile scales, and those with `vescale.fp8_matmul`) against bf16
collectives: step time, bytes per step and the loss curve, 2 ranks on gloo.

The same GPT (examples/gpt_model.py), seed, data (Tiny Shakespeare, characters, as
examples/train_gpt.py reads it) and AdamW, bf16 compute, one unit per Block.
The systems alternate round by round; step times are medians of the slowest rank. Bytes are
what the all-gathers receive and what the reduce-scatters (or, quantized, the all-to-alls)
send, full buffers each (int8 plus one fp32 scale per group when quantized), counted by the
engine. Losses: the mean over ranks of each step, for `--steps`.

`--device cuda --world 1`: one GPU, NCCL (the GPU check's part 9: the quantize and dequantize
passes on the device). `--fake-world W`: one process as rank 0 of W with PyTorch's fake
process group: the collectives move nothing, so the losses mean nothing and are not reported;
step time and bytes are those of rank 0 at that world size.

    python benchmarks/quantized_comm.py        # writes benchmarks/results/quantized_comm.md
    python benchmarks/quantized_comm.py --layers 2 --dim 64 --seq 32 --rounds 1 --steps 5
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

SYSTEMS = ("bf16", "weights", "gradients", "both", "fp8", "fp8_matmul")
LABELS = {"bf16": "bf16 (no quantization)", "weights": "zero_quantized_weights",
          "gradients": "zero_quantized_gradients", "both": "both",
          "fp8": "zero_quantized_weights, fp8_e4m3, tile:128x128",
          "fp8_matmul": "the same with fp8_matmul"}
KEYS = {"bf16": (), "weights": ("zero_quantized_weights",),
        "gradients": ("zero_quantized_gradients",),
        "both": ("zero_quantized_weights", "zero_quantized_gradients"),
        "fp8": ("zero_quantized_weights",), "fp8_matmul": ("zero_quantized_weights",)}


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt_model import GPT, GPTConfig
    from train_gpt import get_batch, load_text
    from vescale_engine import initialize
    from vescale_engine.shard.stats import STATS

    device = torch.device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(args.rank)
    else:
        torch.set_num_threads(1)
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    torch.manual_seed(0)
    data, _, vocab = load_text(os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt"))
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.dim, n_head=max(1, args.dim // 64),
                    block_size=args.seq, vocab_size=vocab)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0,
              "steps_per_print": 10 ** 6, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, **{k: True for k in KEYS[args.system]}},
              "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}
    if args.system.startswith("fp8"):  # DeepSeek-V3's weight tiles: 128 x 128, one scale each
        config["vescale"].update(quantization_format="fp8_e4m3",
                                 granularity={"default": "tile:128x128"},
                                 fp8_matmul=args.system == "fp8_matmul")
    engine, *_ = initialize(model=GPT(cfg), config=config)
    gen = torch.Generator().manual_seed(1 + args.rank)
    times, losses = [], []
    STATS.reset()
    for i in range(args.warmup + args.steps):
        idx = get_batch(data, args.seq, args.batch, gen, device)
        start = time.perf_counter()
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    print(json.dumps({"rank": args.rank, "step_s": statistics.median(times),
                      "gathered": STATS.bytes_gathered / (args.warmup + args.steps),
                      "reduced": STATS.bytes_reduced / (args.warmup + args.steps),
                      "losses": losses}), flush=True)


def _means(losses, window=20):
    return [sum(losses[i:i + window]) / len(losses[i:i + window])
            for i in range(0, len(losses), window)]


def launch(system, args):
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("world", "layers", "dim", "seq", "batch", "steps", "warmup", "device",
              "fake_world")]
    results = run_ranks(__file__, system, 1 if args.fake_world else args.world, flags,
                        timeout_s=3600, device=args.device)
    return {"step_s": max(r["step_s"] for r in results), "gathered": results[0]["gathered"],
            "reduced": results[0]["reduced"], "losses": results[0]["losses"]}


def main():
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS, layers=4, dim=256, seq=128,
                              steps=300)
    parser.set_defaults(warmup=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "quantized_comm.md"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--fake-world", type=int, default=0,
                        help="one process as rank 0 of this many (fake process group)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, ROOT)
    from vescale_engine.torch_compat import rowwise_scaled_mm_missing
    missing = rowwise_scaled_mm_missing(args.device)  # the engine refuses fp8_matmul then
    skipped = {"fp8_matmul": f"skipped: this torch's torch._scaled_mm takes no row-wise "
                             f"scales on {args.device} ({missing})"} if missing else {}
    systems = [s for s in SYSTEMS if s not in skipped]
    runs = alternate(systems, args.rounds, lambda system: launch(system, args),
                     lambda run: f"step {run['step_s']:.4f} s")
    med = {s: statistics.median(r["step_s"] for r in runs[s]) for s in systems}
    first = {s: runs[s][0] for s in systems}
    base = first["bf16"]
    if args.device == "cuda":
        import torch
        where = f"{torch.cuda.get_device_name(0)}, NCCL"
    else:
        where = f"{cpu_model()}, gloo, OMP_NUM_THREADS=1 per rank"
    fake = bool(args.fake_world)
    ranks = (f"as rank 0 of {args.fake_world} (fake process group: the collectives move "
             "nothing; no losses)" if fake else f"{args.world} rank(s)")
    lines = ["# Quantized communication (ZeRO++ keys) vs bf16 collectives", "",
             f"Produced by `{command_line(__file__)}` on {where}, {ranks}; GPT of "
             f"{args.layers} layers, width {args.dim}, sequence {args.seq}, micro-batch "
             f"{args.batch} per rank, bf16 (gradients reduced in bf16), AdamW lr 1e-3; "
             f"{args.warmup + args.steps} steps per run, median of the per-run median step "
             f"over {args.rounds} alternated rounds; groups of 256 elements.", "",
             "| system | step time (s, x bf16) | all-gathered per step (bytes, x bf16) | "
             "reduce-scattered per step (bytes, x bf16) |" + ("" if fake else
             " mean loss, last 20 steps (x bf16) | largest gap of 20-step mean losses (x bf16) "
             "| largest rise over the previous step |"),
             "|---|---:|---:|---:|" + ("" if fake else "---:|---:|---:|")]
    tail = {s: statistics.fmean(first[s]["losses"][-20:]) for s in systems}
    for s in systems:
        row = (f"| {LABELS[s]} | {med[s]:.4f} ({med[s] / med['bf16']:.3f}) | "
               f"{first[s]['gathered']:,.0f} ({first[s]['gathered'] / base['gathered']:.3f}) | "
               f"{first[s]['reduced']:,.0f} ({first[s]['reduced'] / base['reduced']:.3f}) |")
        if not fake:
            gap = max(abs(a - b) / b for a, b in zip(_means(first[s]["losses"]),
                                                      _means(base["losses"])))
            rise = max(b / a for a, b in zip(first[s]["losses"], first[s]["losses"][1:]))
            row += (f" {tail[s]:.4f} ({tail[s] / tail['bf16']:.4f}) | {gap:.4f} | "
                    f"{rise:.2f}x |")
        lines.append(row)
    lines += [f"| {LABELS[s]} | {why} |" for s, why in skipped.items()]
    lines += ["", "Targets: bytes <= 0.55x bf16 for the quantized collective; final loss "
              "within 1% of the bf16 run's, no step diverging. Early steps (lr 1e-3 without "
              "warm-up) jump over one step (last column), at different steps in different "
              "runs and data orders, bf16 included, so the runs are compared by means over "
              "20 steps (steps 1-20, 21-40, ...) rather than step by step. fp8_matmul "
              "quantizes each Linear's input to FP8 too (both operands rounded). Step time: on CPU ranks over loopback gloo, moving bytes is cheap "
              "and the quantize and dequantize passes (unfused, fp32 temporaries) are not, so "
              "the quantized runs are slower; the bytes saved pay off where the network, not "
              "the compute, is the bottleneck. fp8_matmul's matmuls on CPU are an emulation "
              "(one torch._scaled_mm per 128 columns)."]
    if not fake:
        lines += ["", "Loss every 50 steps (" + ", ".join(LABELS[s] for s in systems) + "):",
                  ""]
        for i in range(0, len(base["losses"]), 50):
            lines.append(f"- step {i + 1}: " + ", ".join(f"{first[s]['losses'][i]:.4f}"
                                                       for s in systems))
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
