"""`vescale run`: ranks get torchrun's environment, output is prefixed, a failing rank stops
the job with its status; on CPU each rank is bound to its own cores; the mpirun and deepspeed
command lines; hostfiles."""
import ast
import os
import sys

import pytest

from launcher import binding
from launcher.hostfile import Host, HostfileError, read_hostfile
from launcher.run import deepspeed_command, mpi_command
from dist_harness import run_job


def run(tmp_path, body, *args):
    script = tmp_path / "job.py"
    script.write_text(body)
    return run_job([sys.executable, "-m", "launcher.cli", "run", *args, str(script)],
                   timeout=120)


def rank_lines(out):
    return sorted(line for line in out.stdout.splitlines() if line.startswith("[rank"))


def test_ranks_get_environment_and_prefixes(tmp_path):
    out = run(tmp_path, "import os\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'], "
                        "os.environ['LOCAL_RANK'], os.environ['OMP_NUM_THREADS'])\n",
              "--nproc", "3", "--threads-per-rank", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert rank_lines(out) == ["[rank0] 0 3 0 1", "[rank1] 1 3 1 1", "[rank2] 2 3 2 1"]


def test_one_rank_failing_stops_the_others(tmp_path):
    body = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1': sys.exit(7)\n"
            "time.sleep(60)\n")
    out = run(tmp_path, body, "--nproc", "3")
    assert out.returncode == 7
    assert "rank 1 exited with status 7; stopping the other ranks" in out.stdout


def test_training_with_the_engine_under_vescale_run(tmp_path):
    body = ("import sys; sys.path.insert(0, 'tests'); import torch, fsdp_models as fm\n"
            "import vescale_engine\n"
            "engine, *_ = vescale_engine.initialize(model=fm.make('gpt'), config={\n"
            "    'train_micro_batch_size_per_gpu': 2, 'vescale': {'wrap_policy': "
            "{'module_classes': ['Block']}}})\n"
            "for step in range(2):\n"
            "    idx, tgt = fm.batch('gpt', step, 2)\n"
            "    loss = engine(idx, tgt); engine.backward(loss); engine.step()\n"
            "print('done', engine.global_steps, engine.world_size)\n")
    out = run(tmp_path, body, "--nproc", "2", "--threads-per-rank", "1")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "[rank0] done 2 2" in out.stdout and "[rank1] done 2 2" in out.stdout


@pytest.mark.parametrize("launcher", ["mpi", "deepspeed"])
def test_a_failing_rank_fails_the_job_under_mpirun_and_deepspeed(tmp_path, launcher):
    """Rank 1 fails at once; the other would sleep past run()'s 120 s timeout unless the
    launcher stops it."""
    body = ("import os, sys, time\n"
            "rank = os.environ.get('RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))\n"
            "if rank == '1': sys.exit(7)\n"
            "time.sleep(600)\n")
    out = run(tmp_path, body, "--launcher", launcher, "--nproc", "2")
    assert out.returncode == 7, out.stdout[-2000:] + out.stderr[-2000:]


# --- core binding -----------------------------------------------------------------------------

AFFINITY = "import os\nprint(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])\n"


def affinities(out):
    """{rank: (cores the rank saw, its OMP_NUM_THREADS)} from the ranks' own prints."""
    seen = {}
    for line in rank_lines(out):
        prefix, rest = line.split(" ", 1)
        cores, threads = rest.rsplit(" ", 1)
        seen[int(prefix[5:-1])] = (ast.literal_eval(cores), int(threads))
    return seen


