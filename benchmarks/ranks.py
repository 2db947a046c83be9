"""Start one benchmark run's ranks as fresh processes and collect what each reports."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    """lscpu's model name, for the header of a CPU benchmark's results."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown CPU"
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines()
             if ln.startswith("Model name:")]
    return names[0] if names else "unknown CPU"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, system: str, world: int, flags: list, timeout_s: float = 3600):
    """Run `script --worker --system SYSTEM --rank R FLAGS` for R < world with torchrun's
    environment (which DeepSpeed and our launcher discovery both read), one thread per rank;
    return each rank's last JSON line, in rank order. A rank that fails before reporting ends
    the benchmark with its error output; one that crashes at exit after reporting (seen once
    in DeepSpeed's teardown: "terminate called without an active exception") keeps its
    results, with a warning."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=ROOT)
        procs.append(subprocess.Popen(
            [sys.executable, script, "--worker", "--system", system, "--rank", str(rank),
             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=timeout_s)
        reports = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode and not reports:
            raise SystemExit(f"{system} rank failed:\n{err[-3000:]}")
        if proc.returncode:
            print(f"warning: {system} rank {rank} exited with status {proc.returncode} after "
                  f"reporting its results (kept): {err.strip().splitlines()[-1:]}",
                  file=sys.stderr, flush=True)
        results.append(json.loads(reports[-1]))
    return results


def alternate(systems, rounds: int, launch, describe, label: str = "") -> dict:
    """Run every system once per round, in turn, so machine noise falls on all of them alike;
    returns {system: [one launch's result per round]} and prints each run as it ends."""
    runs = {s: [] for s in systems}
    width = max(len(s) for s in systems)
    for r in range(rounds):
        for system in systems:
            runs[system].append(launch(system))
            print(f"{label}round {r}: {system:{width}s} {describe(runs[system][-1])}",
                  flush=True)
    return runs


def benchmark_parser(description: str, systems, *, layers: int, dim: int, seq: int,
                     steps: int, timed: bool = True, one_world: bool = True
                     ) -> argparse.ArgumentParser:
    """The flags every GPT benchmark here shares: the worker side (--worker --system --rank,
    set by run_ranks), the rank count (`one_world`: --world), model size, steps; with `timed`,
    the micro-batch, warm-up steps and alternated rounds of a step-time comparison."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=systems, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    if one_world:
        parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--steps", type=int, default=steps)
    if timed:
        parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
        parser.add_argument("--warmup", type=int, default=2)
        parser.add_argument("--rounds", type=int, default=3)
    return parser


def write_report(path: str, lines: list) -> None:
    """Write a benchmark's Markdown report (making its folder) and echo it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
