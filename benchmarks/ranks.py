"""What the benchmarks share: starting one run's ranks (or one worker) as fresh processes and
collecting what each reports, alternating systems over rounds, the common flags, the RSS probe,
the header facts (command, code version, CPU) and the report writer."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys

import vescale_engine  # noqa: E402,F401  (see below)

# Every benchmark process, whatever system it runs, exits as ours do: after gloo's worker
# threads (torch 2.13 can otherwise abort a process at exit: vescale_engine/launch/settle.py).
# The same for every system, and outside every measurement.
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


def command_line(script: str, env_keys=()) -> str:
    """The command that reproduces this run, for a report's header: `python benchmarks/X.py
    ARGS` (shell-quoted), preceded by those of `env_keys` that are set (`K=V ...`)."""
    env = "".join(f"{k}={os.environ[k]} " for k in env_keys if k in os.environ)
    return env + " ".join(shlex.quote(a) for a in
                          ["python", os.path.relpath(os.path.abspath(script), ROOT),
                           *sys.argv[1:]])


def git_describe() -> str:
    """`git describe --always --dirty` of the repository, or "unknown"."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# RSS probe (Linux /proc): a peak of this process's resident memory over a stretch of work is
# peak() after reset_peak(), minus the baseline reset_peak() returns.

def status_kb(key: str) -> int:
    """One field of /proc/self/status in kB (VmRSS: resident now, VmHWM: its high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss() -> int:
    """This process's resident memory now, in bytes."""
    return status_kb("VmRSS") * 1024


def reset_peak() -> int:
    """Reset VmHWM to the current RSS (write 5 to /proc/self/clear_refs); return the RSS in
    bytes, the baseline. Raises where the kernel does not allow it or it did not take."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        raise RuntimeError(f"cannot reset VmHWM (/proc/self/clear_refs): {e}") from None
    if status_kb("VmHWM") > status_kb("VmRSS") + 1024:
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): VmHWM stayed above VmRSS")
    return rss()


def peak() -> int:
    """VmHWM in bytes: the largest RSS since the last reset_peak()."""
    return status_kb("VmHWM") * 1024


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the one helper for benchmarks/;
    tests/ have dist_harness.free_port, launcher/ its own for `vescale run`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, system: str, world: int, flags: list, timeout_s: float = 3600,
              device: str = "cpu"):
    """Run `script --worker --system SYSTEM --rank R FLAGS` for R < world with torchrun's
    environment (which DeepSpeed and our launcher discovery both read), one thread per rank;
    return each rank's last JSON line, in rank order. A rank that fails before reporting ends
    the benchmark with its error output; one that crashes at exit after reporting (seen once
    in DeepSpeed's teardown: "terminate called without an active exception") keeps its
    results, with a warning. DeepSpeed runs on its CPU accelerator unless `device` is cuda."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=ROOT)
        if device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
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


def run_one(script: str, argv: list, timeout: float, env: dict | None = None) -> dict:
    """Run `python SCRIPT ARGV` from the repository root in one fresh process (the environment
    plus `env`); return its last JSON line, or {"error": the last lines of its output} when it
    fails or reports nothing."""
    proc = subprocess.run([sys.executable, os.path.abspath(script), *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not reports:
        return {"error": "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])}
    return json.loads(reports[-1])


def worst_rank_median(runs, key):
    """Median over rounds (runs: one list of rank rows per round) of the largest value over
    ranks."""
    return statistics.median(max(r[key] for r in rows) for rows in runs)


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


def add_worker_flags(parser: argparse.ArgumentParser, systems=None) -> None:
    """The hidden flags run_ranks starts each rank with: --worker --system SYSTEM --rank R."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=systems, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)


def benchmark_parser(description: str, systems, *, layers: int, dim: int, seq: int,
                     steps: int, timed: bool = True, one_world: bool = True
                     ) -> argparse.ArgumentParser:
    """The flags every GPT benchmark here shares: the worker side (--worker --system --rank,
    set by run_ranks), the rank count (`one_world`: --world), model size, steps; with `timed`,
    the micro-batch, warm-up steps and alternated rounds of a step-time comparison."""
    parser = argparse.ArgumentParser(description=description)
    add_worker_flags(parser, systems)
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


def loss_chart(runs: dict, path: str, title: str) -> None:
    """One PNG of every system's per-step loss curve ({system: {"losses": [...]}})."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for system, run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=system, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def example_setup(args) -> tuple:
    """(config, data, model) of the training example at the benchmark's size: the example's
    config (examples/configs/vescale_default.json) with its schedule over `args.steps` and no
    progress lines, the Tiny Shakespeare characters as token ids, and the example's GPT of
    `args.layers` x `args.dim` over `args.seq` tokens built with seed 0 (in a worker)."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt_model import GPT, GPTConfig
    with open(os.path.join(ROOT, "examples", "configs", "vescale_default.json")) as f:
        config = json.load(f)
    config["scheduler"]["params"]["total_num_steps"] = args.steps
    config["scheduler"]["params"]["warmup_num_steps"] = max(1, args.steps // 10)
    config["steps_per_print"] = 10 ** 6
    with open(os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt"),
              encoding="utf-8") as f:
        text = f.read()
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(index), block_size=args.seq, n_layer=args.layers,
                          n_head=max(1, args.dim // 32), n_embd=args.dim))
    return config, data, model


def write_report(path: str, lines: list, echo: bool = True) -> None:
    """Write a benchmark's Markdown report, one line per item (making its folder); echo it
    (`echo`) and say where it went."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))
    print(f"written to {path}")
