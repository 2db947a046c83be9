"""`vescale plan --time` calibrated on this machine and checked against it: gloo's per-message
cost and bandwidth measured on the ranks, one rank's compute measured without communication,
and the predicted step of ours and FSDP2 (benchmarks/fsdp_step_time.py's GPT, fp32, AdamW)
beside the measured one, at 2 or 4 (`--world 4`) ranks on gloo.

Calibration (what the model is given, all measured here): the all-gather and reduce-scatter
times of gloo's own collectives at two sizes (their mean fits a ring's per-message latency and
bandwidth: `intra_node`); a large tensor copy's bandwidth (`memory_bandwidth`); one fp32
matmul's FLOP/s (`bf16_flops`: the peak of the dtype the step computes in) and the fraction of
it that reproduces the compute floor, one rank's forward, backward and AdamW with no
communication, run by as many processes at once as there are ranks, so that the floor's cores
are shared as the ranks share them (4 ranks on 2 cores: two processes a core;
`matmul_efficiency`, `attention_efficiency`). The cluster has no overlap
(the cores compute and run gloo's collectives both) and gloo's one protocol. Then ours and
FSDP2 are predicted, not fitted: their collectives (ours' exchanges and FSDP2's gloo
collectives costed alike), FSDP2's copy-in and copy-out, the optimizer over a shard.

    python benchmarks/step_time_gloo.py       # writes benchmarks/results/step_time_gloo.{md,json}
    python benchmarks/step_time_gloo.py --world 4 --out benchmarks/results/step_time_gloo_4.md
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
if HERE not in sys.path:
    sys.path.append(HERE)
from ranks import (alternate, benchmark_parser, command_line, cpu_model, run_ranks,  # noqa: E402
                   write_report)

SYSTEMS = ("vescale", "fsdp2", "floor")
SIZES = (1 << 16, 1 << 24)   # bytes of the full buffer: the latency and the bandwidth ends
TOLERANCE = 0.15


def gloo_worker(args):
    """On each rank: median seconds of gloo's all_gather_into_tensor and reduce_scatter_tensor
    of each size's full fp32 buffer."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    out = {}
    for nbytes in SIZES:
        full = torch.zeros(nbytes // 4)
        part = torch.zeros(nbytes // 4 // world)
        for kind in ("all_gather", "reduce_scatter"):
            times = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "all_gather":
                    dist.all_gather_into_tensor(full, part)
                else:
                    dist.reduce_scatter_tensor(part, full)
                times.append(time.perf_counter() - t0)
            out[f"{kind}_{nbytes}"] = statistics.median(times)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def device_rates() -> tuple:
    """(fp32 matmul FLOP/s of one thread, copy bandwidth in bytes/s) of this process."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    flops = 2 * 1024 ** 3 / statistics.median(times)
    src, dst = torch.randn(1 << 26), torch.empty(1 << 26)   # 256 MB
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return flops, 2 * src.numel() * 4 / statistics.median(times)


def fit_link(measured: dict, world: int) -> tuple:
    """(per-message latency, bandwidth) of a ring that gives the mean of the all-gather and
    reduce-scatter times at the two sizes: t = latency + (W-1)/W * bytes / bandwidth."""
    mean = {n: (measured[f"all_gather_{n}"] + measured[f"reduce_scatter_{n}"]) / 2
            for n in SIZES}
    small, large = SIZES
    share = (world - 1) / world
    bandwidth = share * (large - small) / (mean[large] - mean[small])
    return max(1e-7, mean[small] - share * small / bandwidth), bandwidth


def cluster_json(name, world, flops, copy_bw, latency, bandwidth, efficiency) -> dict:
    """The calibrated cluster: `world` ranks as one node of gloo-connected CPU ranks."""
    from vescale_engine.plan.step_time.collectives import BASE_LATENCY
    link = {"bandwidth": bandwidth, "efficiency": 1.0,
            # the model adds NCCL's base latency to each ring step's: take it off
            "latency": max(1e-7, latency - BASE_LATENCY["ring"]["Simple"])}
    return {"name": name, "gpus_per_node": world, "protocols": ["Simple"], "overlap": False,
            "device": {"name": cpu_model(), "bf16_flops": flops,
                       "matmul_efficiency": efficiency, "attention_efficiency": efficiency,
                       "memory_bytes": 1e11, "memory_bandwidth": copy_bw,
                       "memory_efficiency": 1.0},
            "intra_node": link, "inter_node": link}


def predict(cluster: dict, gpt: dict, world: int, system: str) -> float:
    """Seconds of one step of `system` ("ours", "fsdp2"; "floor": ours on one rank) on the
    cluster described by the dict."""
    from step_time_check import gpt_shapes
    from vescale_engine.plan.capacity import Setup
    from vescale_engine.plan.model_plan import load_shapes
    from vescale_engine.plan.step_time import load_cluster
    from vescale_engine.plan.step_time.report import Workload, predict as predict_one
    with tempfile.TemporaryDirectory() as tmp:
        shapes, cfile = os.path.join(tmp, "gpt.json"), os.path.join(tmp, "cluster.json")
        data = gpt_shapes(gpt["layers"], gpt["dim"], gpt["vocab"], gpt["seq"], head_dim=64)
        with open(shapes, "w") as f:
            json.dump(data, f)
        with open(cfile, "w") as f:
            json.dump(cluster, f)
        work = Workload(seq_len=gpt["seq"], micro_batch=gpt["batch"])
        setup = Setup(world_size=1 if system == "floor" else world, param_dtype="fp32")
        return predict_one("ours" if system == "floor" else system, load_shapes(shapes), setup,
                           load_cluster(cfile), work)["step_s"]


def calibrate_compute(cluster: dict, gpt: dict, floor_s: float) -> float:
    """The efficiency at which the model's floor (one rank's work, no communication) takes
    the measured floor's seconds (bisection: the step falls as the efficiency grows)."""
    lo, hi = 1e-3, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        trial = json.loads(json.dumps(cluster))
        trial["device"].update(matmul_efficiency=mid, attention_efficiency=mid)
        if predict(trial, gpt, 1, "floor") > floor_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main():
    import fsdp_step_time
    parser = benchmark_parser(__doc__.splitlines()[0], SYSTEMS + ("gloo",), layers=8, dim=512,
                              seq=256, steps=6)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "step_time_gloo.md"))
    args = parser.parse_args()
    if args.worker:
        return gloo_worker(args) if args.system == "gloo" else fsdp_step_time.worker(args)
    gloo = run_ranks(__file__, "gloo", args.world, [f"--steps={max(args.steps, 10)}"],
                     timeout_s=600)
    slowest = {k: max(r[k] for r in gloo) for k in gloo[0]}
    flops, copy_bw = device_rates()
    latency, bandwidth = fit_link(slowest, args.world)

    def launch(system):   # fsdp_step_time's runs, this file as their worker
        flags = [f"--{k}={getattr(args, k)}" for k in
                 ("world", "layers", "dim", "seq", "batch", "steps", "warmup")]
        results = run_ranks(__file__, system, args.world, flags, timeout_s=1800)
        return {"step_s": max(r["step_s"] for r in results)}
    runs = alternate(SYSTEMS, args.rounds, launch, lambda run: f"step {run['step_s']:.3f} s")
    measured = {s: statistics.median(r["step_s"] for r in runs[s]) for s in SYSTEMS}
    gpt = {"layers": args.layers, "dim": args.dim, "vocab": 8192, "seq": args.seq,
           "batch": args.batch}
    cluster = cluster_json(f"this machine, {args.world} gloo ranks", args.world, flops, copy_bw,
                           latency, bandwidth, 1.0)
    cluster["device"]["matmul_efficiency"] = cluster["device"]["attention_efficiency"] = \
        calibrate_compute(cluster, gpt, measured["floor"])
    predicted = {s: predict(cluster, gpt, args.world, "ours" if s == "vescale" else s)
                 for s in SYSTEMS}
    result = {"cpu": cpu_model(), "world": args.world, "gpt": gpt, "gloo": slowest,
              "cluster": cluster, "measured_s": measured, "predicted_s": predicted}
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(result, f, indent=1)
    worst = max(abs(predicted[s] / measured[s] - 1) for s in ("vescale", "fsdp2"))
    d = cluster["device"]
    lines = ["# `vescale plan --time` calibrated on this machine, against its measured steps", "",
             f"Produced by `{command_line(__file__)}` on {cpu_model()}, {args.world} ranks on "
             f"gloo, OMP_NUM_THREADS=1 per rank; benchmarks/fsdp_step_time.py's GPT "
             f"({args.layers} layers, width {args.dim}, sequence {args.seq}, micro-batch "
             f"{args.batch} per rank, fp32, AdamW); medians of {args.rounds} alternated rounds.",
             "", f"Calibration: gloo ring latency {latency * 1e6:,.0f} us per message and "
             f"{bandwidth / 1e9:.2f} GB/s (all-gather and reduce-scatter at "
             f"{SIZES[0] // 1024} KB and {SIZES[1] // 2 ** 20} MB); copies "
             f"{copy_bw / 1e9:.1f} GB/s; fp32 matmul {flops / 1e9:.1f} GFLOP/s of one thread, "
             f"at {100 * d['matmul_efficiency']:.1f}% of it the model's compute floor takes the "
             f"measured {measured['floor']:.3f} s; no overlap (one processor).", "",
             "| system | measured (s) | predicted (s) | predicted / measured |",
             "|---|---:|---:|---:|"]
    for s, label in (("vescale", "vescale_engine.fully_shard"), ("fsdp2", "PyTorch FSDP2"),
                     ("floor", f"compute floor ({args.world} processes at once, calibration)")):
        lines.append(f"| {label} | {measured[s]:.3f} | {predicted[s]:.3f} | "
                     f"{predicted[s] / measured[s]:.3f} |")
    lines += ["", f"Ours and FSDP2 within {100 * TOLERANCE:.0f}%: "
              f"{'met' if worst <= TOLERANCE else 'MISSED'} (worst {100 * worst:.1f}%)."]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
