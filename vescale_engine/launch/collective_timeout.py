"""A collective that times out says so in one line: which operation, after how long, the config
key that sets the limit (vescale.process_group_timeout_s), and what the job's store can tell
about the other ranks: a rank that failed first, or, asked through their failfast watchdogs,
the ranks that did not arrive and where they are instead. The backends' own messages name none
of these (gloo: "Timed out waiting 600000ms for recv operation to complete").

    with explain_timeout("all-gather of unit 'blocks.3' (forward)"):
        work.wait()

Every rank counts the operations it enters, so that "rank 1 is in the same operation" means
the same call, not the previous step's: wrap the same collectives on every rank.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch
import torch.distributed as dist

from . import stall

__all__ = ["CollectiveTimeout", "record_group", "location", "is_timeout", "explain_timeout",
           "timeout_message", "dump_flight_record"]

TIMEOUT_KEY = "vescale.process_group_timeout_s"
# Where torch's flight recorder dumps go ("PREFIX{rank}"): NCCL's watchdog writes there on a
# timeout with TORCH_NCCL_DUMP_ON_TIMEOUT=1; we write gloo's there too (docs/launching.md).
FLIGHT_RECORD_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
# How gloo, NCCL's watchdog and the store word a timeout.
_TIMEOUT_WORDS = ("timed out", "timeout", "deadline exceeded")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout."""


# Set by process_group when the group forms: its timeout, and the FailFast (or None) whose
# store says who failed first and where the others are.
_group = {"timeout_s": None, "fail_fast": None}
_here = {"operation": None, "since": None, "last": None, "count": 0}
_lock = threading.Lock()  # the watchdog thread reads _here


def record_group(timeout_s: float, fail_fast=None):
    _group.update(timeout_s=timeout_s, fail_fast=fail_fast)


def location() -> str:
    """Where this rank is, as another rank's timeout message quotes it."""
    with _lock:
        if _here["operation"] is not None:
            return f"in {_here['operation']}"
        last = f" (last: {_here['last']})" if _here["last"] else ""
        return f"between collectives{last}"


def waiting_in(seconds: float) -> str | None:
    """The operation this rank has been in for at least `seconds`, or None (stall.py)."""
    with _lock:
        if _here["operation"] is None or time.monotonic() - _here["since"] < seconds:
            return None
        return _here["operation"]


def is_timeout(err: BaseException) -> bool:
    if not isinstance(err, (RuntimeError, dist.DistError)) or isinstance(err, CollectiveTimeout):
        return False
    text = str(err).lower()
    return any(word in text for word in _TIMEOUT_WORDS)


@contextlib.contextmanager
def explain_timeout(operation: str):
    """Run the block as `operation` (what this rank's location says meanwhile); a backend's
    timeout error inside it becomes a CollectiveTimeout with one line (timeout_message).
    Every other error passes unchanged."""
    stall.ensure_watching(waiting_in, _group["fail_fast"])
    with _lock:
        _here["count"] += 1
        label = f"{operation} (#{_here['count']})"
        outer = _here["operation"], _here["since"]
        _here["operation"], _here["since"] = label, time.monotonic()
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        if not is_timeout(err):
            raise
        raise CollectiveTimeout(timeout_message(label, err)) from err
    finally:
        with _lock:
            (_here["operation"], _here["since"]), _here["last"] = outer, label


def timeout_message(operation: str, err: BaseException) -> str:
    """One line for `err`, a timeout in `operation` on this rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    limit = _group["timeout_s"]
    within = f"within {limit:g} s" if limit is not None else "within the process group's timeout"
    backend = (str(err).strip().splitlines() or [""])[0][:200]
    record = dump_flight_record(rank)
    record = f"; flight record: {record}" if record else ""
    return (f"rank {rank} of {world}: {operation} did not complete {within} ({TIMEOUT_KEY}); "
            f"{_the_others(operation)}{record} ({type(err).__name__}: {backend})")


def dump_flight_record(rank: int) -> str | None:
    """This rank's flight record (the collectives torch recorded, with their states) in
    `PREFIX{rank}`, where PREFIX is TORCH_FR_DUMP_TEMP_FILE: the file NCCL's watchdog writes
    and `python -m torch.distributed.flight_recorder.fr_trace DIR` reads. Only when the user
    set the variable; a dump NCCL already wrote is kept. The path, or None."""
    prefix = next((os.environ[v] for v in FLIGHT_RECORD_VARS if os.environ.get(v)), None)
    if prefix is None:
        return None
    path = f"{prefix}{rank}"
    if not os.path.exists(path):
        try:
            record = torch._C._distributed_c10d._dump_fr_trace()
            with open(path + ".tmp", "wb") as f:
                f.write(record)
            os.replace(path + ".tmp", path)
        except Exception as err:  # noqa: BLE001 - evidence is best effort; the timeout is not
            return f"not written to {path} ({type(err).__name__}: {err})"
    return path


def _the_others(operation: str) -> str:
    fail_fast = _group["fail_fast"]
    if fail_fast is None:
        return "the other ranks cannot be asked (no failfast store for this group)"
    try:
        first = fail_fast.first_failure()
        if first:
            return f"rank {first} failed first"
        answers = fail_fast.census()
    except Exception:  # noqa: BLE001 - the store is gone with its host
        return "the job's store does not answer (rank 0, its host, may have exited)"
    mine = f"in {operation}"
    away = {r: a for r, a in sorted(answers.items()) if a != mine}
    if not away:
        return "every rank is in this operation: the backend itself is stuck (network?)"
    shown = [f"rank {r} {'did not answer (gone, or stuck)' if a is None else 'is ' + a}"
             for r, a in list(away.items())[:4]]
    more = f", and {len(away) - 4} more" if len(away) > 4 else ""
    ranks = ", ".join(str(r) for r in away)
    return f"ranks not arrived: {ranks} ({'; '.join(shown)}{more})"
