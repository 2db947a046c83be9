"""Launch environment discovery for each launcher, and bad environments."""
import pytest

from launcher.env import LaunchError, discover


@pytest.mark.parametrize("env,launcher,rank,world,local", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
      "MASTER_PORT": "29500"}, "torchrun/deepspeed", 3, 8, 1),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "Open MPI", 5, 6, 2),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "MPICH/PMI", 1, 2, 0),
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
])
def test_bad_environment(env, message):
    with pytest.raises(LaunchError, match=message):
        discover(env)
