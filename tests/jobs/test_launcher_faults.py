"""`vescale run` under faults (issue 23): a failing rank stops the job, and the rank that
failed first is named with its exception line; SIGTERM to the launcher reaches every rank,
which gets the grace period, then whatever is left is killed; a rank's kill -9 gives status
137; ranks die with a SIGKILLed launcher (parent-death signal).

The ranks are plain scripts (no engine: the engine's own fail-fast is another test's), each
writing its PID, and its helper's, to files so the test can find them in /proc; every process a
test starts is killed and reaped when it ends, whatever happened."""
import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.run import _JobTracebacks, _RankOutput, _pump

# The issue asks for a stopped job within 5 s; these tests allow 3x what a loaded 2-core
# machine measures (up to 2.2 s, 2 s of it the grace where there is one), so load alone never
# fails them.
STOP_BOUND_S = 7

HEADER = """\
import os, pathlib, signal, subprocess, sys, time
rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
here = pathlib.Path(sys.argv[-1])  # deepspeed inserts --local_rank=N before it
def note(name, text):
    (here / f".{name}").write_text(str(text))
    (here / f".{name}").rename(here / name)
def wait_for(name):
    while not (here / name).exists():
        time.sleep(0.02)
def helper():  # a process of the rank's own, in its own process group, deaf to SIGTERM
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", code, str(here)], process_group=0)
    note(f"helper{rank}", child.pid)
def saving_on_sigterm(seconds):  # an opt-in preemption save: finish, write, exit 0
    def handler(signum, frame):
        note(f"got{rank}", signum)
        time.sleep(seconds)
        note(f"saved{rank}", "ok")
        sys.exit(0)
    signal.signal(signal.SIGTERM, handler)
"""
FOOTER = """
note(f"pid{rank}", os.getpid())
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Job:
    """One `vescale run`, in its own session, output in a file, its processes found by PID."""

    def __init__(self, tmp_path, body, args, nproc=2):
        self.dir, self.nproc = tmp_path, nproc
        script = tmp_path / "job.py"
        script.write_text(HEADER + body + FOOTER)
        self.out_path = tmp_path / "out.txt"
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launcher.cli", "run", "--nproc", str(nproc), *args,
                 str(script), str(tmp_path)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_for_files(self, names, timeout=60):
        deadline = time.monotonic() + timeout
        while not all((self.dir / n).exists() for n in names):
            assert self.proc.poll() is None, f"launcher exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {names} after {timeout} s:\n{self.output()}"
            time.sleep(0.05)

    def rank_pids(self, helpers=False):
        names = [f"pid{r}" for r in range(self.nproc)]
        names += [f"helper{r}" for r in range(self.nproc)] if helpers else []
        self.wait_for_files(names)
        return [int((self.dir / n).read_text()) for n in names]

    def known_pids(self):
        return [int(p.read_text()) for p in self.dir.iterdir()
                if p.name.startswith(("pid", "helper")) and p.read_text().isdigit()]

    def wait(self, timeout):
        return self.proc.wait(timeout=timeout)

    def output(self):
        return self.out_path.read_text()

    def reap(self):
        """Kill and reap everything this job started that is still there."""
        with_marker = []
        for pid in self.known_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if str(self.dir).encode() in f.read():
                        with_marker.append(pid)
            except OSError:
                pass
        for pid in with_marker:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def start(tmp_path):
    jobs = []

    def _start(body, *args, nproc=2):
        job = Job(tmp_path, body, args, nproc)
        jobs.append(job)
        return job
    yield _start
    for job in jobs:
        job.reap()


def gone_within(pids, seconds, since):
    """Seconds from `since` until none of `pids` is alive; fails past `seconds`."""
    while any(alive(p) for p in pids):
        assert time.monotonic() - since < seconds, \
            f"still alive {seconds} s on: {[p for p in pids if alive(p)]}"
        time.sleep(0.02)
    return time.monotonic() - since


# --- a rank fails -----------------------------------------------------------------------------

def test_the_rank_that_failed_first_is_named_with_its_exception_line(start):
    """Rank 1 raises, then takes 3 s to tear down (atexit); rank 0, told of it, raises its
    own error 0.3 s later and exits at once. Exit order would blame rank 0."""
    body = """
if rank == 1:
    import atexit
    atexit.register(time.sleep, 3)
    note("pid1", os.getpid())
    wait_for("go")
    note("failing", "1")
    raise ValueError("bad batch at step 3")
