"""Whole-model planning time at up to 8192 ranks, this planner against an earlier revision.

For every model in examples/models/ and every granularity (rows:1, rows:16, rows:128) at
W = 8192 and a few smaller W: the median of `plan_model(...).plan_seconds` over --repeats
rounds. A round plans every cell once, models alternating, and the rounds alternate the two
planners, so that a busy machine slows every cell alike. "before" is the planner at --baseline
(a git revision, extracted to a temporary directory and run in its own process); "after" is
this tree. Every plan of both is checked against the layout invariants (`verify`), the padding
of the two is compared (after must be equal or lower) and so are the plans themselves. The
slowest cell at the largest W is profiled with cProfile under both. Writes a Markdown report
with the command and the CPU model.

    python benchmarks/plan_speed.py --baseline 22292fd   # writes benchmarks/results/plan_speed.md
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = os.path.join(ROOT, "examples", "models")
BOUND_SECONDS = 0.3          # the paper's planning time; the target at 8192 ranks


def _cells(args):
    models = sorted(f[:-5] for f in os.listdir(MODELS) if f.endswith(".json"))
    return [(m, g, w) for w in args.world_sizes for g in args.granularities for m in models]


# --------------------------------------------------------------------------------------------
# Worker: runs in its own process with one planner on the path, prints JSON.

def worker(args) -> None:
    sys.path.insert(0, args.worker)
    from vescale_engine.plan import model_plan as mp

    models = {}
    out = {}
    for name, gran, world in _cells(args):   # models alternate inside each (W, granularity)
        model = models.setdefault(name, mp.load_shapes(os.path.join(MODELS, f"{name}.json")))
        cpu = time.process_time()
        plan = mp.plan_model(model, world, gran)
        cell = {"seconds": plan.plan_seconds, "cpu": time.process_time() - cpu,
                "padding_ratio": plan.padding_ratio}
        if args.check:
            plan.verify()
            layout = plan.to_json()
            layout.pop("plan_seconds")
            cell["digest"] = hashlib.sha1(json.dumps(layout, sort_keys=True).encode()).hexdigest()
        out[f"{name} {gran} {world}"] = cell
    if args.profile:
        name, gran, world = args.profile.split()
        model = models[name]
        profile = cProfile.Profile()
        profile.runcall(mp.plan_model, model, int(world), gran)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(8)
        out["profile"] = _trim_profile(text.getvalue(), args.worker)
    json.dump(out, sys.stdout)


def _trim_profile(text: str, root: str) -> str:
    lines = [line.replace(root.rstrip("/") + "/", "") for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if "function calls" in line)
    return "\n".join(line for line in lines[start:] if line.strip())


def run_worker(root: str, args, check: bool, profile: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", root,
           "--world-sizes", ",".join(map(str, args.world_sizes)),
           "--granularities", ",".join(args.granularities)]
    cmd += ["--check"] if check else []
    cmd += ["--profile", profile] if profile else []
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout)


def extract(revision: str, into: str) -> str:
    """The planner at `revision` (the vescale_engine package only) in a directory of its own."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision, "vescale_engine"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


# --------------------------------------------------------------------------------------------
# Driver.

def measure(args) -> tuple:
    trees = {"after": ROOT}
    tmp = None
    if args.baseline:
        tmp = tempfile.TemporaryDirectory()
        trees = {"before": extract(args.baseline, tmp.name), "after": ROOT}
    rounds = {tree: [] for tree in trees}
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        for tree in (trees if r % 2 == 0 else reversed(list(trees))):
            rounds[tree].append(run_worker(trees[tree], args, check=r == 0))
            print(f"round {r + 1}/{args.repeats} {tree} done", flush=True)
    medians = {tree: {key: statistics.median(rnd[key]["seconds"] for rnd in rounds[tree])
                      for key in rounds[tree][0]} for tree in trees}
    cpu = {key: statistics.median(rnd[key]["cpu"] for rnd in rounds["after"])
           for key in rounds["after"][0]}
    largest = max(args.world_sizes)
    slowest = {tree: max((k for k in medians[tree] if k.endswith(f" {largest}")),
                         key=medians[tree].get) for tree in trees}
    profiles = {tree: (cell, run_worker(trees[tree], args, False, cell)["profile"])
                for tree, cell in slowest.items()}
    if tmp is not None:
        tmp.cleanup()
    first = {tree: rounds[tree][0] for tree in trees}
    return medians, cpu, first, profiles, load + [os.getloadavg()[0]]


