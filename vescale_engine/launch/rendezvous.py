"""How the ranks meet before the process group forms: the job's key-value store (a TCPStore at
MASTER_ADDR:MASTER_PORT, hosted by rank 0, or by torchrun's agent) and a join check on it. Both
are bounded by one deadline and fail with one line naming the address: a port that accepts and
never answers, two jobs on one port, two ranks with one RANK, and ranks that disagree on
WORLD_SIZE are errors within the rendezvous timeout, not hangs."""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from .env import LaunchError

__all__ = ["uses_agent_store", "job_prefix", "next_join", "connect_store", "meet"]

_JOINS = [0]  # groups this process joined: each join has keys of its own on a lasting store


def uses_agent_store(env=None) -> bool:
    """torchrun's agent hosts the store at MASTER_PORT for its workers (as torch's tcp://
    rendezvous reads it): then every rank is a client, rank 0 included."""
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def job_prefix(env=None) -> str:
    """The keys of this join. The agent's store outlives a restarted worker group, and a
    process may join more than once: both get fresh keys."""
    env = os.environ if env is None else env
    return f"vescale/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_JOINS[0]}/"


def next_join():
    _JOINS[0] += 1


def connect_store(addr: str, port: int, world_size: int, host: bool, timeout_s: float):
    """A TCPStore at addr:port (`host`: serve it here), connected within `timeout_s`.

    TCPStore's client bounds its connect attempts but not the handshake after them: a listener
    that accepts and never answers holds it in TCPStore::ping() for ever. So a client first
    waits here, in Python, for the port to accept (rank 0 may still be starting), then makes
    the connection on a helper thread, abandoned at the deadline (blocked in a read; the
    process is about to exit with this error). The helper is never left retrying in C++: one
    that ends in an exception while the interpreter finalizes aborts the process ("terminate
    called without an active exception")."""
    where = f"{addr}:{port}"
    deadline = time.monotonic() + timeout_s
    if not host and not _accepts_by(addr, port, deadline):
        raise LaunchError(f"cannot reach the job's store at {where} within {timeout_s:g} s "
                          "(nothing accepts connections there); check that rank 0 started and "
                          "MASTER_ADDR/MASTER_PORT are the same on every rank")
    made, failed = [], []

    def connect():
        try:
            left = max(0.1, deadline - time.monotonic())
            made.append(dist.TCPStore(addr, port, world_size, host,
                                      timeout=timedelta(seconds=left),
                                      wait_for_workers=False, multi_tenant=host))
        except (RuntimeError, dist.DistError) as err:  # DistNetworkError, DistStoreError
            failed.append(err)

    helper = threading.Thread(target=connect, name="vescale-store-connect", daemon=True)
    helper.start()
    helper.join(max(0.0, deadline - time.monotonic()))
    if made:
        return made[0]
    if not failed:
        raise LaunchError(f"the job's store at {where} accepted the connection but did not "
                          f"answer within {timeout_s:g} s: MASTER_PORT={port} belongs to "
                          "something else (another service or job)")
    why = f"{type(failed[0]).__name__}: {_first_line(failed[0])}"
    if "EADDRINUSE" in why or "address already in use" in why:
        raise LaunchError(f"cannot serve the job's store at {where}: the port is in use "
                          f"(another job on MASTER_PORT={port}?)") from None
    raise LaunchError(f"cannot reach the job's store at {where} within {timeout_s:g} s "
                      f"({why}); check that rank 0 started and MASTER_ADDR/MASTER_PORT are "
                      "the same on every rank") from None


def _accepts_by(addr, port, deadline) -> bool:
    """Whether addr:port accepts a connection before the deadline (tried every 0.1 s)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((addr, port), timeout=min(1.0, left)):
                return True
        except OSError:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def meet(store, where, address: str, timeout_s: float, prefix: str,
         limit_s: float | None = None) -> None:
    """Every rank of `where` (a launch.env.Placement) checks in on `store` and waits for the
    others. Ranks that disagree on WORLD_SIZE, a RANK taken by another process (two ranks with
    one RANK, or another job on this port) and ranks that never come are one-line errors; a
    refusing rank leaves its reason in the store, so the waiting ones stop at once too."""
    rank, size = where.rank, where.world_size
    limit_s = timeout_s if limit_s is None else limit_s  # as configured, for the message
    me = f"{socket.gethostname()}:{os.getpid()}"
    ticket = f"{me} {uuid.uuid4().hex}"  # one per join: tells this join from any other
    deadline = time.monotonic() + timeout_s
    first = _text(store.compare_set(prefix + "world_size", "", f"{size} {rank} {me}"))
    first_size, first_rank, first_who = first.split(" ", 2)
    if int(first_size) != size:
        _refuse(store, prefix, f"rank {rank} has WORLD_SIZE={size} but rank {first_rank} "
                               f"({first_who}) joined {address} with WORLD_SIZE={first_size}")
    holder = _text(store.compare_set(prefix + f"rank/{rank}", "", ticket))
    if holder != ticket:
        _refuse(store, prefix, f"RANK={rank} at {address} was already taken by "
                               f"{holder.split(' ')[0]}: two ranks with RANK={rank}, or two "
                               "jobs on MASTER_PORT")
    store.add(prefix + "joined", 1)
    poll_s = min(1.0, 0.05 * size)  # light on the store with many ranks
    while store.add(prefix + "joined", 0) < size:
        if store.check([prefix + "refused"]):
            why = _text(store.get(prefix + "refused"))
            raise LaunchError(f"rank {rank} of {size}: the process group at {address} cannot "
                              f"form: {why}")
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if not store.check([prefix + f"rank/{r}"])]
            raise LaunchError(
                f"rank {rank} of {size} ({where.launcher}): the process group at {address} did "
                f"not form within {limit_s:g} s ({_ranks(missing)} did not join); check that "
                "every rank started and can reach MASTER_ADDR")
        time.sleep(poll_s)


def _refuse(store, prefix, why):
    store.compare_set(prefix + "refused", "", why)  # the first reason stays
    raise LaunchError(why)


def _ranks(ranks, shown=8) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return "ranks " + ", ".join(map(str, ranks[:shown])) + more


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _first_line(err) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]
