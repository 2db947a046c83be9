"""`vescale run --nproc N script.py [args]`: start N local ranks with the environment
torchrun would give them, prefix each output line with its rank, and stop every rank as soon
as one fails (the exit status is then that rank's)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pump(stream, prefix, out, lock):
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()
    stream.close()


def run_local(nproc: int, argv: list, threads_per_rank: int | None = None,
              out=sys.stdout) -> int:
    """Run `python argv...` as ranks 0..nproc-1; returns the job's exit status."""
    if nproc < 1:
        raise ValueError(f"--nproc must be positive, got {nproc}")
    if not argv or not os.path.exists(argv[0]):
        raise ValueError(f"script not found: {argv[0] if argv else '(none)'}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    port = _free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[rank{rank}] ", out, lock),
                                daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                with lock:
                    out.write(f"vescale run: rank {procs.index(failed[0])} exited with "
                              f"status {status}; stopping the other ranks\n")
                _stop(procs)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    for pump in pumps:
        pump.join(timeout=5)
    codes = [p.wait() for p in procs]
    return status or next((c for c in codes if c), 0)


def _stop(procs, grace_s: float = 5.0):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
