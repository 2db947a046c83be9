"""`vescale run`: start the ranks of a training script.

- local (default): N ranks on this machine with the environment torchrun would give them,
  each output line prefixed with its rank, every rank stopped as soon as one fails (the exit
  status is then that rank's); on CPU each rank is bound to its own cores, a CUDA rank to
  its GPU's NUMA node (at most one rank per GPU).
- mpi: one `mpirun` command line (Open MPI), over a hostfile for several machines.
- deepspeed: one `deepspeed` launcher command line, over a hostfile for several machines.

`--nproc N` is always ranks per machine (torchrun's --nproc_per_node, DeepSpeed's --num_gpus);
with a hostfile and no --nproc, each host runs its `slots` ranks.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from launcher import binding as cpu
from launcher import gpu_binding as gpu
from launcher.hostfile import Host, is_local, read_hostfile, write_hostfile

LAUNCHERS = ("local", "mpi", "deepspeed")
DEFAULT_PORT = 29500
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
           out=sys.stdout) -> int:
    """`vescale run`: check everything, then start the job; returns its exit status."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be positive, got {nproc}")
    _check_script(argv)
    if launcher == "local":
        if hostfile:
            raise ValueError("--hostfile needs --launcher mpi or --launcher deepspeed (the local "
                             "launcher starts ranks on this machine only)")
        return run_local(nproc or 1, argv, threads_per_rank, out, bind_cores)
    hosts = _hosts(hostfile, nproc)
    with _hostfile_for(hosts, hostfile) as path:
        if launcher == "mpi":
            cmd = mpi_command(argv, hosts, path, threads_per_rank or _threads_guess(hosts),
                              os.environ, as_root=os.geteuid() == 0,
                              usable_cores=len(cpu.usable_cores()),
                              gpu_ranks=gpu_ranks(os.environ), numa_nodes=gpu.numa_node_count())
            return _run_job(cmd, out)
        # The deepspeed launcher passes its environment on to the ranks (on CPU it leaves the
        # thread count to them, and every rank would use every core).
        threads = str(threads_per_rank or _threads_guess(hosts))
        return _run_job(deepspeed_command(argv, hosts, path, os.environ), out,
                        {"OMP_NUM_THREADS": threads})


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


def _run_job(cmd, out, extra_env=None) -> int:
    extra_env = extra_env or {}
    shown = " ".join(f"{k}={v}" for k, v in extra_env.items())
    print(f"vescale run: {shown + ' ' if shown else ''}{shlex.join(cmd)}", file=out, flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **extra_env})
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the launcher got the same Ctrl-C: let it stop its ranks
        proc.wait()
        return 130


def _pump(stream, prefix, out, lock):
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"{prefix}{line}")
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
              out=sys.stdout, bind_cores: bool = True) -> int:
    """Run `python argv...` as ranks 0..nproc-1; returns the job's exit status."""
    if nproc < 1:
        raise ValueError(f"--nproc must be positive, got {nproc}")
    _check_script(argv)
    cores, threads = _local_plan(nproc, threads_per_rank, bind_cores, out)
    port = _free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        if cores[rank] is None:
            proc = _start(argv, env)
        else:
            with cpu.bound_to(cores[rank]):
                proc = _start(argv, env)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[rank{rank}] ", out, lock),
                                daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                with lock:
                    out.write(f"vescale run: rank {procs.index(failed[0])} exited with "
                              f"status {status}; stopping the other ranks\n")
                _stop(procs)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    for pump in pumps:
        pump.join(timeout=5)
    codes = [p.wait() for p in procs]
    return status or next((c for c in codes if c), 0)


def _start(argv, env):
    return subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _stop(procs, grace_s: float = 5.0):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
