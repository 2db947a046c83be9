"""`vescale run`: start the ranks of a training script.

- local (default): N ranks on this machine with the environment torchrun would give them,
  each output line prefixed with its rank, every rank stopped as soon as one fails (the rank
  that failed first is named with its exception line; the exit status is its own); on CPU
  each rank is bound to its own cores, a CUDA rank to its GPU's NUMA node (at most one rank
  per GPU).
- mpi: one `mpirun` command line (Open MPI), over a hostfile for several machines.
- deepspeed: one `deepspeed` launcher command line, over a hostfile for several machines.

SIGTERM/SIGINT/SIGHUP are passed on to the ranks (or to the processes mpirun / deepspeed
started here), which get `--stop-grace-s` to exit before what is left is killed; the exit
status is then 128 + the signal. What is started dies with `vescale run` (launcher/processes.py).

`--nproc N` is always ranks per machine (torchrun's --nproc_per_node, DeepSpeed's --num_gpus);
with a hostfile and no --nproc, each host runs its `slots` ranks.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from launcher import binding as cpu
from launcher import gpu_binding as gpu
from launcher.hostfile import Host, is_local, read_hostfile, write_hostfile
from launcher.processes import (Child, SessionWatcher, describe_status, received_signals,
                                signal_name)

LAUNCHERS = ("local", "mpi", "deepspeed")
DEFAULT_PORT = 29500
# How long ranks get to exit after the stop signal is passed on (--stop-grace-s): long enough
# for an opt-in preemption save to finish the step and write a checkpoint.
DEFAULT_STOP_GRACE_S = 30.0
# After a rank fails, the others get at most this long: without it no step or checkpoint
# can complete.
FAILURE_GRACE_S = 5.0
# Variables every MPI rank needs even on a machine mpirun reaches over ssh (Open MPI only
# passes on what -x names); NCCL_*/VESCALE_* tuning travels too.
_FORWARDED = ("PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")
_FORWARDED_PREFIXES = ("NCCL_", "VESCALE_", "TORCH_")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_script(argv):
    if not argv or not os.path.exists(argv[0]):
        raise ValueError(f"script not found: {argv[0] if argv else '(none)'}")


def launch(launcher: str, nproc: int | None, hostfile: str | None, argv: list,
           threads_per_rank: int | None = None, bind_cores: bool = True,
           out=sys.stdout, stop_grace_s: float = DEFAULT_STOP_GRACE_S) -> int:
    """`vescale run`: check everything, then start the job; returns its exit status."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be positive, got {nproc}")
    if not stop_grace_s >= 0:
        raise ValueError(f"--stop-grace-s must be a number of seconds >= 0, got {stop_grace_s}")
    _check_script(argv)
    if launcher == "local":
        if hostfile:
            raise ValueError("--hostfile needs --launcher mpi or --launcher deepspeed (the local "
                             "launcher starts ranks on this machine only)")
        return run_local(nproc or 1, argv, threads_per_rank, out, bind_cores, stop_grace_s)
    hosts = _hosts(hostfile, nproc)
    with _hostfile_for(hosts, hostfile) as path:
        if launcher == "mpi":
            cmd = mpi_command(argv, hosts, path, threads_per_rank or _threads_guess(hosts),
                              os.environ, as_root=os.geteuid() == 0,
                              usable_cores=len(cpu.usable_cores()),
                              gpu_ranks=gpu_ranks(os.environ), numa_nodes=gpu.numa_node_count())
            return _run_job(cmd, out, stop_grace_s=stop_grace_s,
                            forward_to_children=_single_machine(hosts))
        # The deepspeed launcher passes its environment on to the ranks (on CPU it leaves the
        # thread count to them, and every rank would use every core).
        threads = str(threads_per_rank or _threads_guess(hosts))
        return _run_job(deepspeed_command(argv, hosts, path, os.environ), out,
                        {"OMP_NUM_THREADS": threads}, stop_grace_s, _single_machine(hosts))


def _hosts(hostfile, nproc) -> list:
    """The machines and ranks per machine: the hostfile's (with --nproc overriding every
    host's slots), or this machine alone."""
    if hostfile is None:
        return [Host("localhost", nproc or 1)]
    hosts = read_hostfile(hostfile)
    return [Host(h.name, nproc) for h in hosts] if nproc else hosts


