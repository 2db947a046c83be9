"""Joining and leaving the process group the launcher describes."""
from __future__ import annotations

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist


def join_process_group(timeout_s: float):
    """Join the process group the launcher describes (gloo on CPU, NCCL with CUDA); a rank
    that never joins is a clear error after `timeout_s`, not an endless hang."""
    if dist.is_initialized():
        return
    from launcher.env import LaunchError, discover
    where = discover()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if where.world_size > 1 and (where.master_addr is None or where.master_port is None):
        raise LaunchError(f"{where.launcher} launch without MASTER_ADDR/MASTER_PORT: set them "
                          "or start with `vescale run`, torchrun, mpirun or the deepspeed "
                          "launcher (SLURM: see examples/jobs/slurm_multinode.sbatch)")
    address = f"{where.master_addr}:{where.master_port}"
    try:
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=where.rank,
                                world_size=where.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as err:
        raise LaunchError(f"rank {where.rank} of {where.world_size} ({where.launcher}): the "
                          f"process group at {address} did not form within {timeout_s:g} s "
                          f"({type(err).__name__}); check that every rank started and can "
                          "reach MASTER_ADDR") from None
    if backend == "nccl":
        torch.cuda.set_device(where.local_rank)
    atexit.register(leave_process_group)


def leave_process_group():
    """At exit, wait (briefly) for the other ranks, then tear the group down: a gloo rank that
    exits while a peer still talks to it aborts ("terminate called without an active
    exception")."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        dist.destroy_process_group()
    except (RuntimeError, dist.DistError):
        pass  # a peer is gone: nothing left to coordinate with
