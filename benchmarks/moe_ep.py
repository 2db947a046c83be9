"""MoE with expert parallelism, 4 gloo ranks: step time and bytes sent per step (all-gather,
reduce-scatter, all-to-all), vescale_engine.fully_shard vs PyTorch FSDP2+EP.

The model (benchmarks/moe_model.py) is the same code for both: embedding, blocks of a dense
MLP and an MoE layer whose fused experts w1 [E, 2I, H], w2 [E, H, I] are DTensors Shard(0) on
an ep=2 mesh, tokens dispatched by all-to-all (torchtitan's ExpertParallel style), a head.
The world is a (efsdp 2, ep 2) mesh for the experts and a 4-rank dense mesh for the rest:

- ours:  vescale_engine.fsdp.fully_shard(experts, mesh=efsdp, gradient_divide_factor=4), each
         block and the root over the dense mesh; vescale_engine.optim.AdamW.
- fsdp2: torch.distributed.fsdp.fully_shard with torchtitan's recipe: experts on the efsdp mesh,
         set_gradient_divide_factor(4), set_force_sum_reduction_for_comms(True) (gloo has no
         PREMUL_SUM), each block and the root on the dense mesh; torch.optim.AdamW.

Same seed, init and data (every rank its own micro-batch); the losses and the gradient norms
before each optimizer step of the two systems must agree (the script exits non-zero otherwise). Each run is 4 fresh processes; systems alternate over rounds; medians are reported.
Bytes: what one rank sends, counted by wrapping torch.distributed's collectives before either
system is imported (ring all-gather / reduce-scatter: (w-1)/w of the full buffer; all-reduce
twice that; all-to-all everything not addressed to itself; ours on gloo exchanges shards
point-to-point, counted by their tags as all-gather or reduce-scatter).

    python benchmarks/moe_ep.py                 # writes benchmarks/results/moe_ep.md
    python benchmarks/moe_ep.py --smoke         # tiny, 1 round: a check that it runs
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from ranks import (add_worker_flags, alternate, command_line, cpu_model, git_describe,  # noqa: E402
                   run_ranks, write_report)

SYSTEMS = ("ours", "fsdp2")
LABELS = {"ours": "vescale_engine fully_shard (experts on efsdp, divisor 4)",
          "fsdp2": "FSDP2+EP (torchtitan recipe)"}
KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "other")
WORLD, EP = 4, 2
TARGET = 0.9       # our step time / FSDP2+EP's
LOSS_RTOL = 1e-5   # fp32, same init and data; the summation orders differ


class ByteCounter:
    """Adds up what this rank sends, per kind of collective, by wrapping torch.distributed's
    functions (both namespaces); a collective implemented through another counts once."""

    def __init__(self):
        self.sent = dict.fromkeys(KINDS, 0)
        self._depth = 0

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        def nbytes(t):
            return t.numel() * t.element_size()

        def size(group):
            return dist.get_world_size(group)

        def arg(a, k, i, name, default=None):
            return a[i] if len(a) > i else k.get(name, default)

        def gather(a, k, gi):
            g = arg(a, k, gi, "group")
            return "all_gather", nbytes(arg(a, k, 1, "input_tensor")) * (size(g) - 1)

        def scatter(a, k, gi):
            g = arg(a, k, gi, "group")
            return "reduce_scatter", nbytes(arg(a, k, 1, "input")) * (size(g) - 1) // size(g)

        def all_reduce(a, k):
            g = arg(a, k, 2, "group")
            return "all_reduce", 2 * nbytes(arg(a, k, 0, "tensor")) * (size(g) - 1) // size(g)

        def all_to_all(a, k):
            out, src = arg(a, k, 0, "output"), arg(a, k, 1, "input")
            splits, g = arg(a, k, 3, "input_split_sizes"), arg(a, k, 4, "group")
            row = src[0].numel() * src.element_size() if src.dim() and src.shape[0] else 0
            if not splits:
                return "all_to_all", nbytes(src) * (size(g) - 1) // size(g)
            return "all_to_all", nbytes(src) - splits[dist.get_rank(g)] * row

        def send(a, k):
            from vescale_engine.shard import collectives as ours  # imported by now
            tag = arg(a, k, 3, "tag", 0)
            kind = {ours._GATHER_TAG: "all_gather", ours._REDUCE_TAG: "reduce_scatter"}
            return kind.get(tag, "other"), nbytes(arg(a, k, 0, "tensor"))

        rules = {"all_gather_single": lambda a, k: gather(a, k, 2),
                 "all_gather_into_tensor": lambda a, k: gather(a, k, 2),
                 "reduce_scatter_single": lambda a, k: scatter(a, k, 3),
                 "reduce_scatter_tensor": lambda a, k: scatter(a, k, 3),
                 "all_reduce": all_reduce, "all_to_all_single": all_to_all,
                 "isend": send, "send": send}
        for name, rule in rules.items():
            for module in (dist, c10d):
                original = getattr(module, name, None)
                if original is not None and not hasattr(original, "_counted"):
                    setattr(module, name, self._wrap(original, rule))

    def _wrap(self, fn, rule):
        def counted(*args, **kwargs):
            if self._depth == 0:
                kind, n = rule(args, kwargs)
                self.sent[kind] += int(n)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        counted._counted = True
        return counted


def model_kwargs(args):
    return dict(vocab=args.vocab, hidden=args.hidden, dense=args.dense, experts=args.experts,
                inter=args.inter, top_k=args.top_k, layers=args.layers)


def local_grad_squares(model) -> float:
    """Sum of squares of this rank's gradient shards (DTensors: their local tensors)."""
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += g.double().square().sum().item()
    return total


