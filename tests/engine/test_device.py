"""One device model: the backend and device of each rank for every launcher's environment
(a faked GPU count), the NCCL join order (set_device, then init_process_group with device_id)
through monkeypatched torch.cuda / torch.distributed, a group the user created, model
placement errors, monitor values written without waiting for the GPU, and `vescale run`'s
NUMA binding from a fake sysfs tree."""
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_models as fm
from launcher import gpu_binding
from vescale_engine.launch import device as dev
from vescale_engine.launch import env as launch_env
from vescale_engine.engine import weights
from vescale_engine.launch import process_group as distributed
from vescale_engine.engine import monitor
from vescale_engine.launch.env import discover

CUDA = torch.device


# -- backend and device per launcher (pure) ------------------------------------------------------

@pytest.mark.parametrize("env,count,expected", [
    # torchrun / vescale run: all 8 GPUs visible, LOCAL_RANK picks one
    ({"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3"}, 8, "cuda:3"),
    # deepspeed --include host:2,3: CUDA_VISIBLE_DEVICES=2,3 and LOCAL_RANK indexes into it
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, 2,
     "cuda:1"),
    # mpirun: Open MPI's local rank, every GPU visible
    ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 4, "cuda:2"),
    # SLURM --gpus-per-task=1: local rank 3 sees only its own GPU
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
      "CUDA_VISIBLE_DEVICES": "3"}, 1, "cuda:0"),
    # SLURM --gpus-per-task=2: local rank 3 sees GPUs 6,7 and takes the second
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3",
      "CUDA_VISIBLE_DEVICES": "6,7"}, 2, "cuda:1"),
    # an mpirun wrapper that gives each rank one GPU through CUDA_VISIBLE_DEVICES
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "5"}, 1, "cuda:0"),
    # VESCALE_BACKEND=gloo on a GPU machine: CPU ranks
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "VESCALE_BACKEND": "gloo"}, 8, "cpu"),
    # no CUDA: gloo on the CPU
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 0, "cpu"),
])
def test_device_of_each_launcher(env, count, expected):
    where = discover(env, use_mpi=False)
    backend = dev.choose_backend(env, cuda_available=count > 0)
    device = dev.choose_device(backend, where.local_rank, count, where.launcher,
                               env.get("CUDA_VISIBLE_DEVICES"))
    assert device == torch.device(expected)
    assert backend == ("gloo" if expected == "cpu" else "nccl")


@pytest.mark.parametrize("env,count,message", [
    # torchrun --nproc 2 on a one-GPU box: both ranks would be on cuda:0
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 1,
     r"local rank 1 \(torchrun/deepspeed\) but only 1 visible GPU\(s\): NCCL cannot run two "
     r"ranks on one GPU"),
    # the same under torchrun with CUDA_VISIBLE_DEVICES=0 (every local rank sees that one)
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"}, 1,
     "NCCL cannot run two ranks on one GPU"),
    # SLURM with every GPU of a 4-GPU node visible, but 8 tasks on it
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "5"}, 4,
     r"local rank 5 \(SLURM\) but only 4"),
])
def test_two_ranks_on_one_gpu_is_an_error(env, count, message):
    where = discover(env, use_mpi=False)
    with pytest.raises(dev.DeviceError, match=message):
        dev.choose_device("nccl", where.local_rank, count, where.launcher,
                          env.get("CUDA_VISIBLE_DEVICES"))


@pytest.mark.parametrize("env,cuda,expected", [
    ({}, True, "nccl"), ({}, False, "gloo"), ({"VESCALE_BACKEND": "gloo"}, True, "gloo"),
    ({"VESCALE_BACKEND": " NCCL "}, True, "nccl"),
])
def test_backend_choice(env, cuda, expected):
    assert dev.choose_backend(env, cuda) == expected


@pytest.mark.parametrize("env,cuda,message", [
    ({"VESCALE_BACKEND": "mpi"}, True, r"VESCALE_BACKEND='mpi' is not one of gloo, nccl"),
    ({"VESCALE_BACKEND": "nccl"}, False, "VESCALE_BACKEND=nccl but no CUDA device is visible"),
])
def test_bad_backend_choice(env, cuda, message):
    with pytest.raises(dev.DeviceError, match=message):
        dev.choose_backend(env, cuda)


# -- the NCCL join and teardown, through fakes of torch.cuda and torch.distributed -----------

