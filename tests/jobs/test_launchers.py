"""The training example under every launcher besides torchrun and plain `vescale run` (those are
in test_example.py): `deepspeed --num_gpus 2` on CPU, `mpirun -n 2` (Open MPI from PyPI, as
root where the tests run as root), `vescale run --launcher mpi` and `--launcher deepspeed`.
Each trains a few steps on 2 ranks; the loss must fall and match the `vescale run` reference
(same model, seed, data and config: the launcher must not change the training). The job
scripts in examples/jobs/ get syntax and content checks (they need a GPU cluster to run)."""
import os
import re
import subprocess
import sys

import pytest
from dist_harness import free_port, run_job

STEPS = 12
ARGS = ["examples/train_gpt.py", "--config", "examples/configs/vescale_default.json",
        "--steps", str(STEPS), "--layers", "2", "--dim", "64", "--seq", "64"]
BIN = os.path.dirname(sys.executable)  # mpirun and deepspeed live next to the venv's python
# Open MPI's documented alternative to --allow-run-as-root.
MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def train(cmd, env=None, out_dir=None):
    """Run the example; its CSV and plot go to out_dir (a test's temporary directory), not into
    the repository."""
    if out_dir is not None:
        cmd = [*cmd, "--log-csv", os.path.join(out_dir, "metrics.csv")]
    out = run_job(cmd, timeout=600,
                  env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    match = re.search(rf"trained {STEPS} steps on 2 rank\(s\) in [\d.]+ s: loss ([\d.]+) -> "
                      r"([\d.]+)", out.stdout)
    assert match, (out.stdout + out.stderr)[-3000:]
    return float(match.group(1)), float(match.group(2)), out.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    first, last, _ = train([sys.executable, "-m", "launcher.cli", "run", "--nproc", "2", *ARGS],
                           out_dir=str(tmp_path_factory.mktemp("reference")))
    assert last < first - 0.5
    return first, last


def deepspeed_cmd(tmp_path):
    return [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            *ARGS], None


def mpirun_cmd(tmp_path):
    return [os.path.join(BIN, "mpirun"), "-n", "2", sys.executable, *ARGS], MPI_AS_ROOT


def vescale_mpi_cmd(tmp_path):
    return [sys.executable, "-m", "launcher.cli", "run", "--launcher", "mpi", "--nproc", "2",
            "--threads-per-rank", "1", *ARGS], None


def vescale_deepspeed_cmd(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    return [sys.executable, "-m", "launcher.cli", "run", "--launcher", "deepspeed",
            "--hostfile", str(hostfile), "--threads-per-rank", "1", *ARGS], None


@pytest.mark.parametrize("make_cmd", [deepspeed_cmd, mpirun_cmd, vescale_mpi_cmd,
                                      vescale_deepspeed_cmd],
                         ids=["deepspeed", "mpirun", "vescale-run-mpi", "vescale-run-deepspeed"])
def test_example_trains_under_launcher(tmp_path, reference, make_cmd):
    cmd, env = make_cmd(tmp_path)
    first, last, stdout = train(cmd, env, out_dir=str(tmp_path))
    assert last < first - 0.5
    # Same training as the reference; only the thread layout may differ (round-off).
    assert first == pytest.approx(reference[0], abs=0.01)
    assert last == pytest.approx(reference[1], abs=0.01)
    if cmd[1:4] == ["-m", "launcher.cli", "run"]:
        launched = stdout.splitlines()[0]
        tool = "mpirun -n 2" if "mpi" in cmd else "deepspeed --hostfile"
        assert launched.startswith("vescale run: ") and tool in launched, launched


# --- multi-node job scripts -------------------------------------------------------------------

JOBS = "examples/jobs"


@pytest.mark.parametrize("name", ["mpirun_multinode.sh", "slurm_multinode.sbatch"])
def test_job_script_is_valid_bash(name):
    out = subprocess.run(["bash", "-n", os.path.join(JOBS, name)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


def test_mpirun_job_script_trains_on_one_node(tmp_path, reference):
    """The multi-node script, run as written on one node of 2 'GPUs' (CPU ranks on gloo)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one node\nlocalhost slots=2\n")
    first, last, _ = train(["bash", os.path.join(JOBS, "mpirun_multinode.sh"), str(hostfile),
                            *ARGS[3:]],
                           {"PATH": BIN + os.pathsep + os.environ["PATH"], "GPUS_PER_NODE": "2",
                            "MASTER_PORT": str(free_port()), "PYTHON": sys.executable},
                           out_dir=str(tmp_path))
    assert (first, last) == pytest.approx(reference, abs=0.01)


def test_slurm_script_runs_the_example_on_every_node():
    text = open(os.path.join(JOBS, "slurm_multinode.sbatch")).read()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    assert {"nodes", "ntasks-per-node", "gpus-per-node"} <= directives.keys()
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]  # one rank per GPU
    commands = re.sub(r"\\\n\s*", " ", text).splitlines()  # continuation lines joined
    srun = [c for c in commands if c.startswith("srun ")]
    assert len(srun) == 1 and srun[0].endswith(
        "examples/train_gpt.py --config examples/configs/vescale_default.json \"$@\"")
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert "export MASTER_ADDR" in text and "export MASTER_PORT" in text
    assert "export NCCL_SOCKET_IFNAME" in text