def worker(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    counter = ByteCounter()
    counter.install()  # before either system imports (and keeps references to) collectives
    from torch.distributed.device_mesh import init_device_mesh
    from moe_model import MoEModel, distribute_experts, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dense_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    model = MoEModel(**model_kwargs(args))
    params = sum(p.numel() for p in model.parameters())
    distribute_experts([b.moe for b in model.blocks], expert_mesh["ep"])
    shard(model, list(model.blocks), args.system, dense_mesh, expert_mesh["efsdp"], EP)
    if args.system == "ours":
        from vescale_engine import optim as vopt
        opt = vopt.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + args.rank)
    times, losses, sent, squares = [], [], [], []
    for step in range(args.warmup + args.steps):
        idx = torch.randint(0, args.vocab, (args.tokens + 1,), generator=gen)
        before = dict(counter.sent)
        t0 = time.perf_counter()
        loss = model(idx[:-1], idx[1:])
        loss.backward()
        t_norm = time.perf_counter()
        squares.append(local_grad_squares(model))
        t_norm = time.perf_counter() - t_norm
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        if step >= args.warmup:
            times.append(t1 - t0 - t_norm)
            sent.append({k: counter.sent[k] - before[k] for k in KINDS})
        losses.append(loss.item())
    # the gradient norm per step (AdamW hides a wrong gradient scale from the losses): every
    # rank's gradient shards are disjoint pieces of the model, so their squares sum to it
    norms = torch.tensor(squares, dtype=torch.float64)
    dist.all_reduce(norms)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": args.rank, "step_s": statistics.median(times), "losses": losses,
                      "grad_norms": norms.sqrt().tolist(),
                      "sent": {k: statistics.median(s[k] for s in sent) for k in KINDS},
                      "params": params}), flush=True)