@pytest.fixture
def fake_gpus(monkeypatch):
    """4 fake GPUs; records set_device and the process group calls in order."""
    calls = []
    current = {"index": 0}

    def set_device(device):
        current["index"] = torch.device(device).index
        calls.append(("set_device", torch.device(device)))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    for name in ("VESCALE_BACKEND", "CUDA_VISIBLE_DEVICES", "SLURM_PROCID", "PMI_RANK",
                 "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    return calls, current


def test_nccl_join_sets_the_device_before_the_group_forms(fake_gpus, monkeypatch):
    calls, _ = fake_gpus
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def meet(where, address, timeout_s):  # the store and the join check: no network here
        calls.append(("meet", address))
        return dist.HashStore(), None
    monkeypatch.setattr(distributed, "meet_the_others", meet)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw["device_id"],
                                                            kw["rank"], kw["world_size"])))
    exits = []
    monkeypatch.setattr(distributed.atexit, "register", lambda fn, *a: exits.append((fn, a)))
    device = distributed.join_process_group(60)
    assert device == CUDA("cuda", 2)
    assert calls == [("set_device", CUDA("cuda", 2)), ("meet", "10.0.0.1:29500"),
                     ("init", "cpu:gloo,cuda:nccl", CUDA("cuda", 2), 6, 8)]
    # at exit: a barrier on this rank's GPU, then the group goes
    calls.clear()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda device_ids: calls.append(("barrier", device_ids)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append(("destroy",)))
    # (the exit step that lets gloo's threads finish, launch/settle.py, may be registered too,
    # before: it runs after the barrier)
    (fn, args), = [(fn, args) for fn, args in exits if fn is distributed.leave_process_group]
    fn(*args)
    assert calls == [("barrier", [2]), ("destroy",)]


def test_a_failed_nccl_join_says_why_in_one_line(fake_gpus, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    monkeypatch.setattr(distributed, "meet_the_others",
                        lambda where, address, timeout_s: (dist.HashStore(), None))

    def refuse(*a, **kw):
        raise dist.DistError("NCCL error: invalid usage\nDuplicate GPU detected")
    monkeypatch.setattr(dist, "init_process_group", refuse)
    with pytest.raises(distributed.LaunchError) as err:
        distributed.join_process_group(5)
    assert "on cuda:1" in str(err.value) and "NCCL error: invalid usage" in str(err.value)
    assert "\n" not in str(err.value)


def test_mpi_rank_sets_its_gpu_before_mpi_starts(fake_gpus):
    calls, _ = fake_gpus
    env = {"OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    launch_env.set_device_before_mpi(env)
    assert calls == [("set_device", CUDA("cuda", 3))]
    launch_env.set_device_before_mpi({**env, "VESCALE_BACKEND": "gloo"})  # CPU ranks: no GPU touched
    launch_env.set_device_before_mpi({"PMIX_RANK": "1"})  # PMIx alone: local rank known after MPI
    assert calls == [("set_device", CUDA("cuda", 3))]


def test_a_group_the_user_created_gets_the_rank_device(fake_gpus, monkeypatch):
    calls, current = fake_gpus
    where = discover({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, use_mpi=False)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=types.SimpleNamespace(
        bound_device_id=None)))
    assert dev.adopt_group_device(where) == CUDA("cuda", 1)  # deepspeed.init_distributed left 0
    assert calls == [("set_device", CUDA("cuda", 1))]
    current["index"] = 3  # the script set another GPU itself
    with pytest.raises(dev.DeviceError, match=r"current CUDA device is cuda:3 but local rank 1's "
                                              r"device is cuda:1"):
        dev.adopt_group_device(where)
    current["index"] = 0
    dist.group.WORLD.bound_device_id = CUDA("cuda", 0)  # init_process_group(device_id=cuda:0)
    with pytest.raises(dev.DeviceError, match=r"created with device_id=cuda:0 but local rank "
                                              r"1's device is cuda:1"):
        dev.adopt_group_device(where)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    assert dev.adopt_group_device(where) == CUDA("cpu")


# -- model placement ---------------------------------------------------------------------------

def test_model_placement_errors_and_the_move():
    meta = nn.Sequential(nn.Linear(2, 2, device="meta"))
    assert weights.place_model(meta, CUDA("cuda", 3)) is meta  # materialized after wrapping
    assert meta[0].weight.is_meta
    with pytest.raises(dev.DeviceError, match=r"^1.weight is on the meta device but 0.weight is "
                                              r"on cpu: build the whole model on meta"):
        weights.place_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta")),
                        torch.device("cpu"))

    class Elsewhere(nn.Module):  # a parameter on another GPU, without a GPU
        def named_parameters(self, *a, **kw):
            yield "w", types.SimpleNamespace(device=CUDA("cuda", 0))

    with pytest.raises(dev.DeviceError, match=r"^w is on cuda:0 but this rank's device is "
                                              r"cuda:3: build the model on CPU"):
        weights.place_model(Elsewhere(), CUDA("cuda", 3))
    with pytest.raises(dev.DeviceError, match="w is on cuda:0 but this rank's device is cpu"):
        weights.place_model(Elsewhere(), CUDA("cpu"))
    moved = []

    class OnCpu(nn.Linear):
        def to(self, device):
            moved.append(device)
            return self
    model = OnCpu(2, 2)
    assert weights.place_model(model, CUDA("cuda", 3)) is model and moved == [CUDA("cuda", 3)]
    assert weights.place_model(model, CUDA("cpu")) is model and moved == [CUDA("cuda", 3)]


