"""The processes `vescale run` starts, and how it stops them.

Each child (a local rank, or the mpirun / deepspeed launcher) runs in its own session, so that
everything it starts can be found (its session id) and killed, whatever process groups it makes
(Open MPI puts each rank in its own group). On Linux it also gets a parent-death signal, so it
dies with `vescale run` even when that is SIGKILLed: a few lines of Python (`-S`) set
`prctl(PR_SET_PDEATHSIG)` and execs the real command (no Python code runs between fork and exec
in the launcher, whose output threads may hold locks). A child is waited for without being
reaped (`waitid(WNOWAIT)`): until the launcher reaps it, its PID, and so its session id, cannot
be reused, and killing "what is left in its session" stays safe.

Exit statuses follow the shell's convention: a child killed by signal N has status 128 + N.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

# Handled while a job runs: forwarded to the ranks (or their launcher), then the job stops.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# argv: death signal, the launcher's PID, the command. prctl option 1 is PR_SET_PDEATHSIG.
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0):\n"
    "    sys.exit('vescale run: prctl(PR_SET_PDEATHSIG) failed: '\n"
    "             + os.strerror(ctypes.get_errno()))\n"
    "if os.getppid() != int(sys.argv[2]):\n"  # the launcher died before prctl: follow it
    "    os._exit(128 + int(sys.argv[1]))\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n")
# The watcher reads session ids, one a line, until "done"; if its input ends without it (the
# launcher died), it waits for the parent-death signals to act (mpirun stops its ranks), then
# SIGKILLs whatever is left in those sessions.
_WATCHER = (
    "import os, signal, sys, time\n"
    "sids = set()\n"
    "for line in sys.stdin:\n"
    "    if line.strip() == 'done':\n"
    "        sys.exit(0)\n"
    "    sids.add(int(line))\n"
    "time.sleep(float(sys.argv[1]))\n"
    "for _ in range(3):\n"
    "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/stat', 'rb') as f:\n"
    "                fields = f.read().decode(errors='replace').rsplit(')', 1)[1].split()\n"
    "            if int(fields[3]) in sids and fields[0] != 'Z':\n"
    "                os.kill(int(pid), signal.SIGKILL)\n"
    "        except (OSError, IndexError, ValueError):\n"
    "            pass\n"
    "    time.sleep(0.05)\n")


def describe_status(status: int, killed: bool) -> str:
    """'exited with status 7' or 'was killed by SIGKILL (status 137)'."""
    if killed:
        return f"was killed by {signal_name(status - 128)} (status {status})"
    return f"exited with status {status}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def with_parent_death(cmd: list, death_signal: int) -> list:
    """`cmd`, started so that it gets `death_signal` when this process dies (Linux only).
    Strictly: when the thread that started it ends; `vescale run` starts its children from
    its main thread."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-S", "-c", _TRAMPOLINE, str(int(death_signal)), str(os.getpid()),
            *cmd]


class Child:
    """One started process: its own session, a parent-death signal, waited for without
    being reaped."""

    def __init__(self, cmd: list, env: dict, death_signal: int = signal.SIGKILL, **popen):
        self.proc = subprocess.Popen(with_parent_death(cmd, death_signal), env=env,
                                     start_new_session=True, **popen)
        self.pid = self.proc.pid
        self.status = None        # shell convention, once exited
        self.killed = False       # by a signal (status 128 + N)
        self.exited_at = None     # time.monotonic() when it exited
        self._exited = threading.Event()
        threading.Thread(target=self._wait, daemon=True, name=f"wait-{self.pid}").start()

    def _wait(self):
        info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        self.killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        self.status = 128 + info.si_status if self.killed else info.si_status
        self.exited_at = time.monotonic()
        self._exited.set()

    def exited(self) -> bool:
        return self._exited.is_set()

    def wait_exit(self, timeout: float) -> bool:
        return self._exited.wait(timeout)

    def send(self, signum: int):
        """`signum` to the child itself (not its session: a rank decides what its workers get)."""
        if not self.exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def children(self) -> list:
        """PIDs of the child's live children (mpirun's local ranks, deepspeed's launch.py)."""
        return [p.pid for p in processes() if p.ppid == self.pid and p.state != "Z"]

    def session(self) -> list:
        """PIDs of the live processes in the child's session, the child included."""
        return [p.pid for p in processes() if p.sid == self.pid and p.state != "Z"]

    def kill_session(self):
        """SIGKILL everything left in the child's session and process group. Called before
        reap(), while the child's PID (the session id) cannot have been reused."""
        for _ in range(3):  # a process forking while we scan
            left = self.session()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def reap(self) -> int:
        """Once its waiter has seen it exit (a reap before that would leave the waiter's
        waitid without a child)."""
        self._exited.wait()
        self.proc.wait()
        return self.status


class SessionWatcher:
    """A small process that kills the sessions it is told about if `vescale run` dies
    without saying "done" (even SIGKILLed): the parent-death signal reaches only the
    launcher's own children, and DeepSpeed's runner, for one, lets its launch.py and ranks
    run on when it dies. Linux only (/proc); elsewhere it does nothing."""

    def __init__(self, delay_s: float = 2.0):
        self.proc = None
        if sys.platform.startswith("linux"):
            self.proc = subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(delay_s)],
                                         stdin=subprocess.PIPE, text=True,
                                         start_new_session=True)

    def watch(self, session_id: int):
        if self.proc:
            self.proc.stdin.write(f"{session_id}\n")
            self.proc.stdin.flush()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        """Done, when the launcher has cleaned up; after an exception, the watcher cleans."""
        if self.proc:
            with contextlib.suppress(BrokenPipeError):
                if exc_type is None:
                    self.proc.stdin.write("done\n")
                self.proc.stdin.close()
            if exc_type is None:
                self.proc.wait()


class _Proc:
    __slots__ = ("pid", "ppid", "sid", "state")

    def __init__(self, pid, ppid, sid, state):
        self.pid, self.ppid, self.sid, self.state = pid, ppid, sid, state


def processes() -> list:
    """Every process /proc shows: pid, parent, session, state (empty without /proc)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        found.append(_Proc(int(entry), int(fields[1]), int(fields[3]), fields[0]))
    return found


@contextlib.contextmanager
def received_signals():
    """Records STOP_SIGNALS in a list while the job runs, instead of their default actions
    (and KeyboardInterrupt); the caller's loop acts on them. Outside the main thread
    (signals cannot be caught there) the list stays empty and the defaults stay."""
    received = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
