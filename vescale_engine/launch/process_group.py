"""Joining and leaving the process group the launcher describes, on this rank's device."""
from __future__ import annotations

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist

from .device import NCCL_WITH_CPU, adopt_group_device, device_of_rank
from .env import LaunchError, discover


def join_process_group(timeout_s: float, create: bool = True) -> torch.device:
    """Join the process group the launcher describes and return this rank's device: gloo on
    the CPU, or NCCL with gloo for CPU tensors on `cuda:(local_rank % GPUs)`, made current
    *before* the group forms so that NCCL connects eagerly on the right GPU. A group someone
    else created is adopted (its device set and checked). A rank that never joins is a clear
    error after `timeout_s`, not an endless hang."""
    where = discover()
    if dist.is_initialized():
        return adopt_group_device(where)
    if not create:
        raise LaunchError("dist_init_required=False but no process group exists: call "
                          "dist.init_process_group (or deepspeed.init_distributed) first")
    backend, device = device_of_rank(where)
    if where.world_size > 1 and (where.master_addr is None or where.master_port is None):
        raise LaunchError(f"{where.launcher} launch without MASTER_ADDR/MASTER_PORT: set them "
                          "or start with `vescale run`, torchrun, mpirun or the deepspeed "
                          "launcher (SLURM: see examples/jobs/slurm_multinode.sbatch)")
    address = f"{where.master_addr}:{where.master_port}"
    nccl = backend == "nccl"
    if nccl:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(NCCL_WITH_CPU if nccl else "gloo",
                                init_method=f"tcp://{address}", rank=where.rank,
                                world_size=where.world_size, timeout=timedelta(seconds=timeout_s),
                                device_id=device if nccl else None)
    except (RuntimeError, dist.DistError) as err:
        why = (str(err).strip().splitlines() or [""])[0][:200]  # NCCL's reason, e.g. a shared GPU
        raise LaunchError(f"rank {where.rank} of {where.world_size} ({where.launcher}) on "
                          f"{device}: the process group at {address} did not form within "
                          f"{timeout_s:g} s ({type(err).__name__}: {why}); check that every "
                          "rank started and can reach MASTER_ADDR") from None
    atexit.register(leave_process_group, device)
    return device


def leave_process_group(device: torch.device):
    """At exit, wait (briefly) for the other ranks, then tear the group down: a rank that
    exits while a peer still talks to it aborts ("terminate called without an active
    exception"); NCCL's barrier runs on this rank's GPU (not whichever is current)."""
    if not dist.is_initialized():
        return
    try:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        dist.destroy_process_group()
    except (RuntimeError, dist.DistError):
        pass  # a peer is gone: nothing left to coordinate with