# -- initialize with a process group the user created (2 gloo ranks) -----------------------------

CONFIG = {"train_micro_batch_size_per_gpu": 2,
          "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}


def user_group_rank(rank, world, dist_init_required):
    from vescale_engine import initialize
    data = [fm.batch("gpt", k, 1)[0][0] for k in range(4)]
    engine, _, loader, _ = initialize(model=fm.make("gpt"), config=CONFIG, training_data=data,
                                      dist_init_required=dist_init_required)
    idx, tgt = fm.batch("gpt", rank, 2)
    loss = engine(idx.to(engine.device), tgt.to(engine.device))
    engine.backward(loss)
    engine.step()
    placed = {str(p.device) for p in engine.module.parameters()}
    device, pinned, steps = str(engine.device), loader.pin_memory, engine.global_steps
    assert (device, placed, pinned, steps) == ("cpu", {"cpu"}, False, 1)


@pytest.mark.parametrize("dist_init_required", [None, False])
def test_initialize_adopts_the_group_the_user_created(pool, dist_init_required):
    """The pool's ranks called dist.init_process_group themselves (gloo)."""
    pool.run(user_group_rank, dist_init_required)


def meta_model_rank(rank, world):
    """A meta model that materialize cannot initialize (a buffer computed in __init__, lost on
    meta): initialize stops before building the optimizer, naming the buffer, on every rank."""
    from vescale_engine import initialize

    class WithMask(fm.GPT):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.ones(4))
    with torch.device("meta"):
        model = WithMask()
    message = "no error"
    try:
        initialize(model=model, config=CONFIG)
    except RuntimeError as err:
        message = str(err)
    assert message.startswith("mask (WithMask) is a buffer that was on the meta device and "
                              "no init wrote it"), message


def test_a_meta_model_that_cannot_be_initialized_is_a_one_line_error(pool):
    pool.run(meta_model_rank)


# -- monitor values written once their copy to the host has landed -----------------------------

def test_monitor_values_wait_for_their_copy_without_blocking(monkeypatch):
    written = []
    sink = types.SimpleNamespace(write_events=lambda events: written.append(events))
    pending = monitor.PendingScalars(sink)
    pending.add([("Train/Samples/lr", 0.5, 8)])  # host values: written at once
    pending.write_ready()
    assert written == [[("Train/Samples/lr", 0.5, 8)]]

    class Marker:  # a CUDA event stand-in: the copy lands when `done` says
        done = False

        def query(self):
            return Marker.done

        def synchronize(self):
            Marker.done = True
    monkeypatch.setattr(monitor, "_copy_done_marker", lambda device: Marker())

    class OnGpu(torch.Tensor):  # looks like a device tensor; copies to the host as itself
        device = CUDA("cuda", 0)

        def to(self, *a, **kw):
            return torch.Tensor(self)
    loss = torch.tensor(2.5).as_subclass(OnGpu)
    pending.add([("Train/Samples/train_loss", loss, 16)])
    pending.add([("Train/Samples/train_loss", loss, 24)])
    pending.write_ready()
    assert len(written) == 1 and len(pending) == 2  # not landed: nothing waited for
    Marker.done = True
    pending.write_ready()
    assert written[1:] == [[("Train/Samples/train_loss", 2.5, 16)],
                           [("Train/Samples/train_loss", 2.5, 24)]]
    Marker.done = False
    pending.add([("Train/Samples/train_loss", loss, 32)])
    pending.write_ready(wait=True)  # the progress line's step, or teardown: wait once
    assert written[-1] == [("Train/Samples/train_loss", 2.5, 32)] and len(pending) == 0