note("pid0", os.getpid())
wait_for("failing")
time.sleep(0.3)
raise RuntimeError("rank 1 failed; stopping")
"""
    job = start(body)
    pids = job.rank_pids()
    (job.dir / "go").write_text("")
    t0 = time.monotonic()
    status = job.wait(timeout=60)
    took = gone_within(pids, 15, t0)
    out = job.output()
    assert status == 1, out
    assert ("vescale run: rank 1 failed first: ValueError: bad batch at step 3 (stopped by "
            "vescale run after its traceback)") in out, out
    assert "[rank1] Traceback (most recent call last):" in out and "[rank0] Traceback" not in \
        out and "[rank0] RuntimeError: rank 1 failed; stopping (traceback of " in out, out
    print(f"failing rank: all gone {took:.2f} s after the raise (bound 15 s)")


def test_a_failing_rank_stops_one_that_ignores_sigterm_and_its_helpers(start):
    """Rank 0 is deaf to SIGTERM (as if stuck) and has a helper process in its own process
    group; rank 1 raises. Both ranks and the helpers must be gone within 15 s (here after
    --stop-grace-s 1; the default gives the others at most FAILURE_GRACE_S, 5 s)."""
    body = """
helper()
if rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    note("pid1", os.getpid())
    wait_for("go")
    raise RuntimeError("loss is NaN at step 5")
"""
    job = start(body, "--stop-grace-s", "1")
    pids = job.rank_pids(helpers=True)
    (job.dir / "go").write_text("")
    t0 = time.monotonic()
    status = job.wait(timeout=60)
    took = gone_within(pids, 15, t0)
    out = job.output()
    assert status == 1, out
    assert "vescale run: rank 1 exited with status 1; stopping the other ranks" in out, out
    assert ("vescale run: rank 1 failed first: RuntimeError: loss is NaN at step 5 (exit "
            "status 1)") in out, out
    print(f"failing rank, the other deaf to SIGTERM: all gone {took:.2f} s after the raise")


@pytest.mark.parametrize("launcher", ["local", "mpi"])
def test_a_rank_killed_by_sigkill_gives_status_137(start, launcher):
    job = start("", "--launcher", launcher)
    pids = job.rank_pids()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    status = job.wait(timeout=60)
    gone_within(pids, 15, t0)
    out = job.output()
    assert status == 137, out
    if launcher == "local":
        assert "vescale run: rank 1 was killed by SIGKILL (status 137); stopping the other " \
               "ranks" in out, out
        assert "vescale run: rank 1 failed first: no Python traceback (killed by SIGKILL, " \
               "status 137)" in out, out


# --- the launcher is stopped ------------------------------------------------------------------

def test_sigterm_reaches_every_rank_gets_the_grace_then_kills_the_rest(start):
    """Rank 0 saves for 1 s on SIGTERM (it must be let finish); rank 1 and both helpers are
    deaf to it (SIGKILL after --stop-grace-s 2). All gone within STOP_BOUND_S, status 143."""
    body = """
helper()
if rank == 0:
    saving_on_sigterm(1.0)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
