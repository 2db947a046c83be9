"""Where this process sits in the job: rank, local rank, world size and master address, from
whichever launcher started it (torchrun, the deepspeed launcher, Open MPI, MPICH/PMI, SLURM)."""
from __future__ import annotations

import os
from dataclasses import dataclass

# (rank, world size, local rank) variable names per launcher, first match wins.
_LAUNCHERS = (
    ("torchrun/deepspeed", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


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


def discover(env=None) -> Placement:
    """Read the launch environment; a single process with no launcher is rank 0 of 1."""
    env = os.environ if env is None else env
    for name, rank_var, size_var, local_var in _LAUNCHERS:
        if rank_var in env and size_var in env:
            rank, size = _int(env, rank_var), _int(env, size_var)
            local = _int(env, local_var) if local_var in env else 0
            if not 0 <= rank < size:
                raise LaunchError(f"{rank_var}={rank} is outside {size_var}={size}")
            port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
            return Placement(name, rank, size, local, env.get("MASTER_ADDR"), port)
    return Placement("none", 0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"),
                     _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500)


def _int(env, name) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None