def fmt_s(x: float) -> str:
    return f"{x:.3f}"


def report(args, medians, cpu, first, profiles, load) -> tuple:
    from ranks import cpu_model
    before = "before" in medians
    lines = ["# Whole-model planning time", "",
             "Produced by `" + " ".join(["python benchmarks/plan_speed.py", *sys.argv[1:]])
             + f"` on {cpu_model()}, {os.cpu_count()} CPUs, one process per planner; load "
             f"average {load[0]:.1f} at the start and {load[1]:.1f} at the end (other work "
             "shared the machine: on a quiet one the times are lower).", "",
             f"Median of {args.repeats} rounds of `plan_model(...).plan_seconds` (wall clock); "
             "each round plans every cell once with the models alternating, and the rounds "
             "alternate the two planners." + (f" `before` is the planner at `{args.baseline}`, "
                                             "`after` this tree." if before else "")
             + " `after CPU s` is the CPU time of the same call (the median too), which other "
             "work on the machine disturbs less than the wall clock.",
             "Every plan passed the invariant checker; `same plan` compares the whole layout "
             "(every offset, shard size and local_units) of the two planners.", ""]
    over = worse = 0
    for world in sorted(args.world_sizes, reverse=True):
        target = world == max(args.world_sizes)
        lines += [f"## {world} ranks" + (f" (bound: <= {BOUND_SECONDS} s)" if target else ""), ""]
        head = "| model | granularity | "
        head += ("before s | after s | after CPU s | speed-up | padding before | padding after "
                 "| same plan |") if before else "after s | after CPU s | padding |"
        lines += [head, "|---|---|" + "---:|" * (6 if before else 3) + ("---|" if before else "")]
        for key in [k for k in medians["after"] if k.endswith(f" {world}")]:
            name, gran, _ = key.split()
            after = medians["after"][key]
            pad = first["after"][key]["padding_ratio"]
            over += target and after > BOUND_SECONDS
            if before:
                old, old_pad = medians["before"][key], first["before"][key]["padding_ratio"]
                worse += pad > old_pad
                same = first["before"][key]["digest"] == first["after"][key]["digest"]
                lines.append(f"| {name} | {gran} | {fmt_s(old)} | **{fmt_s(after)}** | "
                             f"{fmt_s(cpu[key])} | {old / after:.1f}x | {100 * old_pad:.3f}% | "
                             f"{100 * pad:.3f}% | {'yes' if same else 'no'} |")
            else:
                lines.append(f"| {name} | {gran} | **{fmt_s(after)}** | {fmt_s(cpu[key])} | "
                             f"{100 * pad:.3f}% |")
        worst = {tree: max(v for k, v in medians[tree].items() if k.endswith(f" {world}"))
                 for tree in medians}
        most_cpu = max(v for k, v in cpu.items() if k.endswith(f" {world}"))
        lines += ["", f"Slowest cell at {world} ranks: **{fmt_s(worst['after'])}** s, "
                      f"**{fmt_s(most_cpu)}** s of CPU"
                  + (f" (before: {fmt_s(worst['before'])} s)" if before else "") + ".", ""]
    for tree, (cell, text) in profiles.items():
        lines += [f"## cProfile, {tree}: {cell}", "", "```", text, "```", ""]
    lines.append(f"Cells over {BOUND_SECONDS} s at {max(args.world_sizes)} ranks: {over}. "
                 f"Cells padding more than before: {worse}.")
    return lines, over, worse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", metavar="REV",
                        help="git revision whose planner is the 'before' column")
    parser.add_argument("--granularities", default="rows:1,rows:16,rows:128",
                        type=lambda s: s.split(","))
    parser.add_argument("--world-sizes", default="8192,2048,1024,256,64",
                        type=lambda s: [int(w) for w in s.split(",")])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "plan_speed.md"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    medians, cpu, first, profiles, load = measure(args)
    lines, over, worse = report(args, medians, cpu, first, profiles, load)
    from ranks import write_report  # benchmarks/: the script's own directory
    write_report(args.out, lines, echo=False)
    print(f"over the bound: {over}; padding worse: {worse}")
    return 1 if over or worse else 0


if __name__ == "__main__":
    sys.exit(main())
