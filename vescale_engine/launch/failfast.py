"""One failing rank stops the job within seconds. An uncaught exception on a rank is written to
the job's store ("rank R failed: <its last line>", the first failure wins); every rank's
watchdog thread reads that flag once a second and ends its process with one line naming the
rank that failed first, wherever the main thread is blocked (a gloo or NCCL collective, a
store wait, I/O). The failing rank skips the exit barrier (its peers are not coming) and exits
at once; the rank hosting the store first waits (briefly) until the others have read the flag.
Whether a rank exits cleanly decides the exit path: process_group.leave_process_group runs
the barrier only then."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

__all__ = ["FailFast", "last_line"]

POLL_S = 1.0          # how often the watchdog reads the flag
HOST_WAIT_S = 5.0     # how long the store's host waits for the others to read its failure
ACK_WAIT_S = 1.0      # how long a stopping rank lets the failing one exit first
EXIT_STATUS = 1       # Python's own status for an uncaught exception


class FailFast:
    """The failure flag of one process group, on a store connection of its own (the group's
    may be blocked in a long wait, e.g. for a checkpoint import). `rank0_hosts_store`: the
    store lives in rank 0's process (not in torchrun's agent), so it goes when rank 0 exits."""

    def __init__(self, store, prefix: str, rank: int, world_size: int,
                 rank0_hosts_store: bool, address: str):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.failed_key, self.seen_key = prefix + "failed", prefix + "failed_seen"
        # bumped by every failure and census request: the one key the watchdog polls
        self.news_key, self.census_key = prefix + "news", prefix + "census"
        self.locate = lambda: "running"      # where this rank is (collective_timeout.location)
        self._news_seen, self._census_seen = 0, 0
        self.rank0_hosts_store, self.address = rank0_hosts_store, address
        self.stopped = threading.Event()    # the watchdog should end
        self._ending = threading.Lock()     # one path ends the process
        self.failure = None                 # this rank's own uncaught exception (last line)
        self._previous_hook = None
        self._watchdog = threading.Thread(target=self._watch, name="vescale-failfast",
                                          daemon=True)

    def install(self):
        self._previous_hook = sys.excepthook
        sys.excepthook = self._on_uncaught
        self._watchdog.start()

    def uninstall(self):
        self.stopped.set()
        if sys.excepthook == self._on_uncaught:
            sys.excepthook = self._previous_hook
        if self._watchdog.is_alive() and threading.current_thread() is not self._watchdog:
            self._watchdog.join(timeout=POLL_S + 1.0)

    def first_failure(self):
        """"R: <last line>" of the rank that failed first, or None while none has."""
        if not self.store.check([self.failed_key]):
            return None
        first = _text(self.store.get(self.failed_key))
        return f"{_rank_of(first)}: {_line_of(first)}"

    # -- this rank fails -----------------------------------------------------------------------

    def _on_uncaught(self, kind, value, tb):
        if self._ending.locked():  # the watchdog is ending the process (a peer failed first):
            self._ending.acquire()  # this error follows from it; wait for the exit
        first = self._publish(value)  # first: the others stop while the traceback prints
        if first is not None and _rank_of(first) != self.rank:
            return  # this error follows another rank's: exit_after_failure says so in a line
        (self._previous_hook or sys.__excepthook__)(kind, value, tb)

    def _publish(self, exc):
        """Publish this rank's failure (the first exception it saw). Returns the first failure's
        record in the job, which may be another rank's (this exception then most likely
        follows from it), or None when the store is gone."""
        if self.failure is None:
            self.failure = last_line(exc)
        try:
            first = _text(self.store.compare_set(self.failed_key, "",
                                                 f"{self.rank}\t{self.failure}"))
            self.store.add(self.news_key, 1)
            return first
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody left to tell
            return None

    def exit_after_failure(self, exc=None):
        """The error path at exit: no barrier, no teardown that could wait for a peer, one line
        on stderr. Ends the process (os._exit: a group whose peer is gone may block in its
        destructor), after logging's and the standard streams' flush."""
        first = self._publish(exc if exc is not None else getattr(sys, "last_value", None))
        with self._ending:
            self.stopped.set()
            if first is None:
                _say(f"rank {self.rank} of {self.world_size} failed: {self.failure}; the job's "
                     f"store at {self.address} is gone, so the other ranks may not know")
            elif _rank_of(first) != self.rank:
                self._say_stopped(first, here=self.failure)
                self._acknowledge(first)
            else:
                _say(f"rank {self.rank} of {self.world_size} failed: {self.failure}; stopping "
                     "the other ranks")
                if self.rank0_hosts_store and self.rank == 0:
                    self._wait_for_readers()
            _exit(EXIT_STATUS)

    def _wait_for_readers(self):
        """The store goes with this process: first let every other rank read the flag."""
        deadline = time.monotonic() + HOST_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self.store.add(self.seen_key, 0) >= self.world_size - 1:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.05)

    # -- another rank fails --------------------------------------------------------------------

    def _watch(self):
        while not self.stopped.wait(POLL_S):
            try:
                news = self.store.add(self.news_key, 0)
                if news == self._news_seen:
                    continue
                self._news_seen = news
                self._answer_census()
                if not self.store.check([self.failed_key]):
                    continue
                first = _text(self.store.get(self.failed_key))
            except Exception:  # noqa: BLE001 - the store's host left: a clean exit that
                return  # destroyed its group without a barrier, or a crash the launcher reports
            if _rank_of(first) != self.rank:  # our own: the main thread is on its way out
                self._stop(first)
                return

    # -- where is everybody? (a collective timed out somewhere) ---------------------------------

    def census(self, wait_s: float = 2 * POLL_S + 0.5) -> dict:
        """Ask every other rank's watchdog where its rank is: {rank: answer, or None for a rank
        that did not answer (gone, or stuck holding the interpreter)}."""
        asked = self.store.add(self.census_key, 1)
        self.store.add(self.news_key, 1)
        keys = {r: f"{self.census_key}/{asked}/{r}" for r in range(self.world_size)
                if r != self.rank}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.1)
        return {r: _text(self.store.get(k)) if self.store.check([k]) else None
                for r, k in keys.items()}

    def _answer_census(self):
        asked = self.store.add(self.census_key, 0)
        here = self.locate()
        for n in range(max(self._census_seen + 1, asked - 7), asked + 1):  # ranks may ask at once
            self.store.set(f"{self.census_key}/{n}/{self.rank}", here)
        self._census_seen = max(self._census_seen, asked)

    def _stop(self, first):
        if not self._ending.acquire(blocking=False):
            return  # the main thread is already ending the process
        self.stopped.set()
        self._say_stopped(first)
        self._acknowledge(first)
        _exit(EXIT_STATUS)

    def _say_stopped(self, first, here=None):
        also = f" (here: {here})" if here else ""
        _say(f"rank {self.rank} of {self.world_size} stopped: rank {_rank_of(first)} failed "
             f"first: {_line_of(first)}{also}")

    def _acknowledge(self, first):
        """Tell the failing rank its flag was read, then give it time to exit first (the store's
        host waits for these), so that a launcher naming the first rank to exit names the one
        that failed. The store is not touched again: it may be gone with the failing rank."""
        try:
            self.store.add(self.seen_key, 1)
        except Exception:  # noqa: BLE001
            return
        time.sleep(ACK_WAIT_S)


def _rank_of(record: str) -> int:
    return int(record.split("\t", 1)[0])


def _line_of(record: str) -> str:
    return record.split("\t", 1)[1]


def last_line(exc) -> str:
    """An exception as the last line of its traceback (the class without its module), one
    line, at most 400 characters."""
    if exc is None:
        return "unknown error"
    text = (str(exc).strip().splitlines() or [""])[0]
    name = type(exc).__qualname__
    return (f"{name}: {text}" if text else name)[:400]


def _say(line):
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    sys.stderr.write(f"vescale: {line}\n")
    sys.stderr.flush()


def _exit(status):
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(status)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
