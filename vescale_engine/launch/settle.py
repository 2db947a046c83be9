"""The last thing a process that used vescale_engine does before the interpreter finalizes
(`settle_at_exit`, registered by the first fully_shard or join_process_group, before our
process group's exit barrier and teardown, so it runs after them and after every handler
registered later, the user's own): wait, the GIL released, until no
other thread of the process is runnable, at most a second; a few milliseconds when none is.

Why. A gloo worker thread drops a finished collective's work after the caller's wait returned,
and dropping tensors Python also holds takes the GIL. If that comes after finalization began,
Python 3.11 ends the thread by unwinding it through noexcept C++ frames and the process aborts
("terminate called without an active exception", SIGABRT; a core of it shows
~AsyncAllgatherWork in ProcessGroupGloo::runLoop; about 1 exit in 50 on a loaded 2-core machine
after an all_gather_object). torch 2.13's destroy_process_group does not join gloo's workers,
so the only guard is to let them run first. It covers any process group, ours or the script's
own. Torch-free.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

__all__ = ["let_native_threads_settle", "settle_at_exit"]

_REGISTERED = []


def settle_at_exit() -> None:
    """Make `let_native_threads_settle` the process's last exit step (idempotent)."""
    if not _REGISTERED:
        atexit.register(let_native_threads_settle)
        _REGISTERED.append(True)


def let_native_threads_settle(limit_s: float = 1.0) -> None:
    """Wait, the GIL released, until no other thread of this process is runnable (two quiet
    looks in a row), at most `limit_s` (see the module docstring for why)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(0.05)
        return
    me, deadline = threading.get_native_id(), time.monotonic() + limit_s
    quiet = 0  # two quiet looks in a row: a thread that wanted the GIL while we looked (we
    while quiet < 2 and time.monotonic() < deadline:  # hold it then) gets it in the sleep
        time.sleep(0.005)
        busy = any(_runnable(os.path.join(tasks, tid)) for tid in os.listdir(tasks)
                   if tid != str(me))
        quiet = 0 if busy else quiet + 1


def _runnable(task: str) -> bool:
    try:
        with open(os.path.join(task, "stat")) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return False  # the thread ended meanwhile
