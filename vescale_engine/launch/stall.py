"""Ranks that wait in different collectives end the job within seconds, with one line naming
where each rank waits. That is a deadlock no timeout should be needed for: a forward whose path
differs by rank (an MoE block whose ranks run different experts, a module called on some ranks
only) makes the ranks gather different FSDP units, and each waits for the others forever (or
for the process group's timeout, half an hour by default).

How, without a cost on the hot path: collective_timeout records where this rank waits (the
operation and when it entered it). A watcher thread per process looks once a second; a rank
that has waited in one operation for STALL_S publishes it on the job's store (and clears it
when it moves on). Rank 0's watcher, while it waits too, reads every rank's entry; when every
rank waits, the entries are the same on two looks in a row and they are not all the same
operation, it publishes the verdict, and every waiting rank's watcher prints it and ends its
process (its main thread is blocked inside the backend and cannot be interrupted). Ranks that
all wait in the same operation are left to the backend's timeout (a slow network, a stuck
collective: collective_timeout's message).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

__all__ = ["ensure_watching", "STALL_S"]

STALL_S = 5.0   # how long a rank waits in one operation before it says where
POLL_S = 1.0
PREFIX = "vescale/stall/"
EXIT_STATUS = 1
_SHOWN = 4      # operations named in the line
_watch = {"thread": None, "group": None}
_start = threading.Lock()


def ensure_watching(waiting_in, fail_fast=None) -> None:
    """Start this process's watcher for the current default group, once per group.
    `waiting_in(seconds)`: the operation this rank has waited in for that long, or None;
    `fail_fast`: the FailFast of a group we formed (its store connection), or None."""
    group = dist.group.WORLD if dist.is_initialized() else None
    if group is None or _watch["group"] is group:
        return
    with _start:
        if _watch["group"] is group:
            return
        _watch["group"] = group
        store = _store_of_group(fail_fast)
        if store is None or dist.get_world_size() < 2:
            return
        thread = _Watcher(store, dist.get_rank(), dist.get_world_size(), waiting_in)
        _watch["thread"] = thread
        thread.start()


def _store_of_group(fail_fast):
    """The job's store: our failfast connection when we formed the group, else the store the
    group was formed on. None for backends whose ranks are not processes (threads, fake)."""
    backend = str(dist.get_backend())
    if "gloo" not in backend and "nccl" not in backend:
        return None
    if fail_fast is not None:
        return fail_fast.store
    try:  # a group DeepSpeed, torchrun's script or a test harness formed
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class _Watcher(threading.Thread):
    def __init__(self, store, rank: int, world: int, waiting_in):
        super().__init__(name="vescale-stall", daemon=True)
        self.store, self.rank, self.world, self.waiting_in = store, rank, world, waiting_in
        self.group = _watch["group"]
        self.published = None
        self.last_look = None

    def run(self):
        while _watch["group"] is self.group:
            time.sleep(POLL_S)
            try:
                self._look()
            except Exception:  # noqa: BLE001 - the store is gone (the group ended): stop
                return

    def _look(self):
        where = self.waiting_in(STALL_S)
        if where != self.published:  # a change only: no store traffic while running
            self.store.set(f"{PREFIX}{self.rank}", where or "")
            self.published = where
        if where is None:
            self.last_look = None
            return
        if self.store.check([PREFIX + "verdict"]):
            self._end(self.store.get(PREFIX + "verdict").decode())
        if self.rank != 0:
            return
        keys = [f"{PREFIX}{r}" for r in range(self.world)]
        if not self.store.check(keys):
            return
        look = [v.decode() for v in self.store.multi_get(keys)]
        same_as_before, self.last_look = look == self.last_look, look
        # the same operation at another count may be a rank that is merely behind: only
        # different operations are a verdict
        if not same_as_before or not all(look) or len({_operation(w) for w in look}) == 1:
            return
        verdict = _verdict(look)
        self.store.set(PREFIX + "verdict", verdict)
        self._end(verdict)

    def _end(self, verdict: str):
        """Say it, then exit once every rank has said it (or after a few seconds): the first
        process to exit closes its connections, which fails the others' collectives."""
        _say(f"vescale: rank {self.rank} stopped: {verdict}")
        self.store.add(PREFIX + "said", 1)
        deadline = time.monotonic() + 3 * POLL_S
        while time.monotonic() < deadline and self.store.add(PREFIX + "said", 0) < self.world:
            time.sleep(0.05)
        os._exit(EXIT_STATUS)


def _operation(where: str) -> str:
    """The operation without collective_timeout's count ("... (#12)")."""
    return where.rsplit(" (#", 1)[0]


def _verdict(look: list) -> str:
    ranks_in = {}
    for rank, where in enumerate(look):
        ranks_in.setdefault(where, []).append(rank)
    shown = "; ".join(f"{_ranks(ranks)} in {where}"
                      for where, ranks in list(ranks_in.items())[:_SHOWN])
    more = f"; and {len(ranks_in) - _SHOWN} more" if len(ranks_in) > _SHOWN else ""
    return (f"the ranks wait in different collectives for over {STALL_S:g} s, which can never "
            f"complete: {shown}{more}. A forward whose modules differ by rank (MoE routing, a "
            "module some ranks skip) must gather them on every rank: flag the module as a "
            "ZeRO-3 leaf (deepspeed.utils.set_z3_leaf_modules, zero_optimization.leaf_module) "
            "or make it one FSDP unit")


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"ranks {', '.join(str(r) for r in ranks)}"


def _say(line: str):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
