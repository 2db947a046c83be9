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
_TIME_FLAGS = ("cluster", "checkpointing", "prefetch", "scan", "fake_world")
RECORDED = ("ours", "fsdp2")   # what --fake-world records (ZeRO-3 needs a device per rank)
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
    t.add_argument("--fake-world", action="store_true",
                   help="play the collectives of a real step of ours and of torch FSDP2, each "
                        "run as rank 0 of every world size on torch's fake process group (one "
                        "process per run; needs torch, and host memory for rank 0's shards and "
                        "a few full-size units), instead of the planner's schedule; ZeRO-3 "
                        "stays from DeepSpeed's rules")
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
    records = _record_all(model, setups) if args.fake_world else {}
    try:
        for key, setup in setups.items():
            row = {name: predict(name, model, setup, cluster, work, cache,
                                 records.get((key, name))) for name, _ in SYSTEMS}
            if len(setups) == 1:   # a sweep's table has no room for them (and they cost)
                row["settings"] = [{"setting": n, "step_s": s, "change": c} for n, s, c in
                                   settings_that_matter(model, setup, cluster, work, cache)]
            out[key] = row
        strong = scan(model, next(iter(setups.values())), cluster, work,
                      [w for _, w in setups], records={(w, name): r for ((_, w), name), r
                                                       in records.items()}
                      )["strong"] if args.scan else None
    except ValueError as err:
        raise CapacityError(str(err)) from None
    return {"rows": out, "strong": strong, "cluster": cluster, "workload": work}


def _record_all(model, setups: dict) -> dict:
    """{(setup key, system): the step recorded as rank 0 of the setup's world size}, each in a
    fresh process (vescale_engine.fake_world), after checking this host has the memory."""
    import dataclasses
    import json
    import subprocess
    import time

    from vescale_engine.plan import capacity
    from vescale_engine.plan.model_plan import fsdp2_unsupported
    records = {}
    for key, setup in setups.items():
        need = capacity.estimate(model, setup)["memory"]
        for system in RECORDED:
            if system == "fsdp2" and fsdp2_unsupported(model, setup.shard_size,
                                                       setup.expert_shard_size):
                continue
            _check_memory(system, setup.world_size, need[system])
            print(f"fake world: recording a step of {system} as rank 0 of "
                  f"{setup.world_size} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            case = {"shapes": model.path, "setup": dataclasses.asdict(setup), "system": system}
            done = subprocess.run([sys.executable, "-m", "vescale_engine.fake_world"],
                                  input=json.dumps(case), capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode:
                lines = done.stderr.strip().splitlines() or ["(no output)"]
                raise capacity.CapacityError(
                    lines[-1] if lines[-1].startswith("fake world:") else
                    f"fake world: recording {system} at {setup.world_size} ranks failed "
                    f"(exit {done.returncode}): {lines[-1]}")
            records[(key, system)] = json.loads(done.stdout)
            print(f"fake world: {system} at {setup.world_size} ranks recorded in "
                  f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return records


def _check_memory(system: str, world: int, memory: dict) -> None:
    """A recorded step holds what rank 0 of `world` would (--memory's estimate, in host
    memory): refuse before starting one this host cannot hold."""
    from vescale_engine.plan.capacity import CapacityError
    need = memory["total"]
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):   # not Linux: nothing to check against
        return
    if need > 0.8 * free:
        raise CapacityError(f"--fake-world: a step of {system} as rank 0 of {world} needs "
                            f"about {need / 1e9:.1f} GB of host memory (--memory's per-rank "
                            f"estimate), {free / 1e9:.1f} GB is free: a larger world size "
                            f"shrinks the shards, not the gathered units; or drop --fake-world "
                            f"(the planner's schedule)")


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
    _print_sources(out)
    print("left out: stragglers, link congestion, kernel tails and host overheads, NCCL "
          "kernels slowing compute; activations' memory (see --memory)")


def _print_sources(out) -> None:
    """With --fake-world: where each system's collectives came from, and whether the recorded
    ones are the planner's."""
    checked = [(w, label, row[name]["schedule"]) for (_, w), row in out.items()
               for name, label in SYSTEMS if "schedule" in row.get(name, {})]
    if not checked:
        return
    differ = [f"{label} at {w}: {c['collectives'][1]} collectives, "
              f"{c['bytes'][1] / 1e9:.3f} GB recorded, {c['collectives'][0]}, "
              f"{c['bytes'][0] / 1e9:.3f} GB planned" for w, label, c in checked
              if not c["same"]]
    print(f"collectives: ours and FSDP2 as recorded on the fake process group "
          f"({checked[0][2]['source'].split(' ', 1)[1].strip('()')}), "
          + ("every one the planner's too" if not differ else
             "unlike the planner's for " + "; ".join(differ))
          + "; ZeRO-3 from DeepSpeed's rules; 'what moves ours' is the planner's")


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
