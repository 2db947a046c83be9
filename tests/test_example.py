"""The README's main job: examples/train_gpt.py trains under `vescale run` and torchrun, and
its loss falls; the bf16 config (the one for GPUs) trains too."""
import os
import re
import socket
import sys

import pytest
from dist_harness import run_job

ARGS = ["examples/train_gpt.py", "--steps", "12", "--layers", "2", "--dim", "64", "--seq", "64"]


def losses(output, steps=12):
    match = re.search(rf"trained {steps} steps on 2 rank\(s\) in [\d.]+ s: loss ([\d.]+) -> "
                      r"([\d.]+)", output)
    assert match, output[-3000:]
    return float(match.group(1)), float(match.group(2))


@pytest.mark.parametrize("launcher", ["vescale", "torchrun"])
def test_example_trains_and_loss_falls(launcher):
    if launcher == "vescale":
        cmd = [sys.executable, "-m", "launcher.cli", "run", "--nproc", "2",
               "--threads-per-rank", "1", *ARGS]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(port), *ARGS]
    out = run_job(cmd, timeout=300,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    first, last = losses(out.stdout)
    assert last < first - 0.5


def test_example_trains_with_the_bf16_config():
    """A few steps of bf16 (bf16 parameters and gradient reduction, fp32 master) on CPU ranks."""
    args = ["examples/train_gpt.py", "--config", "examples/configs/vescale_bf16.json",
            "--steps", "4", "--layers", "1", "--dim", "32", "--seq", "32"]
    out = run_job([sys.executable, "-m", "launcher.cli", "run", "--nproc", "2",
                   "--threads-per-rank", "1", *args],
                  timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    first, last = losses(out.stdout, steps=4)
    assert last < first