def test_each_rank_runs_on_its_own_cores(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    nproc = min(2, len(usable))
    out = run(tmp_path, AFFINITY, "--nproc", str(nproc))
    assert out.returncode == 0, out.stdout + out.stderr
    seen = affinities(out)  # CPU ranks (conftest: VESCALE_BACKEND=gloo even on a GPU machine)
    per_rank = len(usable) // nproc
    assert seen == {r: (usable[r * per_rank:(r + 1) * per_rank], per_rank) for r in range(nproc)}
    first, second = out.stdout.splitlines()[:2]
    processor = binding.detect_processor()
    assert first == (f"vescale run: {processor.brand}, {processor.logical_cores} logical cores, "
                     f"{len(usable)} usable [{binding.core_ranges(usable)}]")
    assert second.startswith("vescale run: rank 0 -> cores [") and \
        second.endswith(f"OMP_NUM_THREADS={per_rank}" + (
            f"; cores [{binding.core_ranges(usable[nproc * per_rank:])}] left idle"
            if len(usable) % nproc else ""))


def test_more_ranks_than_cores_share_them_round_robin(tmp_path):
    """The launcher is itself confined to one core (as `taskset -c` would): every rank gets
    that core, one thread, and the log says so."""
    core = sorted(os.sched_getaffinity(0))[0]
    script = tmp_path / "job.py"
    script.write_text(AFFINITY)
    with binding.bound_to([core]):
        out = run_job([sys.executable, "-m", "launcher.cli", "run", "--nproc", "3",
                       str(script)], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert affinities(out) == {r: ([core], 1) for r in range(3)}
    assert "3 ranks on 1 cores: cores shared round-robin, one thread each" in out.stdout


def test_no_bind_cores_leaves_every_core_to_every_rank(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    out = run(tmp_path, AFFINITY, "--nproc", "2", "--no-bind-cores", "--threads-per-rank", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert affinities(out) == {0: (usable, 1), 1: (usable, 1)}
    assert "no core binding (--no-bind-cores); OMP_NUM_THREADS=1" in out.stdout.splitlines()[0]


def test_binding_plan():
    b = binding.plan_binding(3, list(range(8)))
    assert (b.cores, b.threads, b.shared, b.idle) == ([[0, 1], [2, 3], [4, 5]], 2, False, [6, 7])
    b = binding.plan_binding(2, [4, 5, 6, 7], threads=1)
    assert (b.cores, b.threads) == ([[4, 5], [6, 7]], 1)
    b = binding.plan_binding(5, [0, 1])
    assert (b.cores, b.threads, b.shared) == ([[0], [1], [0], [1], [0]], 1, True)
    assert binding.core_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


# --- mpirun and deepspeed command lines -------------------------------------------------------

def test_mpi_command_on_this_machine():
    cmd = mpi_command(["train.py", "--x"], [Host("localhost", 4)], None, threads=1,
                      env={"NCCL_DEBUG": "INFO", "HOME": "/root"}, as_root=True, usable_cores=2,
                      mpirun="mpirun", python="py")
    port = cmd[cmd.index("-x") + 3].split("=")[1]
    assert port.isdigit()
    assert cmd == ["mpirun", "-n", "4", "--allow-run-as-root", "--oversubscribe",
                   "--bind-to", "none", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}",
                   "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONUNBUFFERED=1",
                   "-x", "NCCL_DEBUG=INFO", "py", "train.py", "--x"]


def test_mpi_command_over_a_hostfile():
    hosts = [Host("node1", 8), Host("node2", 8)]
    cmd = mpi_command(["train.py"], hosts, "/tmp/hf", threads=4, env={"MASTER_PORT": "1234"},
                      as_root=False, usable_cores=32, mpirun="mpirun", python="py")
    assert cmd == ["mpirun", "-n", "16", "--hostfile", "/tmp/hf",
                   "--map-by", "slot:PE=4", "--bind-to", "core", "-x", "MASTER_ADDR=node1", "-x", "MASTER_PORT=1234",
                   "-x", "OMP_NUM_THREADS=4", "-x", "PYTHONUNBUFFERED=1", "py", "train.py"]


def test_mpi_command_binds_gpu_ranks_to_numa_nodes():
    """GPU ranks fill each NUMA node in turn and are bound to it; a node size that does not
    split over the NUMA nodes is left unbound rather than bound wrongly."""
    hosts = [Host("node1", 8), Host("node2", 8)]
    cmd = mpi_command(["t.py"], hosts, "/tmp/hf", threads=4, env={}, as_root=False,
                      usable_cores=64, mpirun="mpirun", python="py", gpu_ranks=True,
                      numa_nodes=2)
    assert cmd[5:9] == ["--map-by", "ppr:4:numa", "--bind-to", "numa"], cmd
    odd = mpi_command(["t.py"], [Host("node1", 3)], "/tmp/hf", threads=4, env={},
                      as_root=False, usable_cores=64, mpirun="mpirun", python="py",
                      gpu_ranks=True, numa_nodes=2)
    assert odd[5:9] == ["--map-by", "slot", "--bind-to", "none"], odd


def test_deepspeed_command():
    one = deepspeed_command(["train.py", "--c"], [Host("localhost", 2)], None,
                            env={"MASTER_PORT": "4321"}, deepspeed="deepspeed")
    assert one == ["deepspeed", "--num_gpus", "2", "--no_ssh_check", "--master_addr",
                   "127.0.0.1", "--master_port", "4321", "train.py", "--c"]
    two = deepspeed_command(["train.py"], [Host("a", 8), Host("b", 8)], "/tmp/hf", env={},
                            deepspeed="deepspeed")
    assert two == ["deepspeed", "--hostfile", "/tmp/hf", "--num_gpus", "8",
                   "--master_port", "29500", "train.py"]
    remote = deepspeed_command(["train.py"], [Host("node7", 4)], "/tmp/hf", env={},
                               deepspeed="deepspeed")
    assert remote == ["deepspeed", "--hostfile", "/tmp/hf", "--num_gpus", "4", "--force_multi",
                      "--master_port", "29500", "train.py"]
    uneven = deepspeed_command(["train.py"], [Host("a", 8), Host("b", 4)], "/tmp/hf",
                               env={"MASTER_ADDR": "a"}, deepspeed="deepspeed")
    assert uneven == ["deepspeed", "--hostfile", "/tmp/hf", "--master_addr", "a",
                      "--master_port", "29500", "train.py"]


def test_mpi_oversubscribes_only_this_machine():
    one = mpi_command(["t.py"], [Host("localhost", 3)], "/tmp/hf", threads=1, env={},
                      as_root=False, usable_cores=2, mpirun="mpirun", python="py")
    assert one[:5] == ["mpirun", "-n", "3", "--hostfile", "/tmp/hf"] and "--oversubscribe" in one
    fits = mpi_command(["t.py"], [Host("localhost", 2)], None, threads=1, env={},
                       as_root=False, usable_cores=2, mpirun="mpirun", python="py")
    remote = mpi_command(["t.py"], [Host("node1", 64)], "/tmp/hf", threads=1, env={},
                         as_root=False, usable_cores=2, mpirun="mpirun", python="py")
    assert "--oversubscribe" not in fits and "--oversubscribe" not in remote


def test_mpi_launch_translates_an_mpich_hostfile_and_nproc_overrides_slots(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:5  # MPICH form\n")
    out = run(tmp_path, "import os\nprint(os.environ['OMPI_COMM_WORLD_RANK'], "
                        "os.environ['OMPI_COMM_WORLD_SIZE'], os.environ['MASTER_ADDR'])\n",
              "--launcher", "mpi", "--hostfile", str(hostfile), "--nproc", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    launched = out.stdout.splitlines()[0]
    assert launched.startswith("vescale run: ") and " -n 2 --hostfile " in launched
    assert sorted(out.stdout.splitlines()[1:]) == ["0 2 127.0.0.1", "1 2 127.0.0.1"]


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("node1 slots=4\nnode2 slots=x\n", r"hosts:2: slots must be a positive integer, got 'x'"),
    ("node1 slots=0\n", r"hosts:1: slots must be a positive integer, got '0'"),
    ("node1:two\n", r"hosts:1: slots must be a positive integer, got 'two'"),
    ("node1 gpus=4\n", r"hosts:1: unknown field 'gpus'"),
    ("node1 slots 4\n", r"hosts:1: cannot read 'node1 slots 4'"),
    ("slots=4\n", r"hosts:1: 'slots=4' starts with a field"),
    ("a slots=1\n# c\nb slots=1\na slots=2\n", r"hosts:4: host 'a' is listed twice \(first on "
                                                r"line 1\)"),
    ("# nothing\n\n", r"lists no hosts"),
])
def test_bad_hostfile(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(HostfileError, match=message):
        read_hostfile(str(path))


def test_hostfile_formats(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=8 max_slots=16\nnode2:4\nnode3\n\n")
    assert read_hostfile(str(path)) == [Host("node1", 8), Host("node2", 4), Host("node3", 1)]


@pytest.mark.parametrize("args,message", [
    (["--launcher", "mpi", "--hostfile", "missing-hosts"], "hostfile missing-hosts not found"),
    (["--hostfile", "tests/conftest.py"], "--hostfile needs --launcher mpi or --launcher "
                                          "deepspeed"),
    (["--launcher", "deepspeed", "--hostfile", "tests/conftest.py"],
     "tests/conftest.py:1: cannot read"),
])
def test_bad_launch_is_one_line_before_anything_starts(tmp_path, args, message):
    out = run(tmp_path, "print('started')\n", *args)
    assert out.returncode == 2
    assert "started" not in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vescale run: error: ") and message in lines[0]


def test_a_job_that_times_out_leaves_no_process_behind(tmp_path):
    """The harness's run_job kills the whole session of a timed-out job (a launcher that died
    of the timeout would otherwise leave its ranks running, holding ports and build locks)."""
    import subprocess as sp
    marker = tmp_path / "left"
    script = f"sleep 300 & echo $! > {marker}; sleep 300"
    with pytest.raises(sp.TimeoutExpired):
        run_job(["bash", "-c", script], timeout=2)
    left = int(marker.read_text())
    try:
        with open(f"/proc/{left}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z"), f"the job's background process {left} is still {state}"
