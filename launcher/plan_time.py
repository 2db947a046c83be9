"""`vescale plan --time`: the step time of ours, PyTorch FSDP2 and DeepSpeed ZeRO-3 for the
setups `--memory` estimates (vescale_engine.plan.step_time), on a cluster described by a small
JSON file; `--scan` adds strong scaling to the world sizes' weak scaling, and `--plot` draws
both. Torch-free."""
from __future__ import annotations

import os
import sys

from launcher.arg_types import positive_int

SYSTEMS = (("ours", "ours"), ("fsdp2", "FSDP2"), ("zero3", "ZeRO-3"))
SMALL_CHANGE = 0.005   # what moves ours: settings below it are not printed (--json has all)
_TIME_FLAGS = ("cluster", "checkpointing", "prefetch", "scan")
_CHECKPOINTING = {"none": "no activation checkpointing",
                  "selective": "selective activation checkpointing",
                  "full": "full activation checkpointing"}


def add_arguments(parser) -> None:
    t = parser.add_argument_group(
        "step time (--time)",
        "Seconds per optimizer step, tokens/s per GPU and MFU for ours, FSDP2 and ZeRO-3, from "
        "each system's schedule of collectives and copies played on a cluster's compute and "
        "links (NCCL's ring and tree, NVLink inside a node, the network between nodes); the "
        "setup flags of --memory apply; --seq and --micro-batch give the tokens per rank. "
        "docs/capacity_planning.md says what the model leaves out.")
    t.add_argument("--time", action="store_true", help="predict the step time")
    t.add_argument("--cluster", metavar="NAME|FILE.json",
                   help="the machine: h100 (default) or h200 (nodes of 8 with NVSwitch and "
                        "8 x 400 Gb/s), or a cluster JSON file of the same fields")
    t.add_argument("--checkpointing", choices=("none", "selective", "full"),
                   help="activation checkpointing of the decoder layers: none (default), "
                        "selective (torchtitan's op-level: every other matmul recomputed) or "
                        "full (--activation-checkpointing means full too)")
    t.add_argument("--prefetch", type=positive_int, metavar="N",
                   help="units all-gathered ahead of the one computing (default 1, as FSDP2 "
                        "and ours)")
    t.add_argument("--scan", action="store_true",
                   help="over the --world-size list: weak scaling (the same micro-batch per "
                        "rank) and strong scaling (the global batch of the largest size, "
                        "accumulated on fewer ranks); --plot FILE.png draws both")


def check(args) -> None:
    """Time flags without --time, and --scan without a list: one line, before any planning."""
    from vescale_engine.plan.capacity import CapacityError
    if not args.time:
        given = [f for f in _TIME_FLAGS if getattr(args, f) not in (None, False)]
        if given:
            raise CapacityError(f"--{given[0]} needs --time")
        return
    if args.tp > 1 or args.ep > 1:   # before the shapes file's tp_plan is read
        from vescale_engine.plan.step_time.report import NO_TP_EP
        raise CapacityError(NO_TP_EP)
    if args.scan and len(args.world_size) < 2:
        raise CapacityError("--scan needs a --world-size list, e.g. 8,16,32,...,8192")
    if args.scan and args.granularity and len(args.granularity) > 1:
        raise CapacityError("--scan takes one --granularity")


def workload(args):
    from vescale_engine.plan.capacity import CapacityError
    from vescale_engine.plan.step_time.report import Workload
    checkpointing = args.checkpointing or ("full" if args.activation_checkpointing else "none")
    if args.activation_checkpointing and checkpointing != "full":
        raise CapacityError(f"--activation-checkpointing (full) and --checkpointing "
                            f"{checkpointing} disagree")
    return Workload(seq_len=args.seq or 4096, micro_batch=args.micro_batch or 1,
                    checkpointing=checkpointing, prefetch=args.prefetch or 1)


def run(args, model, setups: dict) -> dict:
    """{"rows": {(granularity, world size): {system: result, "settings": [...]}}, "strong":
    strong scaling's rows with --scan (else None), "cluster", "workload"}."""
    from vescale_engine.plan.capacity import CapacityError, PlanCache
    from vescale_engine.plan.step_time import load_cluster
    from vescale_engine.plan.step_time.report import predict, scan, settings_that_matter
    cluster = load_cluster(args.cluster or "h100")
    work = workload(args)
    cache, out = PlanCache(), {}
    try:
        for key, setup in setups.items():
            row = {name: predict(name, model, setup, cluster, work, cache) for name, _ in SYSTEMS}
            if len(setups) == 1:   # a sweep's table has no room for them (and they cost)
                row["settings"] = [{"setting": n, "step_s": s, "change": c} for n, s, c in
                                   settings_that_matter(model, setup, cluster, work, cache)]
            out[key] = row
        strong = scan(model, next(iter(setups.values())), cluster, work,
                      [w for _, w in setups])["strong"] if args.scan else None
    except ValueError as err:
        raise CapacityError(str(err)) from None
    return {"rows": out, "strong": strong, "cluster": cluster, "workload": work}