"""
    job = start(body, "--stop-grace-s", "2")
    pids = job.rank_pids(helpers=True)
    job.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    took = gone_within(pids, STOP_BOUND_S, t0)
    status = job.wait(timeout=10)
    out = job.output()
    assert status == 143, out
    assert (job.dir / "saved0").exists(), out  # the grace let rank 0 finish its save
    assert "vescale run: got SIGTERM; passing it to rank(s) 0, 1 and waiting up to 2 s" in out
    assert "vescale run: rank(s) 1 still running: SIGKILL" in out, out
    print(f"SIGTERM, local: all gone in {took:.2f} s (bound {STOP_BOUND_S} s; grace 2 s)")


@pytest.mark.parametrize("launcher", ["mpi", "deepspeed"])
def test_sigterm_under_mpirun_or_deepspeed_reaches_the_ranks_with_the_grace(start, launcher):
    """mpirun's own SIGTERM kills its ranks within a second, and DeepSpeed's runner does not
    pass signals on for a one-machine job: the ranks (under mpirun) or DeepSpeed's launch.py
    must get the signal, and the ranks the time to save."""
    job = start("saving_on_sigterm(1.0)\n", "--launcher", launcher, "--stop-grace-s", "4")
    pids = job.rank_pids()
    job.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    took = gone_within(pids, STOP_BOUND_S, t0)
    status = job.wait(timeout=10)
    out = job.output()
    assert status == 143, out
    assert (job.dir / "saved0").exists() and (job.dir / "saved1").exists(), out
    if launcher == "mpi":
        assert "vescale run: got SIGTERM; passing it to pid(s) " in out, out
    print(f"SIGTERM, --launcher {launcher}: ranks gone in {took:.2f} s (bound {STOP_BOUND_S} s)")


@pytest.mark.parametrize("launcher", ["local", "mpi", "deepspeed"])
def test_ranks_die_with_a_sigkilled_launcher(start, launcher):
    """Local ranks by their parent-death signal (their helpers by the session watcher);
    mpirun gets SIGTERM and stops its ranks; DeepSpeed's runner dies of it, leaving
    launch.py and the ranks to the watcher."""
    deaf = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nhelper()\n"
    body = deaf if launcher == "local" else ""
    job = start(body, "--launcher", launcher)
    pids = job.rank_pids(helpers=launcher == "local")
    job.proc.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    # Local ranks go at once (their parent-death signal), before the watcher's 2 s.
    ranks_took = gone_within(pids[:2], 1 if launcher == "local" else STOP_BOUND_S, t0)
    took = gone_within(pids, STOP_BOUND_S, t0)
    assert job.wait(timeout=10) == -signal.SIGKILL
    print(f"launcher SIGKILLed ({launcher}): ranks gone in {ranks_took:.2f} s, all in "
          f"{took:.2f} s (bound {STOP_BOUND_S} s)")


# --- the pieces -------------------------------------------------------------------------------

def test_the_exception_line_is_the_last_tracebacks():
    output = _RankOutput("[rank1] ")
    lines = ["step 3\n", "Traceback (most recent call last):\n", '  File "a.py", line 1\n',
             "    f()\n", "KeyError: 'x'\n", "\n",
             "During handling of the above exception, another exception occurred:\n", "\n",
             "Traceback (most recent call last):\n", '  File "a.py", line 3\n', "    g()\n",
             "    ^^^\n", "ValueError: bad batch\n", "second line of the message\n",
             "[W socket.cpp] a warning after it\n"]
    for line in lines:
        output.note(line)
    assert output.exception == "ValueError: bad batch"
    assert output.traceback_at is not None

    # Once the process group exists, torch.distributed's excepthook prefixes every line.
    torch_prefixed = _RankOutput("[rank1] ")
    for line in ["[rank1]: Traceback (most recent call last):\n",
                 '[rank1]:   File "job.py", line 8, in <module>\n',
                 '[rank1]:     raise ValueError("bad batch at step 2")\n',
                 "[rank1]: ValueError: bad batch at step 2\n"]:
        torch_prefixed.note(line)
    assert torch_prefixed.exception == "ValueError: bad batch at step 2"


def test_one_traceback_per_job_with_one_rank_prefix():
    """torch's excepthook prefixes each line `[rankN]: `; we prefix `[rankN] `: one is shown.
    The first rank to start a traceback shows it; the others' shrink to their exception line."""
    import io
    import threading

    def traceback_of(rank, message):
        return io.StringIO("".join(f"[rank{rank}]: {line}" for line in [
            "Traceback (most recent call last):\n", '  File "job.py", line 8, in <module>\n',
            "    engine.step()\n", f"{message}\n"]) + f"after {rank}\n")

    out, lock, tracebacks = io.StringIO(), threading.Lock(), _JobTracebacks()
    for rank, message in ((1, "ValueError: bad batch at step 2"),
                          (0, "RuntimeError: Connection closed by peer")):
        _pump(traceback_of(rank, message), _RankOutput(f"[rank{rank}] "), out, lock, tracebacks)
    assert out.getvalue().splitlines() == [
        "[rank1] Traceback (most recent call last):",
        '[rank1]   File "job.py", line 8, in <module>',
        "[rank1]     engine.step()",
        "[rank1] ValueError: bad batch at step 2",
        "[rank1] after 1",
        "[rank0] RuntimeError: Connection closed by peer (traceback of 3 lines not shown: "
        "[rank1] showed one)",
        "[rank0] after 0"], out.getvalue()


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_a_bad_stop_grace_is_one_line(capsys, value):
    from launcher.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--stop-grace-s", value, "job.py"])
    assert f"--stop-grace-s: expected a number of seconds >= 0, got '{value}'" in \
        capsys.readouterr().err