def _single_machine(hosts) -> bool:
    return len(hosts) == 1 and is_local(hosts[0].name)


def _threads_guess(hosts) -> int:
    """OMP_NUM_THREADS for MPI ranks: this machine's cores split over its ranks (the other
    machines are assumed alike; --threads-per-rank says otherwise)."""
    return max(1, len(cpu.usable_cores()) // max(h.slots for h in hosts))


def _master(hosts, env) -> tuple:
    """Where the process group meets: MASTER_ADDR/MASTER_PORT when set; otherwise this machine
    on a free port, or the first host on the default port (no way to probe a remote port)."""
    single = _single_machine(hosts)
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if single else hosts[0].name)
    port = env.get("MASTER_PORT") or str(_free_port() if single else DEFAULT_PORT)
    return addr, port


def mpi_command(argv, hosts, hostfile, threads, env, as_root, usable_cores,
                mpirun=None, python=sys.executable, gpu_ranks=False, numa_nodes=1) -> list:
    """The `mpirun` (Open MPI) command line. `hostfile` is the Open MPI-format file naming
    `hosts` (None when the job stays on this machine). Other machines are assumed to have
    this one's cores and NUMA nodes."""
    addr, port = _master(hosts, env)
    total = sum(h.slots for h in hosts)
    cmd = [mpirun or _tool("mpirun"), "-n", str(total)]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    if as_root:
        cmd.append("--allow-run-as-root")  # Open MPI refuses root without it
    if _single_machine(hosts) and total > usable_cores:
        # Otherwise Open MPI refuses more ranks than cores (or, with a hostfile's slots, to
        # bind them); oversubscribed, it leaves the ranks unbound.
        cmd.append("--oversubscribe")
    cmd += mpi_placement(hosts, threads, usable_cores, gpu_ranks, numa_nodes)
    exported = {"MASTER_ADDR": addr, "MASTER_PORT": port, "OMP_NUM_THREADS": str(threads),
                "PYTHONUNBUFFERED": "1"}
    exported.update({k: v for k, v in env.items()
                     if k in _FORWARDED or k.startswith(_FORWARDED_PREFIXES)})
    for name, value in exported.items():
        cmd += ["-x", f"{name}={value}"]
    return [*cmd, python, *argv]


def mpi_placement(hosts, threads, usable_cores, gpu_ranks, numa_nodes) -> list:
    """--map-by/--bind-to. GPU ranks fill the NUMA nodes in turn and are bound to theirs: the
    engine gives local rank r GPU r, and GPU r sits on NUMA node r // (GPUs per node) on
    DGX/HGX-style machines (`vescale run` reads the real placement from sysfs). CPU ranks get
    `threads` cores each; ranks that would not fit are left unbound."""
    slots = {h.slots for h in hosts}
    if gpu_ranks:
        if len(slots) == 1 and next(iter(slots)) % numa_nodes == 0:
            return ["--map-by", f"ppr:{next(iter(slots)) // numa_nodes}:numa", "--bind-to", "numa"]
        return ["--map-by", "slot", "--bind-to", "none"]
    if max(slots) * threads > usable_cores:
        return ["--bind-to", "none"]
    return ["--map-by", f"slot:PE={threads}", "--bind-to", "core"]


def deepspeed_command(argv, hosts, hostfile, env, deepspeed=None) -> list:
    """The `deepspeed` launcher command line."""
    cmd = [deepspeed or _tool("deepspeed")]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    if len({h.slots for h in hosts}) == 1:
        # Ranks per host. Needed without a hostfile (on CPU DeepSpeed finds no accelerators to
        # count); with hosts of different sizes the hostfile's slots say it instead.
        cmd += ["--num_gpus", str(hosts[0].slots)]
    if _single_machine(hosts):
        # DeepSpeed starts a one-host job here without ssh, but would first ssh to the host to
        # check it and to ask its address; say both.
        addr, port = _master(hosts, env)
        cmd += ["--no_ssh_check", "--master_addr", addr, "--master_port", port]
    else:
        if len(hosts) == 1:
            cmd.append("--force_multi")  # else DeepSpeed runs a lone remote host's ranks here
        if env.get("MASTER_ADDR"):
            cmd += ["--master_addr", env["MASTER_ADDR"]]  # else DeepSpeed asks the first host
        cmd += ["--master_port", env.get("MASTER_PORT", str(DEFAULT_PORT))]
    return [*cmd, *argv]


