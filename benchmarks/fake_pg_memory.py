"""Per-rank memory of one forward + backward at simulated scale: ours vs PyTorch FSDP2.

One process pretends to be rank 0 of W ranks with PyTorch's fake process group (collectives
return at once and write nothing). The model is one GPT-OSS-style MoE layer whose 128 experts
are fused in two fp32 tensors (384 MiB of parameters):

    w1 [128, 256, 2048]   per expert: hidden 256 -> 2 x 1024 (gate and up, fused)
    w2 [128, 1024, 256]   per expert: 1024 -> hidden 256
    x  [128, 8, 256]      8 tokens routed to each expert (no grad)
    h = bmm(x, w1) [128, 8, 2048]; gate, up = h.chunk(2, -1); a = gelu(gate) * up [128, 8, 1024]
    y = bmm(a, w2) [128, 8, 256]; loss = y.square().mean()

FSDP2 shards dim 0 (128 experts), so at W > 128 it pads that dim to W; our planner cuts at
rows (granularity rows:1) and pads almost nothing. Each (system, W) runs in a fresh subprocess,
alternating systems, and reports the peak memory growth over one forward + backward:

- cpu:  peak RSS growth. VmHWM is reset (write 5 to /proc/self/clear_refs) right before the
        forward, so growth = VmHWM after backward - VmRSS before forward.
- cuda: torch.cuda.max_memory_allocated() growth (reset_peak_memory_stats before forward).

    python benchmarks/fake_pg_memory.py                 # cpu, W = 64 128 256 1024, 3 repeats
    python benchmarks/fake_pg_memory.py --device cuda --world-sizes 64 256 1024 --out F.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
from ranks import command_line, git_describe, peak, reset_peak, run_one, write_report  # noqa: E402
MB = 1e6
E, HID, FF, TOK = 128, 256, 1024, 8
# FSDP2 peak RSS growth measured earlier on this machine (MB), the baseline for the targets.
FSDP2_REFERENCE = {64: 441, 128: 437, 256: 1461, 1024: 6069}
REDUCTION_TARGET = {256: 0.60, 1024: 0.85}
FLAT_TARGET = 1.10


# ---------------------------------------------------------------------------------------------
# Worker: one measurement in this process.

def worker(system: str, world_size: int, device: str) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    torch.set_num_threads(2 if device == "cpu" else torch.get_num_threads())
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    class FusedExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(E, HID, 2 * FF, device=device) * HID ** -0.5)
            self.w2 = nn.Parameter(torch.randn(E, FF, HID, device=device) * FF ** -0.5)

        def forward(self, x):
            gate, up = torch.bmm(x, self.w1).chunk(2, dim=-1)
            return torch.bmm(F.gelu(gate) * up, self.w2)

    layer = FusedExperts()
    row = {"system": system, "world_size": world_size}
    if system == "ours":
        from vescale_engine.fsdp import fully_shard, unit_of
        fully_shard(layer, reshard_after_forward=True)
        bufs = unit_of(layer).buffers
        row["padding"] = sum(b.layout.padding for b in bufs)
        row["shard_elems"] = sum(b.shard_size for b in bufs)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        fully_shard(layer, mesh=init_device_mesh(device, (world_size,)),
                    reshard_after_forward=True)
        # dim-0 sharding: each parameter's dim 0 is padded to a multiple of W
        row["padding"] = sum((-(-p.shape[0] // world_size) * world_size - p.shape[0])
                             * p[0].numel() for p in (layer.w1, layer.w2))
        row["shard_elems"] = sum(-(-p.shape[0] // world_size) * p[0].numel()
                                 for p in (layer.w1, layer.w2))
    x = torch.randn(E, TOK, HID, device=device)

    def reset():  # restart the peak from the memory in use now; return that (the baseline)
        if device == "cpu":
            return reset_peak()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_and_reset():
        if device == "cuda":
            torch.cuda.synchronize()
        value = peak() if device == "cpu" else torch.cuda.max_memory_allocated()
        reset()
        return value

    before = reset()
    loss = layer(x).square().mean()
    fwd_peak = peak_and_reset()   # forward: all-gather + activations
    loss.backward()
    bwd_peak = peak_and_reset()   # backward: gradients, reduce-scatter, reshard
    row["fwd_mb"] = (fwd_peak - before) / MB
    row["bwd_mb"] = (bwd_peak - before) / MB
    row["growth_mb"] = max(row["fwd_mb"], row["bwd_mb"])
    row["grads_ok"] = all(p.grad is not None for p in layer.parameters())
    dist.destroy_process_group()
    return row


# ---------------------------------------------------------------------------------------------
# Driver: fresh subprocess per measurement, systems alternated, medians.

def measure(system, world_size, device, timeout):
    """One worker run in a fresh process: its row, or the cell's keys and its error."""
    return {"system": system, "world_size": world_size,
            **run_one(__file__, ["--worker", system, str(world_size), "--device", device],
                      timeout)}


