"""Peak memory of one MoE layer's training step at simulated scale with expert parallelism:
rank 0 of W ranks (PyTorch's fake process group), ours vs FSDP2+EP.

One Kimi K2 or DeepSeek-V3 MoE layer (shapes from benchmarks/capacity_models/*.json: E
routed experts fused as gate_up_proj [E, 2I, H] and down_proj [E, H, I], the router [E, H],
top-k; a dense MLP with the shared experts' parameter count stands in for them), hidden and
expert sizes divided by --scale (this 24 GiB shared machine cannot hold 1/8 of Kimi K2's
8.5 GB-per-EP-rank fp32 experts three times over), E and k as in the model. The experts are
DTensors Shard(0) on the ep mesh of a (efsdp W/ep, ep) mesh built from the fake world; the
dense part is sharded over all W ranks. The model code is benchmarks/moe_model.py, as in
benchmarks/moe_ep.py, with the local experts run as one padded bmm (the per-expert loop's
`w1[e]` backward gives every expert a full-size zero-filled gradient, which swamps memory):

- ours:  vescale_engine.fsdp.fully_shard(experts, mesh=efsdp, gradient_divide_factor=W), then
         the block over the W-rank mesh; vescale_engine.optim.AdamW.
- fsdp2: torch's fully_shard, torchtitan's recipe: experts on efsdp (Shard(1) where efsdp x ep
         > E, as torchtitan's llama4 apply_fsdp), set_gradient_divide_factor(W),
         set_force_sum_reduction_for_comms(True); the block on the W-rank mesh;
         torch.optim.AdamW.

Each cell is a fresh process. The fake group's collectives move no data between ranks (its
all-to-all leaves the output as it was: the token counts start as this rank's own, so every
EP peer is taken to send what rank 0 sends), but its all-gather writes every chunk of the
output, so the gathered experts are resident as with a real one: the values mean nothing,
the memory does. Peak = the largest memory over two steps (forward, backward, optimizer step,
zero_grad) above the memory just before the first (sharded parameters in place, no optimizer
state yet): on CPU the peak RSS (VmHWM reset through /proc/self/clear_refs), on CUDA
torch.cuda.max_memory_allocated().

    python benchmarks/moe_ep_memory.py                  # writes benchmarks/results/moe_ep_memory.md
    python benchmarks/moe_ep_memory.py --device cuda --scale 1 --out F.md   # a GPU machine
    python benchmarks/moe_ep_memory.py --smoke          # tiny: a check that it runs
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from ranks import (command_line, cpu_model, git_describe, peak, reset_peak, run_one,  # noqa: E402
                   write_report)

MB = 1e6
TARGET = 0.7   # our peak / FSDP2+EP's
SYSTEMS = ("ours", "fsdp2")


def layer_shapes(name: str, scale: int) -> dict:
    """E, H, I, top-k and the shared experts' parameter count of `name`'s MoE layer, H and I
    divided by `scale`."""
    with open(os.path.join(HERE, "capacity_models", f"{name}.json")) as f:
        spec = json.load(f)
    moe = next(g for g in spec["groups"] if g["name"] == "moe_layers")
    t = {x["name"]: x["shape"] for x in moe["tensors"]}
    E, two_i, H = t["mlp.experts.gate_up_proj"]
    assert t["mlp.experts.down_proj"] == [E, H, two_i // 2], t
    shared = sum(s[0] * s[1] for n, s in t.items() if n.startswith("mlp.shared_experts."))
    H, inter = H // scale, two_i // 2 // scale
    return {"experts": E, "hidden": H, "inter": inter, "top_k": spec["moe"]["experts_per_token"],
            "dense": max(1, shared // scale ** 2 // (2 * H))}  # fc1 + fc2: the shared count


def worker(system, model_name, world, ep, device, scale, tokens) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from moe_model import Block, distribute_experts, shard

    torch.manual_seed(0)
    torch.set_num_threads(2 if device == "cpu" else torch.get_num_threads())
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.set_default_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    dense_mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh(device, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    s = layer_shapes(model_name, scale)
    block = Block(s["hidden"], s["dense"], s["experts"], s["inter"], s["top_k"],
                  local=s["experts"] // ep,       # only this EP rank's experts are built
                  padded_bmm=True)
    distribute_experts([block.moe], expert_mesh["ep"])
    shard(block, [block], system, dense_mesh, expert_mesh["efsdp"], ep)
    if system == "ours":
        from vescale_engine import optim as vopt
        opt = vopt.AdamW(block.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
    x = torch.randn(tokens, s["hidden"])

    def reset():
        if device == "cpu":
            return reset_peak()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def high():
        if device == "cpu":
            return peak()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    before = reset()
    for _ in range(2):
        block(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    row = {"peak_mb": (high() - before) / MB, **s,
           "local_expert_mb": s["experts"] // ep * 3 * s["inter"] * s["hidden"] * 4 / MB}
    dist.destroy_process_group()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--models", nargs="+", default=["kimi-k2", "deepseek-v3"])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--ep", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--scale", type=int, default=4, help="divide hidden and expert sizes by")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens on rank 0 per step")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per subprocess")
    ap.add_argument("--smoke", action="store_true", help="one tiny cell per system")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=4, metavar=("SYSTEM", "MODEL", "W", "EP"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        system, model, w, ep = args.worker
        print(json.dumps(worker(system, model, int(w), int(ep), args.device, args.scale,
                                args.tokens)))
        return
    if args.smoke:
        args.models, args.world_sizes, args.ep = ["deepseek-v3"], [256], [64]
        args.scale, args.tokens, args.repeats = 64, 64, 1
    args.out = args.out or os.path.join(HERE, "results", "moe_ep_memory_smoke.md"
                                        if args.smoke else "moe_ep_memory.md")
    cells = [(m, w, ep) for m in args.models for w in args.world_sizes for ep in args.ep]
    rows = {}
    loads = []
    for rep in range(args.repeats):
        for cell in cells:
            for system in SYSTEMS:
                m, w, ep = cell
                with open("/proc/loadavg") as f:
                    loads.append(" ".join(f.read().split()[:3]))
                r = run_one(__file__, ["--worker", system, m, str(w), str(ep), "--device",
                                       args.device, "--scale", str(args.scale), "--tokens",
                                       str(args.tokens)], args.timeout)
                rows.setdefault((cell, system), []).append(r)
                msg = (f"{r['peak_mb']:,.0f} MB" if "peak_mb" in r
                       else "FAILED: " + r["error"].splitlines()[-1])
                print(f"[{rep + 1}/{args.repeats}] {system:5s} {m} W={w} ep={ep}: {msg}",
                      flush=True)
    metric = ("peak RSS growth (VmHWM, reset through /proc/self/clear_refs, minus the RSS just "
              "before the first step)" if args.device == "cpu" else
              "torch.cuda.max_memory_allocated() minus memory_allocated() just before the "
              "first step")
    lines = [f"# MoE + EP at simulated scale (fake process group, {args.device}): peak memory "
             "of a training step, ours vs FSDP2+EP", "",
             f"Produced by `{command_line(__file__)}` (code {git_describe()}) on "
             f"{cpu_model()} ({os.cpu_count()} cores, shared with other jobs; load average "
             f"during the runs {min(loads)} .. {max(loads)}). {args.repeats} run(s) per cell, "
             "each a fresh process, systems alternated; median. Rank 0 of W; one MoE layer, "
             f"hidden and expert sizes divided by {args.scale}, {args.tokens} tokens on rank 0, "
             f"fp32, two steps of forward + backward + AdamW. Metric: {metric}. MB = 10^6 "
             "bytes. The script's docstring has the set-up.", ""]
    if args.smoke:
        lines += ["**Smoke run** (tiny sizes: checks that everything runs).", ""]
    lines += ["| model (H, I, E, top-k) | W | ep | efsdp | local experts MB | ours MB | "
              "FSDP2+EP MB | ours / FSDP2+EP | target <= 0.7 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    failures = []
    for cell in cells:
        m, w, ep = cell
        got = {s: [r["peak_mb"] for r in rows[(cell, s)] if "peak_mb" in r] for s in SYSTEMS}
        for s in SYSTEMS:
            failures += [(cell, s, r["error"]) for r in rows[(cell, s)] if "error" in r]
        first = next((r for s in SYSTEMS for r in rows[(cell, s)] if "peak_mb" in r), None)
        desc = (f"{m} ({first['hidden']}, {first['inter']}, {first['experts']}, "
                f"{first['top_k']})" if first else m)
        med = {s: statistics.median(v) if v else None for s, v in got.items()}
        ratio = med["ours"] / med["fsdp2"] if med["ours"] and med["fsdp2"] else None
        verdict = "n/a" if ratio is None else ("met" if ratio <= TARGET else "MISSED")
        def mb(v):
            return "n/a" if v is None else f"{v:,.0f}"
        lines.append(f"| {desc} | {w:,} | {ep} | {w // ep} | "
                     f"{mb(first['local_expert_mb'] if first else None)} | {mb(med['ours'])} | "
                     f"{mb(med['fsdp2'])} | {'n/a' if ratio is None else f'{ratio:.3f}'} | "
                     f"{verdict} |")
    if failures:
        lines += ["", "Failed runs:", ""]
        for (m, w, ep), s, err in failures:
            lines += [f"- {s} {m} W={w} ep={ep}:", "", "```", err, "```"]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