def launch(system, args):
    flags = ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--dense",
             str(args.dense), "--experts", str(args.experts), "--inter", str(args.inter),
             "--top-k", str(args.top_k), "--layers", str(args.layers), "--tokens",
             str(args.tokens), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    ranks = run_ranks(__file__, system, WORLD, flags, timeout_s=1800)
    return {"step_s": max(r["step_s"] for r in ranks),  # the step ends with the slowest rank
            "sent": {k: statistics.mean(r["sent"][k] for r in ranks) for k in KINDS},
            "losses": [statistics.mean(r["losses"][i] for r in ranks)
                       for i in range(len(ranks[0]["losses"]))],
            "grad_norms": ranks[0]["grad_norms"], "params": ranks[0]["params"]}


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_flags(parser, SYSTEMS)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dense", type=int, default=512, help="dense MLP width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--inter", type=int, default=512, help="expert intermediate size")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, 2 steps, 1 round (checks that everything runs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.vocab, args.hidden, args.dense, args.inter, args.layers = 128, 32, 64, 32, 2
        args.tokens, args.steps, args.warmup, args.rounds = 64, 2, 1, 1
    args.out = args.out or os.path.join(HERE, "results", "moe_ep_smoke.md" if args.smoke
                                        else "moe_ep.md")
    loads = [loadavg()]
    runs = alternate(SYSTEMS, args.rounds, lambda s: (launch(s, args), loads.append(loadavg()))[0],
                     lambda run: f"step {run['step_s']:.3f} s, sent "
                                 f"{sum(run['sent'].values()) / 1e6:.2f} MB")
    med = {s: statistics.median(r["step_s"] for r in runs[s]) for s in SYSTEMS}
    sent = {s: {k: statistics.median(r["sent"][k] for r in runs[s]) for k in KINDS}
            for s in SYSTEMS}
    ours, theirs = runs["ours"][0]["losses"], runs["fsdp2"][0]["losses"]
    gap = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    same_losses = all(r["losses"] == ours for r in runs["ours"])
    norm_gap = max(abs(a - b) / b for a, b in zip(runs["ours"][0]["grad_norms"],
                                                   runs["fsdp2"][0]["grad_norms"]))
    ratio = med["ours"] / med["fsdp2"]
    lines = ["# MoE with expert parallelism: step time and bytes per step, ours vs FSDP2+EP", "",
             f"Produced by `{command_line(__file__)}` (code {git_describe()}) on {cpu_model()} "
             f"(this machine: {os.cpu_count()} cores, shared with other jobs; load average "
             f"(1, 5, 15 min) before and after each run: {'; '.join(loads)}). 4 gloo ranks, "
             "OMP_NUM_THREADS=1 each; a (efsdp 2, ep 2) mesh for the experts, the 4-rank mesh "
             "for the rest.", "",
             f"Model (benchmarks/moe_model.py): {args.layers} blocks of a dense MLP "
             f"({args.hidden} -> {args.dense} -> {args.hidden}) and an MoE layer ({args.experts} "
             f"fused SwiGLU experts {args.hidden} -> {args.inter}, top-{args.top_k}, Shard(0) "
             f"over ep 2, all-to-all dispatch), vocabulary {args.vocab}, "
             f"{runs['ours'][0]['params']:,} parameters, fp32, {args.tokens} tokens per rank per "
             f"step, AdamW lr 1e-3. Median over {args.rounds} alternated round(s) (4 fresh "
             f"processes each) of the slowest rank's median step ({args.steps} steps after "
             f"{args.warmup} warm-up). Bytes: what one rank sends per step (mean over ranks), "
             "by kind; the rules are in the script's docstring.", ""]
    if args.smoke:
        lines += ["**Smoke run** (tiny model, too few steps for the timings to mean anything).",
                  ""]
    lines += ["| system | step (s) | runs (s) | all-gather MB | reduce-scatter MB | all-to-all MB "
              "| all-reduce MB | other MB |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for s in SYSTEMS:
        cells = " | ".join(f"{sent[s][k] / 1e6:.3f}" for k in KINDS)
        each = ", ".join(f"{r['step_s']:.3f}" for r in runs[s])
        lines.append(f"| {LABELS[s]} | {med[s]:.3f} | {each} | {cells} |")
    lines += ["", f"- Step time ours / FSDP2+EP = **{ratio:.3f}** (target <= {TARGET}: "
                  f"{'met' if ratio <= TARGET else 'MISSED'}).",
              f"- Losses (mean over ranks, {len(ours)} steps) agree to {gap:.1e} relative "
              f"(bound {LOSS_RTOL:.0e}: {'ok' if gap <= LOSS_RTOL else 'DISAGREE'}); our runs "
              f"{'give identical losses' if same_losses else 'differ between rounds'}. "
              f"Ours: {[round(v, 6) for v in ours]}; FSDP2+EP: {[round(v, 6) for v in theirs]}.",
              f"- Gradient norms before each optimizer step agree to {norm_gap:.1e} relative "
              f"(bound {LOSS_RTOL:.0e}: {'ok' if norm_gap <= LOSS_RTOL else 'DISAGREE'}; AdamW "
              "would hide a wrong expert divisor from the losses, the norm does not)."]
    write_report(args.out, lines)
    if gap > LOSS_RTOL or norm_gap > LOSS_RTOL:
        raise SystemExit(f"the systems disagree: losses {gap:.2e}, gradient norms "
                         f"{norm_gap:.2e} relative (bound {LOSS_RTOL:.0e})")


if __name__ == "__main__":
    main()