def _tool(name) -> str:
    """A launcher executable: on PATH, or next to this Python (an unactivated venv)."""
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if not found:
        hint = "pip install 'vescale-engine[mpi]'" if name == "mpirun" else "pip install deepspeed"
        raise ValueError(f"{name} not found on PATH ({hint})")
    return found


@contextlib.contextmanager
def _hostfile_for(hosts, user_hostfile):
    """The hostfile handed to the launcher, in the `HOST slots=N` form both read: a temporary
    copy of the user's (which may be in MPICH's form, or have its slots overridden by
    --nproc); none when the user gave none."""
    if not user_hostfile:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="vescale-run-") as tmpdir:
        path = os.path.join(tmpdir, "hostfile")
        write_hostfile(hosts, path)
        yield path


def _run_job(cmd, out, extra_env=None, stop_grace_s=DEFAULT_STOP_GRACE_S,
             forward_to_children=True) -> int:
    """Run one launcher (mpirun, deepspeed) in its own session; it supervises its ranks and
    its status is the job's. A stop signal goes to its children on this machine (mpirun's
    ranks, deepspeed's launch.py; `forward_to_children`), else to the launcher itself; after
    `stop_grace_s` everything left in its session is killed."""
    extra_env = extra_env or {}
    shown = " ".join(f"{k}={v}" for k, v in extra_env.items())
    print(f"vescale run: {shown + ' ' if shown else ''}{shlex.join(cmd)}", file=out, flush=True)
    with received_signals() as received, SessionWatcher() as watcher:
        # Parent death: SIGTERM, which mpirun passes on to its ranks before it exits.
        child = Child(cmd, {**os.environ, **extra_env}, death_signal=signal.SIGTERM)
        watcher.watch(child.pid)
        while not child.wait_exit(0.05):
            if received:
                return _stop_job(child, received, stop_grace_s, forward_to_children, out)
        child.kill_session()
        return child.reap()


def _stop_job(child, received, grace_s, forward_to_children, out) -> int:
    signum = received[0]
    # mpirun's own SIGTERM kills its ranks within a second, and DeepSpeed's runner does not
    # pass signals on for a one-machine job: the processes it started get the signal instead.
    targets = (child.children() if forward_to_children else []) or [child.pid]
    print(f"vescale run: got {signal_name(signum)}; passing it to pid(s) "
          f"{', '.join(map(str, targets))} and waiting up to {grace_s:g} s (--stop-grace-s)",
          file=out, flush=True)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    _wait_until(lambda: child.exited(), grace_s, received)
    if not child.exited():
        print(f"vescale run: the job is still running after {grace_s:g} s: SIGKILL",
              file=out, flush=True)
    child.kill_session()
    child.reap()
    return 128 + signum


def _wait_until(done, timeout_s, received):
    """Until done(), timeout_s, or a further stop signal (a second Ctrl-C: stop waiting)."""
    seen = len(received)
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline and len(received) == seen:
        time.sleep(0.05)


# torch.distributed's excepthook prefixes every line of an uncaught exception's traceback.
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")


class _RankOutput:
    """One rank's output lines, and its last Python traceback: when it began (the launcher's
    clock) and its exception line (the first line after the frames, "ValueError: ...")."""

    def __init__(self, prefix):
        self.prefix = prefix
        self.traceback_at = None
        self.exception = None
        self.in_frames = False

    def note(self, line):
        text = _TORCH_RANK_PREFIX.sub("", line.rstrip("\n"), count=1)
        if text.endswith("Traceback (most recent call last):"):
            self.traceback_at = time.monotonic()
            self.in_frames = True
        elif self.in_frames and text and not text[0].isspace():
            self.exception = text
            self.in_frames = False


