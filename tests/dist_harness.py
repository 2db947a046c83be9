"""Run test bodies inside a pool of gloo ranks that is started once per test module.

Starting a Python process that imports torch costs seconds here, so a module starts its ranks
once (`RankPool`) and sends each check to all of them, and the ranks of every pool fork from one
server process that imported torch once per test session (multiprocessing's forkserver). A check is a module-level function
`fn(rank, world_size, *args)`; its return values come back as a list indexed by rank. A check
that fails or hangs on any rank fails the calling test with every rank's traceback, and the
pool restarts itself so the next test starts clean. A check asserts what one rank can tell
(its asserts are rewritten as pytest's: a failure says what it compared); the test asserts
what needs every rank's values.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT_S = 180
# What the fork server imports before it forks ranks: torch, the transformers models most pools
# build, Trainer, PEFT and Accelerate (none of them imports deepspeed). Not deepspeed: it fixes
# its accelerator when imported, from DS_ACCELERATOR, which a pool may set. Nothing of ours: the
# ranks must import the library as it is when their pool starts.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.testing",
            "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
            "transformers.models.mixtral.modeling_mixtral", "transformers.trainer", "peft",
            "accelerate"]
_CONTEXT = None


def _context():
    """The forkserver context, its preload set on first use (ranks start from a process that
    already holds torch and transformers: 5 to 10 s of CPU saved per rank on this machine)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD)
    return _CONTEXT


def run_job(cmd, *, timeout, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=...)` for a command that
    starts more processes (a launcher and its ranks): it runs in its own session, and when it
    times out (or the test is interrupted) everything left in that session is killed, so no
    rank outlives the test holding ports, files or a JIT build lock."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        kill_session(proc.pid)
        proc.communicate()
        raise
    kill_session(proc.pid)  # a rank its launcher left behind (status already taken)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def kill_session(sid: int, *, wait_s: float = 10.0) -> None:
    """SIGKILL every process whose session id is `sid` (read from /proc), and keep at it until
    none is left alive: a process can fork while the first pass reads /proc, and a killed one
    still shows as running until the kernel has torn it down."""
    deadline = time.monotonic() + wait_s
    while _signal_session(sid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal_session(sid: int) -> int:
    """SIGKILL the live processes of session `sid`; how many there were."""
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                found += 1
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the one helper for tests/)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, tasks, results, env):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if env.get("DS_ACCELERATOR"):  # a pool that runs DeepSpeed: its reference must be right
        from deepspeed_gloo_fix import install
        install()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, fn_name, args = task
        try:
            fn = getattr(_checks_module(module_name), fn_name)
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # report everything, including assertion errors, to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    dist.destroy_process_group()


def _checks_module(name: str):
    """The test module holding a check, imported as pytest imports it: its asserts rewritten,
    so that an assert inside a check that fails on a rank says what it compared, as in the
    test process (the rank's traceback comes back to the test)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return importlib.import_module(name)
    import ast
    import types

    from _pytest.assertion.rewrite import rewrite_asserts
    with open(spec.origin, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=spec.origin)
    rewrite_asserts(tree, source, spec.origin)
    module = types.ModuleType(name)
    module.__file__, module.__spec__, module.__loader__ = spec.origin, spec, spec.loader
    sys.modules[name] = module
    try:
        exec(compile(tree, spec.origin, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class RankPool:
    def __init__(self, world_size: int, env: dict | None = None):
        self.world_size = world_size
        self.env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
                    **(env or {})}
        self._procs = []
        self._start()

    def _start(self):
        ctx = _context()
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self._tasks[r], self._results, self.env))
            for r in range(self.world_size)]
        for proc in self._procs:
            proc.start()

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
        """Run `fn(rank, world_size, *args)` on every rank; return the per-rank results."""
        for task_queue in self._tasks:
            task_queue.put((fn.__module__, fn.__name__, args))
        outcomes = {}
        try:
            while len(outcomes) < self.world_size:
                rank, ok, value = self._results.get(timeout=timeout)
                outcomes[rank] = (ok, value)
        except queue.Empty:
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            self._restart()
            raise AssertionError(
                f"{fn.__name__} timed out after {timeout}s on ranks {missing}; "
                + _failures(outcomes))
        if not all(ok for ok, _ in outcomes.values()):
            self._restart()
            raise AssertionError(f"{fn.__name__} failed: " + _failures(outcomes))
        return [outcomes[r][1] for r in range(self.world_size)]

    def _restart(self):
        self.close()
        self._start()

    def close(self):
        for task_queue in self._tasks:
            try:
                task_queue.put(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []


def _failures(outcomes) -> str:
    return "\n".join(f"--- rank {r} ---\n{value}" for r, (ok, value) in sorted(outcomes.items())
                     if not ok)


def scratch_dir() -> str:
    """A directory all ranks of a pool can share (ranks run on one machine)."""
    return tempfile.mkdtemp(prefix="vescale-test-")


def value_errors(attempts) -> list:
    """Run each callable; its ValueError's message, or None where it raised nothing."""
    errors = []
    for attempt in attempts:
        try:
            attempt()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


@contextlib.contextmanager
def engine_log_messages():
    """The vescale_engine logger's messages (INFO and up) while inside, in this process. The
    level is raised with setLevel (it clears the logger's isEnabledFor cache) and restored."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("vescale_engine")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def rank_pools():
    """`get(world, **env)`: one RankPool per world size and environment, started on first use;
    all closed at exit."""
    pools = {}

    def get(world, **env):
        key = (world, tuple(sorted(env.items())))
        if key not in pools:
            pools[key] = RankPool(world, env=env)
        return pools[key]
    try:
        yield get
    finally:
        for pool in pools.values():
            pool.close()


# DeepSpeed JIT-builds its CPU Adam (C++) the first time it runs an offloaded optimizer on a
# machine: minutes. Built in a process of its own, so that no rank's timeout includes it.
CPU_ADAM_BUDGET_S = 1800
BUILD_CPU_ADAM = """
import os, time
from torch.utils.cpp_extension import _get_build_directory
lock = os.path.join(_get_build_directory("cpu_adam", False), "lock")
if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > 1200:
    os.remove(lock)  # left by a build that was killed
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load()
"""

def build_cpu_adam(say=print):
    """Build (or find built) DeepSpeed's CPU Adam in a process of its own; raises on failure."""
    started = time.monotonic()
    say("tests: DeepSpeed's CPU Adam: building it (or finding it built) before the tests that "
        f"need it (up to {CPU_ADAM_BUDGET_S} s; several minutes on a fresh machine)")
    built = run_job([sys.executable, "-c", BUILD_CPU_ADAM], timeout=CPU_ADAM_BUDGET_S,
                    env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if built.returncode != 0:
        raise RuntimeError("building DeepSpeed's CPU Adam failed:\n" + built.stderr[-3000:])
    say(f"tests: DeepSpeed's CPU Adam ready ({time.monotonic() - started:.0f} s)")
