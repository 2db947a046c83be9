"""Joining and leaving the process group the launcher describes, on this rank's device. The
ranks meet on a store made here (launch/rendezvous.py: bounded, one-line errors), and the
group's life ends one of two ways (launch/failfast.py): a clean exit waits for the others at a
barrier; an uncaught exception publishes the failure, skips the barrier and exits, and the
other ranks stop within seconds."""
from __future__ import annotations

import atexit
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import collective_timeout, rendezvous
from .device import NCCL_WITH_CPU, adopt_group_device, device_of_rank
from .env import LaunchError, discover
from .failfast import FailFast
from .settle import settle_at_exit

__all__ = ["join_process_group", "meet_the_others", "leave_process_group"]

EXIT_BARRIER_S = 30  # how long a clean exit waits for the other ranks (gloo)
_fail_fast = [None]  # the FailFast of the group this process created, while it lives


def join_process_group(timeout_s: float, create: bool = True,
                       rendezvous_timeout_s: float | None = None) -> torch.device:
    """Join the process group the launcher describes and return this rank's device: gloo on
    the CPU, or NCCL with gloo for CPU tensors on `cuda:(local_rank % GPUs)`, made current
    *before* the group forms so that NCCL connects eagerly on the right GPU. A group someone
    else created is adopted (its device set and checked). Reaching the store and meeting the
    other ranks is bounded by `rendezvous_timeout_s` (default `timeout_s`), collectives by
    `timeout_s`; either is a one-line error naming the address, not an endless hang."""
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
    meet_s = timeout_s if rendezvous_timeout_s is None else min(timeout_s, rendezvous_timeout_s)
    nccl = backend == "nccl"
    if nccl:
        torch.cuda.set_device(device)
    store, fail_fast = meet_the_others(where, address, meet_s)
    for connection in (store, fail_fast.store if fail_fast else None):
        if connection is not None:  # made with the rendezvous' time left: now the group's
            connection.set_timeout(timedelta(seconds=timeout_s))
    try:
        dist.init_process_group(NCCL_WITH_CPU if nccl else "gloo", store=store,
                                rank=where.rank, world_size=where.world_size,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=device if nccl else None)
    except (RuntimeError, dist.DistError) as err:
        why = (str(err).strip().splitlines() or [""])[0][:200]  # NCCL's reason, e.g. a shared GPU
        raise LaunchError(f"rank {where.rank} of {where.world_size} ({where.launcher}) on "
                          f"{device}: the process group at {address} did not form within "
                          f"{timeout_s:g} s ({type(err).__name__}: {why}); check that every "
                          "rank started and can reach MASTER_ADDR") from None
    if fail_fast is not None:
        fail_fast.locate = collective_timeout.location
        fail_fast.install()
    _fail_fast[0] = fail_fast
    collective_timeout.record_group(timeout_s, fail_fast)
    settle_at_exit()  # registered first, so it runs after the exit barrier below
    atexit.register(leave_process_group, device)
    return device


def meet_the_others(where, address: str, timeout_s: float):
    """(the group's store, its FailFast or None): one process alone needs no network; ranks
    meet on the TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 serves it unless torchrun's agent
    does) and keep a second connection for the failure flag."""
    if where.world_size == 1:
        return dist.HashStore(), None
    agent = rendezvous.uses_agent_store()
    prefix = rendezvous.job_prefix()
    rendezvous.next_join()
    host, port = where.master_addr, where.master_port
    deadline = time.monotonic() + timeout_s  # one limit for all three steps

    def left():
        return max(0.1, deadline - time.monotonic())
    store = rendezvous.connect_store(host, port, where.world_size,
                                     where.rank == 0 and not agent, timeout_s)
    control = rendezvous.connect_store(host, port, where.world_size, False, left())
    rendezvous.meet(control, where, address, left(), prefix, limit_s=timeout_s)
    return store, FailFast(control, prefix, where.rank, where.world_size,
                           rank0_hosts_store=not agent, address=address)


def leave_process_group(device: torch.device):
    """At exit. After an uncaught exception (this rank's): no barrier, the failure published,
    the process ends at once (failfast). Otherwise wait (briefly) for the other ranks, then
    tear the group down: a rank that exits while a peer still talks to it aborts ("terminate
    called without an active exception"); NCCL's barrier runs on this rank's GPU."""
    fail_fast, _fail_fast[0] = _fail_fast[0], None
    if fail_fast is not None and (fail_fast.failure is not None or hasattr(sys, "last_value")):
        fail_fast.exit_after_failure()  # does not return
    try:
        if not dist.is_initialized():
            return  # the script destroyed it
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.monitored_barrier(timeout=timedelta(seconds=EXIT_BARRIER_S))
        dist.destroy_process_group()
    except (RuntimeError, dist.DistError):
        pass  # a peer is gone: nothing left to coordinate with
    finally:
        if fail_fast is not None:
            fail_fast.uninstall()