def show(args, model, setups: dict, timed: dict) -> None:
    """run()'s result as tables (not with --json), and the scaling plot with --scan --plot."""
    if not args.json:
        _print(model, timed["cluster"], timed["workload"], setups, timed["rows"],
               timed["strong"])
    if args.plot and args.scan:
        _plot(model, timed["cluster"], timed["rows"], timed["strong"], args.plot)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _print(model, cluster, work, setups, out, strong) -> None:
    d = cluster.device
    print(f"\nstep time: {model.name} on {cluster.name} ({cluster.gpus_per_node} x {d.name} per "
          f"node), {work.micro_batch} x {work.seq_len:,} tokens per rank per micro-step, "
          f"{_CHECKPOINTING[work.checkpointing]}, prefetch {work.prefetch}; compute at "
          f"{_pct(d.matmul_efficiency)} (matmuls) and {_pct(d.attention_efficiency)} "
          f"(attention) of {d.bf16_flops / 1e12:,.0f} TFLOP/s; MFU counts torchtitan's model "
          f"FLOPs")
    sweep = len(out) > 1
    if sweep:
        print("weak scaling (the same micro-batch per rank): tokens/s per GPU (MFU), exposed "
              "communication in % of the step")
        several = len({g for g, _ in out}) > 1   # a granularity sweep: say which row is which
        print((f"{'granularity':<14}" if several else "") + f"{'ranks':>6} "
              + " ".join(f"{label:>22}" for _, label in SYSTEMS) + f" {'ours exposed':>13}")
        for (g, world), row in out.items():
            print((f"{g:<14}" if several else "") + f"{world:>6} "
                  + " ".join(f"{_cell(row[name]):>22}" for name, _ in SYSTEMS)
                  + f" {_pct(row['ours']['exposed_share']):>13}")
    else:
        (g, world), row = next(iter(out.items()))
        setup = setups[(g, world)]
        print(f"{world} ranks, shard groups of {setup.shard_size}, granularity {g}, "
              f"{setup.grad_accum} micro-step(s) per step")
        print(f"{'system':<7} {'step s':>8} {'tokens/s/GPU':>13} {'MFU':>6} {'exposed':>8} "
              f"{'copies':>7} {'comm busy s':>12}")
        for name, label in SYSTEMS:
            r = row[name]
            if "unsupported" in r:
                print(f"{label:<7} n/a: {r['unsupported']}")
                continue
            print(f"{label:<7} {r['step_s']:>8.3f} {r['tokens_per_s_per_gpu']:>13,.0f} "
                  f"{_pct(r['mfu']):>6} {_pct(r['exposed_share']):>8} "
                  f"{_pct(r['copies_share']):>7} {r['communication_s']:>12.3f}")
        moving = [s for s in row["settings"] if abs(s["change"]) >= SMALL_CHANGE]
        print("what moves ours most: " + ("; ".join(
            f"{s['setting']} {100 * s['change']:+.1f}%" for s in moving) if moving else
            f"no setting tried changes the step by {100 * SMALL_CHANGE:.1f}% or more"
            + (f" (the most: {row['settings'][0]['setting']} "
               f"{100 * row['settings'][0]['change']:+.1f}%)" if row["settings"] else "")))
    if strong:
        largest = max(r["world_size"] for r in strong)
        print(f"strong scaling (the global batch of {largest:,} ranks x {work.micro_batch} "
              f"sequences, accumulated on fewer): seconds per step (speed-up over the "
              f"smallest)")
        print(f"{'ranks':>6} {'micro-steps':>11} " + " ".join(f"{label:>18}"
                                                              for _, label in SYSTEMS))
        first = strong[0]
        for r in strong:
            print(f"{r['world_size']:>6} {r['grad_accum']:>11} " + " ".join(
                f"{_speedup(r[name], first[name]):>18}" for name, _ in SYSTEMS))
    print("left out: stragglers, link congestion, kernel tails and host overheads, NCCL "
          "kernels slowing compute; activations' memory (see --memory)")


def _cell(r: dict) -> str:
    if "unsupported" in r:
        return "n/a"
    return f"{r['tokens_per_s_per_gpu']:,.0f} ({_pct(r['mfu'])})"


def _speedup(r: dict, first: dict) -> str:
    if "unsupported" in r or "unsupported" in first:
        return "n/a"
    return f"{r['step_s']:.3f} ({first['step_s'] / r['step_s']:.1f}x)"


def _plot(model, cluster, out, strong, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (weak_ax, strong_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    worlds = [w for _, w in out]
    for name, label in SYSTEMS:
        points = [(w, row[name]["tokens_per_s_per_gpu"]) for (_, w), row in out.items()
                  if "unsupported" not in row[name]]
        if points:
            weak_ax.plot(*zip(*points), marker="o", label=label)
        points = [(r["world_size"], strong[0][name]["step_s"] / r[name]["step_s"])
                  for r in strong if "unsupported" not in r[name]
                  and "unsupported" not in strong[0][name]]
        if points:
            strong_ax.plot(*zip(*points), marker="o", label=label)
    strong_ax.plot(worlds, [w / worlds[0] for w in worlds], ls="--", color="grey",
                   label="linear")
    for ax in (weak_ax, strong_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size (GPUs)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    strong_ax.set_yscale("log", base=2)
    weak_ax.set_ylabel("tokens/s per GPU")
    strong_ax.set_ylabel(f"speed-up over {worlds[0]} GPUs")
    weak_ax.set_title(f"{model.name} on {cluster.name}: weak scaling")
    strong_ax.set_title("strong scaling")
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)   # never leave a half-written plot behind
    print(f"wrote {path}", file=sys.stderr)
