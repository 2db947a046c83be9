"""Launch environment discovery for each launcher, and bad environments; under real mpirun and
prterun, rank 0 shares the master address over MPI."""
import ast
import os
import subprocess
import sys

import pytest

from vescale_engine.launch.env import LaunchError, discover
from dist_harness import run_job


@pytest.mark.parametrize("env,launcher,rank,world,local", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
      "MASTER_PORT": "29500"}, "torchrun/deepspeed", 3, 8, 1),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "Open MPI", 5, 6, 2),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "MPICH/PMI", 1, 2, 0),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}, "MPICH/PMI", 3, 4, 1),
    ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4",
      "MV2_COMM_WORLD_LOCAL_RANK": "0"}, "MVAPICH", 2, 4, 0),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}, "SLURM", 7, 16, 3),
    ({}, "none", 0, 1, 0),
])
def test_discover(env, launcher, rank, world, local):
    p = discover(env)
    assert (p.launcher, p.rank, p.world_size, p.local_rank) == (launcher, rank, world, local)


def test_torchrun_wins_over_slurm_inside_an_allocation():
    p = discover({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert p.launcher == "torchrun/deepspeed" and p.rank == 1


@pytest.mark.parametrize("env,message", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
     "OMPI_COMM_WORLD_RANK=4 is outside OMPI_COMM_WORLD_SIZE=4"),
    ({"PMIX_RANK": "1"}, "PMIX_RANK=1 without a world size"),
])
def test_bad_environment(env, message):
    with pytest.raises(LaunchError, match=message):
        discover(env)


def test_mpi_launch_without_master_address_is_left_to_mpi_when_mpi_is_not_used():
    p = discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, use_mpi=False)
    assert (p.master_addr, p.master_port) == (None, None)


PRINT_PLACEMENT = ("import sys; sys.path.insert(0, {root!r})\n"
                   "from vescale_engine.launch.env import discover\n"
                   "p = discover()\n"
                   "assert discover() == p  # again (the engine asks twice): no new collective\n"
                   "print(repr((p.launcher, p.rank, p.world_size, p.local_rank, p.master_addr, "
                   "p.master_port, 'mpi4py' in sys.modules)))\n")
MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "PRTE_ALLOW_RUN_AS_ROOT": "1", "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def placements(tmp_path, launcher, env=()):
    """What each rank's discover() says, started by a real Open MPI launcher."""
    script = tmp_path / "where.py"
    script.write_text(PRINT_PLACEMENT.format(root=os.getcwd()))
    tool = os.path.join(os.path.dirname(sys.executable), launcher)
    out = run_job([tool, "-n", "2", *env, sys.executable, str(script)],
                  timeout=120,
                  env={**os.environ, **MPI_AS_ROOT, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    return sorted(ast.literal_eval(line) for line in out.stdout.splitlines())


@pytest.mark.parametrize("launcher,name", [("mpirun", "Open MPI"), ("prterun", "PMIx")])
def test_rank_zero_shares_its_address_over_mpi(tmp_path, launcher, name):
    (r0, r1) = placements(tmp_path, launcher)
    assert r0[:4] == (name, 0, 2, 0) and r1[:4] == (name, 1, 2, 1)
    assert r0[4:] == r1[4:] and r0[4] == "127.0.0.1" and r0[5] > 0 and r0[6] is True


def test_mpi_is_not_started_when_the_master_address_is_set(tmp_path):
    rows = placements(tmp_path, "mpirun", ["-x", "MASTER_ADDR=10.1.2.3", "-x", "MASTER_PORT=2345"])
    assert [r[4:] for r in rows] == [("10.1.2.3", 2345, False)] * 2


def test_the_library_does_not_import_the_launcher_and_the_old_name_still_works():
    """Layering: vescale_engine never imports launcher/ (rank discovery is the library's);
    `launcher.env` stays importable for scripts that used it."""
    code = ("import sys, vescale_engine, vescale_engine.engine.engine\n"
            "import vescale_engine.launch.process_group\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'launcher'], 'launcher'\n"
            "import launcher.env, vescale_engine.launch.env as lib\n"
            "assert launcher.env.discover is lib.discover\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