class _JobTracebacks:
    """Which rank's traceback the job shows: the first to start one. The others' tracebacks
    (the same error raised on every rank, or a collective broken by the first) shrink to their
    exception line."""

    def __init__(self):
        self.shown_by = None


def _pump(stream, output, out, lock, tracebacks):
    hidden = 0
    for line in iter(stream.readline, ""):
        in_frames = output.in_frames
        output.note(line)
        text = _TORCH_RANK_PREFIX.sub("", line, count=1)  # one prefix: ours
        with lock:
            if output.in_frames and not in_frames:  # a traceback starts
                if tracebacks.shown_by is None:
                    tracebacks.shown_by = output
            if tracebacks.shown_by is not output and (output.in_frames or in_frames):
                if output.in_frames:
                    hidden += 1
                    continue
                text = f"{text.rstrip()} (traceback of {hidden} lines not shown: " \
                    f"{tracebacks.shown_by.prefix.strip()} showed one)\n"
                hidden = 0
            out.write(f"{output.prefix}{text}")
            out.flush()
    stream.close()


def _local_plan(nproc, threads_per_rank, bind_cores, out):
    """Per-rank core sets (None: not bound) and thread count; prints what was detected and
    chosen as the run's first lines."""
    usable = cpu.usable_cores()
    processor = cpu.detect_processor()
    gpu_plan = None
    if gpu_ranks(os.environ):  # checked even unbound: more ranks than GPUs cannot run
        bus_ids = gpu.gpu_bus_ids()
        gpu_plan = gpu.plan_gpu_binding(nproc, bus_ids, usable, threads=threads_per_rank)
    if bind_cores and gpu_plan is not None:
        print(f"vescale run: {processor.brand}, {processor.logical_cores} logical cores, "
              f"{len(usable)} usable [{cpu.core_ranges(usable)}]; {len(bus_ids)} GPU(s)",
              file=out, flush=True)
        for line in gpu.describe(bus_ids, gpu_plan):
            print(line, file=out, flush=True)
        return gpu_plan.cores, gpu_plan.threads
    if bind_cores:
        plan = cpu.plan_binding(nproc, usable, threads_per_rank)
        for line in cpu.describe(processor, usable, plan):
            print(line, file=out, flush=True)
        return plan.cores, plan.threads
    threads = threads_per_rank or max(1, len(usable) // nproc)
    print(f"vescale run: {processor.brand}, {processor.logical_cores} logical cores, "
          f"{len(usable)} usable; no core binding (--no-bind-cores); OMP_NUM_THREADS={threads}",
          file=out, flush=True)
    return [None] * nproc, threads


def gpu_ranks(env) -> bool:
    """Will the ranks use NCCL on GPUs? The engine's own choice (VESCALE_BACKEND, else CUDA)."""
    import torch
    from vescale_engine.launch.device import choose_backend
    return choose_backend(env, torch.cuda.is_available()) == "nccl"


def run_local(nproc: int, argv: list, threads_per_rank: int | None = None,
              out=sys.stdout, bind_cores: bool = True,
              stop_grace_s: float = DEFAULT_STOP_GRACE_S) -> int:
    """Run `python argv...` as ranks 0..nproc-1; returns the job's exit status."""
    if nproc < 1:
        raise ValueError(f"--nproc must be positive, got {nproc}")
    _check_script(argv)
    cores, threads = _local_plan(nproc, threads_per_rank, bind_cores, out)
    port = _free_port()
    lock = threading.Lock()
    tracebacks = _JobTracebacks()
    ranks = []
    with received_signals() as received, SessionWatcher() as watcher:
        try:
            for rank in range(nproc):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
                if cores[rank] is None:
                    ranks.append(_Rank(rank, argv, env, out, lock, tracebacks))
                else:
                    with cpu.bound_to(cores[rank]):
                        ranks.append(_Rank(rank, argv, env, out, lock, tracebacks))
                watcher.watch(ranks[-1].child.pid)
        except BaseException:
            _finish(ranks)  # none outlives a launcher that could not start them all
            raise
        return _supervise(ranks, received, stop_grace_s, lock, out)


class _Rank:
    """A local rank: its process (own session, killed if the launcher dies) and output."""

    def __init__(self, rank, argv, env, out, lock, tracebacks):
        self.rank = rank
        self.child = Child([sys.executable, *argv], env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        self.output = _RankOutput(f"[rank{rank}] ")
        self.pump = threading.Thread(target=_pump, daemon=True,
                                     args=(self.child.proc.stdout, self.output, out, lock,
                                           tracebacks))
        self.pump.start()

    def describe(self) -> str:
        return f"rank {self.rank} {describe_status(self.child.status, self.child.killed)}"


def _supervise(ranks, received, grace_s, lock, out) -> int:
    def say(line):
        with lock:
            out.write(f"vescale run: {line}\n")
            out.flush()

    while True:
        if received:
            return _stop_on_signal(ranks, received, grace_s, say)
        failed = [r for r in ranks if r.child.exited() and r.child.status != 0]
        if failed:
            return _stop_on_failure(ranks, failed, received, grace_s, say)
        if all(r.child.exited() for r in ranks):
            _finish(ranks)
            return 0
        time.sleep(0.05)


def _stop_on_signal(ranks, received, grace_s, say) -> int:
    signum = received[0]
    live = [r for r in ranks if not r.child.exited()]
    say(f"got {signal_name(signum)}; passing it to rank(s) "
        f"{', '.join(str(r.rank) for r in live) or '(none left)'} and waiting up to "
        f"{grace_s:g} s (--stop-grace-s)")
    for r in live:
        r.child.send(signum)
    _wait_until(lambda: all(r.child.exited() for r in ranks), grace_s, received)
    left = [r for r in ranks if not r.child.exited()]
    if left:
        say(f"rank(s) {', '.join(str(r.rank) for r in left)} still running: SIGKILL")
    _finish(ranks)
    return 128 + signum


def _stop_on_failure(ranks, failed, received, grace_s, say) -> int:
    seen = min(failed, key=lambda r: r.child.exited_at)
    say(f"{seen.describe()}; stopping the other ranks")
    stopped_at = time.monotonic()
    for r in ranks:
        r.child.send(signal.SIGTERM)
    # The others cannot finish a step or a checkpoint without the failed rank: a short grace.
    _wait_until(lambda: all(r.child.exited() for r in ranks), min(grace_s, FAILURE_GRACE_S),
                received)
    _finish(ranks)
    first = _first_failure(ranks, stopped_at) or seen
    failed_itself = _failed_before(first, stopped_at)
    if not failed_itself:
        how = "stopped by vescale run after its traceback"
    elif first.child.killed:
        how = f"killed by {signal_name(first.child.status - 128)}, status {first.child.status}"
    else:
        how = f"exit status {first.child.status}"
    say(f"rank {first.rank} failed first: {first.output.exception or 'no Python traceback'} "
        f"({how})")
    return first.child.status if failed_itself else seen.child.status


def _failed_before(rank, stopped_at) -> bool:
    """Did the rank exit nonzero by itself, before the launcher stopped the others?"""
    return (rank.child.exited_at is not None and rank.child.exited_at <= stopped_at
            and rank.child.status != 0)


def _first_failure(ranks, stopped_at):
    """The rank that failed first, by the launcher's clock: the earlier of its own failing
    exit (before the launcher stopped the others) and the start of its last traceback, among
    the ranks that did not exit 0. A rank that raised may exit after one that it made fail
    (teardown takes time), so exit order alone would blame the wrong one."""
    def failed_at(r):
        times = [r.output.traceback_at]
        if _failed_before(r, stopped_at):
            times.append(r.child.exited_at)
        times = [t for t in times if t is not None]
        return min(times) if times else None

    found = [(failed_at(r), r.rank, r) for r in ranks
             if r.child.status != 0 and failed_at(r) is not None]
    return min(found)[2] if found else None


def _finish(ranks):
    """Kill whatever is left in the ranks' sessions, reap them, and drain their output."""
    for r in ranks:
        r.child.kill_session()
    for r in ranks:
        r.child.reap()
    for r in ranks:
        r.pump.join(timeout=5)