def fmt_mb(v):
    return "n/a" if v is None else f"{v:,.0f}"


def fmt_elems(n):
    return "n/a" if n is None else f"{n:,} ({n * 4 / 2**20:.2f} MiB)"


def report(rows, args, command) -> list:
    total = E * HID * 2 * FF + E * FF * HID
    metric = ("peak RSS growth: VmHWM - VmRSS just before forward, VmHWM reset by writing 5 to "
              "/proc/self/clear_refs before forward and again before backward"
              if args.device == "cpu" else
              "torch.cuda.max_memory_allocated() - memory_allocated() just before forward, "
              "peak stats reset before forward and again before backward")
    by = {}
    for r in rows:
        by.setdefault((r["system"], r["world_size"]), []).append(r)

    def med(system, w, key="growth_mb"):
        vals = [r[key] for r in by.get((system, w), []) if key in r]
        return statistics.median(vals) if vals else None

    def first(system, w, key):
        return next((r[key] for r in by.get((system, w), []) if key in r), None)

    w0 = min(args.world_sizes)
    base = med("ours", w0)
    ref_col = args.device == "cpu"
    out = [f"# Fake-process-group memory: one MoE layer, ours vs PyTorch FSDP2 ({args.device})",
           "",
           f"Produced by `{command}` (torch {args.torch_version}, code at {args.git}; {args.repeats} run(s) per cell, "
           "each in a fresh subprocess, systems alternated; medians).",
           "",
           "Model: 128 fused experts, w1 [128, 256, 2048] + w2 [128, 1024, 256] fp32 (384 MiB); "
           "x [128, 8, 256] -> bmm(w1) -> GLU gelu(gate) * up -> bmm(w2) -> mean square; one "
           "forward + backward on rank 0 of W. Ours: `vescale_engine.fsdp.fully_shard(layer, "
           "reshard_after_forward=True)` (granularity rows:1). FSDP2: "
           "`torch.distributed.fsdp.fully_shard(layer, mesh=init_device_mesh("
           f"\"{args.device}\", (W,)))`. Metric: {metric}. MB = 10^6 bytes.",
           "",
           "| W | ours MB | ours fwd / bwd | FSDP2 MB | FSDP2 fwd / bwd |"
           + (" FSDP2 ref |" if ref_col else "")
           + f" ours vs FSDP2 | ours / ours@{w0} | ours padding | ours shard/rank |"
           " FSDP2 padding | FSDP2 shard/rank |",
           "|---:" * (11 + ref_col) + "|"]
    checks = []
    for w in args.world_sizes:
        o, f = med("ours", w), med("fsdp2", w)
        ref = FSDP2_REFERENCE.get(w)
        cells = [str(w), f"**{fmt_mb(o)}**",
                 f"{fmt_mb(med('ours', w, 'fwd_mb'))} / {fmt_mb(med('ours', w, 'bwd_mb'))}",
                 fmt_mb(f),
                 f"{fmt_mb(med('fsdp2', w, 'fwd_mb'))} / {fmt_mb(med('fsdp2', w, 'bwd_mb'))}"]
        if ref_col:
            cells.append(fmt_mb(ref))
        cells += [f"{o / f - 1:+.0%}" if o is not None and f else "n/a",
                  f"{o / base:.2f}x" if o is not None and base else "n/a"]
        for system, spec in (("ours", ".2%"), ("fsdp2", ".0%")):
            pad = first(system, w, "padding")
            cells += ["n/a" if pad is None else format(pad / total, spec),
                      fmt_elems(first(system, w, "shard_elems"))]
        out.append("| " + " | ".join(cells) + " |")
        if o is not None and base and w != w0:
            checks.append((f"ours flat at W={w} (<= {FLAT_TARGET}x ours at W={w0})",
                           o <= FLAT_TARGET * base, f"{o / base:.2f}x"))
        if w in REDUCTION_TARGET and o is not None:
            goal = REDUCTION_TARGET[w]
            if f:
                checks.append((f"ours >= {goal:.0%} below FSDP2 at W={w}, FSDP2 measured here",
                               o <= (1 - goal) * f, f"{o / f - 1:+.0%}"))
            if ref and ref_col:
                checks.append((f"ours >= {goal:.0%} below FSDP2 at W={w}, FSDP2 reference "
                               f"{ref:,} MB", o <= (1 - goal) * ref, f"{o / ref - 1:+.0%}"))
    out += ["", "Targets:", ""]
    checks.sort(key=lambda c: not c[0].startswith("ours flat"))  # flatness first
    out += [f"- {name}: **{'met' if ok else 'MISSED'}** ({val})" for name, ok, val in checks]
    out += ["", "Runs (MB, in run order): "
            + "; ".join(f"{s} W={w}: " + "/".join(fmt_mb(r.get("growth_mb")) for r in rs)
                        for (s, w), rs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])))]
    errors = [r for r in rows if "error" in r]
    if errors:
        out += ["", "Failed runs:", ""]
        for r in errors:
            out += [f"- {r['system']} W={r['world_size']}:", "", "```", r["error"], "```"]
    out += ["", "Notes:", "",
            "- Fake-PG collectives move no data between ranks, but in torch 2.13 they are not "
            "no-ops: all-gather copies the local shard into every chunk of the output and "
            "reduce-scatter copies this rank's chunk of the input (torch 2.13's FakeProcessGroup.hpp: "
            "\"fake collectives copy those values into local outputs\"; other releases may "
            "differ). So the full parameter buffer "
            "is written and resident for both systems, as with a real all-gather. Memory a "
            "collective would use internally (NCCL/gloo staging) is not modelled, for either "
            "system.",
            "- fwd = peak over the forward (all-gather + activations); bwd = peak over the "
            "backward, both measured from the same pre-forward baseline; the cell is the larger.",
            "- Padding: padded elements over model elements. Shard/rank: per-rank parameter "
            "shard (ours: the planner's S summed over the unit's buffers; FSDP2: ceil(128 / W) "
            "expert slices of each tensor, padded on dim 0 to W).",
            "- Where the memory goes (this model; a per-gradient RSS probe agrees): ours' "
            "forward holds the full parameters all-gathered in place (402 MB, no copy-out) plus "
            "activations. Its backward writes each gradient over its own full parameter once "
            "that parameter's gradient is complete (fully_shard's default `grads_in_place`), so "
            "the only addition is autograd's freshly allocated gradient of w1 (268 MB), alive "
            "until AccumulateGrad adds it into the buffer view fsdp.py presets as `.grad`: two "
            "parameter-sized allocations at once, at every W. FSDP2's forward holds the "
            "all-gather output and the copied-out unsharded parameters (2 x the dim-0-padded "
            "size), which grows with W once W > 128 experts.",
            "- The 1,461 / 6,069 MB references were measured by another script whose method is "
            "not recorded; 60% below 1,461 MB (<= 584 MB) is less than ours' full parameters plus "
            "the one gradient autograd allocates (670 MB), which any FSDP whose backward runs "
            "torch's own autograd formulas holds at the backward of the first bmm.",
            "- FSDP2 ref: FSDP2's peak RSS growth measured earlier on this machine by another "
            "script (method and torch version not recorded here); the FSDP2 column is measured "
            "by this script, in the same way as ours."]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[64, 128, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per subprocess")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fake_pg_memory.md"))
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "W"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.device)))
        return
    import torch
    args.torch_version = torch.__version__
    args.git = git_describe()
    rows = []
    for rep in range(args.repeats):
        for w in args.world_sizes:
            for system in ("ours", "fsdp2"):
                r = measure(system, w, args.device, args.timeout)
                rows.append(r)
                msg = (f"{r['growth_mb']:,.0f} MB" if "growth_mb" in r
                       else "FAILED: " + r["error"].splitlines()[-1])
                print(f"[{rep + 1}/{args.repeats}] {system:5s} W={w:5d}: {msg}", flush=True)
    write_report(args.out, report(rows, args, command_line(__file__)))


if __name__ == "__main__":
    main()
