"""Where this process sits in the job: rank, local rank, world size and master address, from
whichever launcher started it (torchrun, the deepspeed launcher, Open MPI, MVAPICH, MPICH/PMI,
SLURM, PMIx). MPI launchers say nothing about a master address: unless MASTER_ADDR is set,
rank 0 shares its own (and a free port) with every rank over MPI."""
from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass, replace

__all__ = ["LaunchError", "Placement", "discover", "set_device_before_mpi"]

# (launcher, rank, world size, local rank) variable names, first match wins: torchrun and the
# deepspeed launcher are checked first because they may run inside an MPI or SLURM job.
_LAUNCHERS = (
    ("torchrun/deepspeed", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
    ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
_MPI_LAUNCHERS = ("Open MPI", "MVAPICH", "MPICH/PMI", "PMIx")


class LaunchError(RuntimeError):
    """The launch environment is incomplete or inconsistent; the message names the variable."""


@dataclass(frozen=True)
class Placement:
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


def discover(env=None, use_mpi: bool | None = None) -> Placement:
    """Read the launch environment; a single process with no launcher is rank 0 of 1.

    `use_mpi` (default: only when reading this process's own environment) lets an MPI rank
    ask MPI what its environment leaves out: the master address and port, and the world size
    and local rank under a PMIx-only launcher (`prterun`), which exports only PMIX_RANK."""
    use_mpi = env is None if use_mpi is None else use_mpi
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    for name, rank_var, size_var, local_var in _LAUNCHERS:
        if rank_var in env and size_var in env:
            rank, size = _int(env, rank_var), _int(env, size_var)
            local = _int(env, local_var) if local_var in env else 0
            if not 0 <= rank < size:
                raise LaunchError(f"{rank_var}={rank} is outside {size_var}={size}")
            where = Placement(name, rank, size, local, env.get("MASTER_ADDR"), port)
            return _with_master_from_mpi(where) if use_mpi else where
    if "PMIX_RANK" in env:
        rank = _int(env, "PMIX_RANK")
        if not use_mpi:
            raise LaunchError(f"PMIX_RANK={rank} without a world size: a PMIx launch is read "
                              "through MPI (mpi4py), or set RANK/WORLD_SIZE/LOCAL_RANK")
        mpi_rank, size, local = _mpi_layout()
        if mpi_rank != rank:
            raise LaunchError(f"PMIX_RANK={rank} but MPI says rank {mpi_rank}")
        where = Placement("PMIx", rank, size, local, env.get("MASTER_ADDR"), port)
        return _with_master_from_mpi(where)
    return Placement("none", 0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"),
                     port if port is not None else 29500)


def _with_master_from_mpi(where: Placement) -> Placement:
    """An MPI job of several ranks without MASTER_ADDR/MASTER_PORT: rank 0 broadcasts its host
    and a free port (MPI is only started in this case: other launchers never load it)."""
    complete = where.master_addr is not None and where.master_port is not None
    if where.launcher not in _MPI_LAUNCHERS or where.world_size == 1 or complete:
        return where
    mpi_rank, size, _ = _mpi_layout()
    if size != where.world_size or mpi_rank != where.rank:
        raise LaunchError(f"{where.launcher} says rank {where.rank} of {where.world_size} but "
                          f"MPI says rank {mpi_rank} of {size}")
    addr, port = _master_from_rank_zero(where.master_addr, where.master_port)
    return replace(where, master_addr=addr, master_port=port)


# Both are asked once per process: they are collectives (every rank must call them, as often
# as the others), while discover() may be called again, by any rank, at any time.
@functools.lru_cache(maxsize=None)
def _mpi_layout() -> tuple:
    """(rank, world size, rank among the ranks on this machine) as MPI sees them."""
    mpi = _mpi()
    world = mpi.COMM_WORLD
    return world.Get_rank(), world.Get_size(), world.Split_type(mpi.COMM_TYPE_SHARED).Get_rank()


@functools.lru_cache(maxsize=None)
def _master_from_rank_zero(known_addr, known_port) -> tuple:
    """Rank 0's host and a free port there (or the parts already known), on every rank."""
    offer = None
    if _mpi_layout()[0] == 0:
        offer = (socket.gethostname(), known_addr or _own_address(), known_port or _free_port())
    host, addr, port = _mpi().COMM_WORLD.bcast(offer, root=0)
    if known_addr is None and host == socket.gethostname():
        addr = "127.0.0.1"  # same machine as rank 0: loopback always reaches it
    return addr, port


def _mpi():
    # CUDA-aware MPI opens a context on the current GPU when it starts: pick this rank's first.
    set_device_before_mpi(os.environ)
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchError("an MPI launch without MASTER_ADDR/MASTER_PORT needs mpi4py to share "
                          "rank 0's address: pip install 'vescale-engine[mpi]', or set "
                          "MASTER_ADDR and MASTER_PORT for every rank") from None
    return MPI


def _own_address() -> str:
    """This machine's address as other machines see it: the hostname's address, or the
    hostname itself when that resolves only to loopback here (a common /etc/hosts entry) and
    may still resolve properly elsewhere."""
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return host
    return host if addr.startswith("127.") else addr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _int(env, name) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def set_device_before_mpi(env) -> None:
    """Under an MPI launcher, make this rank's GPU current before MPI starts (CUDA-aware MPI
    would otherwise open a context on GPU 0 in every rank)."""
    from .device import device_of_rank  # torch: only under an MPI launch
    try:
        where = discover(env, use_mpi=False)  # the launcher's local rank, without MPI
    except LaunchError:
        return  # PMIx alone names no local rank before MPI: set after the group forms
    backend, device = device_of_rank(where, env)
    if backend == "nccl":
        import torch
        torch.cuda.set_device(device)