# -- `vescale run`: CUDA ranks bound to their GPU's NUMA node (fake sysfs) ------------------------

def fake_sysfs(root, gpus, nodes):
    """gpus: {bus id: numa node}; nodes: {node: cpulist text}."""
    for bus, node in gpus.items():
        path = root / "bus" / "pci" / "devices" / bus
        path.mkdir(parents=True)
        (path / "numa_node").write_text(f"{node}\n")
    for node, cpulist in nodes.items():
        path = root / "devices" / "system" / "node" / f"node{node}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(cpulist + "\n")
    return str(root)


def test_gpu_ranks_bind_to_their_numa_node(tmp_path):
    buses = ["0000:1b:00.0", "0000:43:00.0", "0000:9b:00.0", "0000:c3:00.0"]
    sysfs = fake_sysfs(tmp_path, dict(zip(buses, [0, 0, 1, 1])),
                       {0: "0-7,16-23", 1: "8-15,24-31"})
    usable = list(range(32))
    plan = gpu_binding.plan_gpu_binding(4, buses, usable, sysfs)
    assert plan.nodes == [0, 0, 1, 1] and plan.threads == 8
    assert plan.cores == [[0, 1, 2, 3, 4, 5, 6, 7], [16, 17, 18, 19, 20, 21, 22, 23],
                          [8, 9, 10, 11, 12, 13, 14, 15], [24, 25, 26, 27, 28, 29, 30, 31]]
    assert gpu_binding.numa_node_count(sysfs) == 2
    # a container allowed only some cores; GPU 3's node unknown (-1); 3 ranks of 4 GPUs
    sysfs = fake_sysfs(tmp_path / "b", {**dict(zip(buses[:3], [0, 0, 1])), buses[3]: -1},
                       {0: "0-7", 1: "8-15"})
    plan = gpu_binding.plan_gpu_binding(4, buses, [2, 3, 4, 5, 8, 9], sysfs, threads=1)
    assert plan.cores == [[2, 3], [4, 5], [8, 9], None] and plan.threads == 1
    line, = gpu_binding.describe(buses, plan)
    assert "rank 2 -> GPU 2 (0000:9b:00.0), NUMA node 1, cores [8-9]" in line
    assert "rank 3 -> GPU 3 (0000:c3:00.0), unbound (NUMA node unknown)" in line
    assert gpu_binding.parse_cpulist("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]


def test_more_gpu_ranks_than_gpus_is_an_error():
    with pytest.raises(ValueError, match=r"--nproc 3 but 2 visible GPU\(s\): NCCL cannot run "
                                         r"two ranks on one GPU"):
        gpu_binding.plan_gpu_binding(3, ["0000:1b:00.0", "0000:43:00.0"], [0, 1])


def test_vescale_run_plans_gpu_binding_when_ranks_use_nccl(monkeypatch, tmp_path):
    """`vescale run`'s local plan for CUDA ranks, with a faked GPU list: the NUMA binding (or
    the error for too many ranks), also with --no-bind-cores."""
    import io
    from launcher import run
    monkeypatch.setenv("VESCALE_BACKEND", "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    buses = ["0000:1b:00.0", "0000:9b:00.0"]
    monkeypatch.setattr(gpu_binding, "gpu_bus_ids", lambda: buses)
    sysfs = fake_sysfs(tmp_path, dict(zip(buses, [0, 1])), {0: "0", 1: "1"})
    real = gpu_binding.plan_gpu_binding
    monkeypatch.setattr(gpu_binding, "plan_gpu_binding",
                        lambda n, b, u, threads=None: real(n, b, [0, 1], sysfs, threads))
    out = io.StringIO()
    cores, threads = run._local_plan(2, None, True, out)
    assert (cores, threads) == ([[0], [1]], 1)
    assert "rank 1 -> GPU 1 (0000:9b:00.0), NUMA node 1, cores [1]" in out.getvalue()
    with pytest.raises(ValueError, match="--nproc 3 but 2 visible GPU"):
        run._local_plan(3, None, False, io.StringIO())
