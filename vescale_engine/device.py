"""One device model: which backend and which device each rank uses, and putting the model
there. NCCL ranks use `cuda:(local_rank % visible GPUs)` (one GPU per rank; NCCL refuses two
ranks on one GPU), gloo ranks use the CPU. The choices are pure functions of the launch
environment and the visible GPU count, so every launcher's case is testable without a GPU."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

BACKENDS = ("gloo", "nccl")
# NCCL for CUDA tensors, gloo for CPU ones (object collectives, monitored_barrier, CPU state).
NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"
# Launchers that start every local rank from one process with one environment, so its ranks
# all see the same GPUs (SLURM and MPI tasks may each be given their own).
_SAME_GPUS_FOR_ALL_LOCAL_RANKS = ("torchrun/deepspeed", "none")


class DeviceError(ValueError):
    """The device setup cannot work; the message names the problem."""


def choose_backend(env, cuda_available: bool) -> str:
    """"gloo" or "nccl": VESCALE_BACKEND when set, else NCCL when CUDA is available."""
    chosen = env.get("VESCALE_BACKEND", "").strip().lower()
    if not chosen:
        return "nccl" if cuda_available else "gloo"
    if chosen not in BACKENDS:
        raise DeviceError(f"VESCALE_BACKEND={env['VESCALE_BACKEND']!r} is not one of "
                          f"{', '.join(BACKENDS)}")
    if chosen == "nccl" and not cuda_available:
        raise DeviceError("VESCALE_BACKEND=nccl but no CUDA device is visible")
    return chosen


def choose_device(backend: str, local_rank: int, device_count: int, launcher: str = "none",
                  visible_devices: str | None = None) -> torch.device:
    """This rank's device. NCCL: GPU `local_rank % device_count`, which covers all GPUs visible
    (torchrun, deepspeed --include, mpirun) and one GPU per task (SLURM --gpus-per-task=1:
    local rank 3 sees one GPU, cuda:0). Two ranks certainly on one GPU is an error: more local
    ranks than GPUs when every local rank sees the same GPUs (all of the machine's, or one
    launcher's environment)."""
    if backend == "gloo":
        return torch.device("cpu")
    if device_count < 1:
        raise DeviceError("the NCCL backend needs a visible CUDA device; none is "
                          f"(CUDA_VISIBLE_DEVICES={visible_devices!r})")
    shared = local_rank >= device_count and (
        visible_devices is None or launcher in _SAME_GPUS_FOR_ALL_LOCAL_RANKS)
    if shared:
        raise DeviceError(f"local rank {local_rank} ({launcher}) but only {device_count} "
                          f"visible GPU(s): NCCL cannot run two ranks on one GPU; start at most "
                          f"{device_count} ranks per machine, or set VESCALE_BACKEND=gloo")
    return torch.device("cuda", local_rank % device_count)


def device_of_rank(where, env=None) -> tuple:
    """(backend, device) for the rank `where` (a launch_env.Placement) on this machine."""
    env = os.environ if env is None else env
    backend = choose_backend(env, torch.cuda.is_available())
    count = torch.cuda.device_count() if backend == "nccl" else 0
    return backend, choose_device(backend, where.local_rank, count, where.launcher,
                                  env.get("CUDA_VISIBLE_DEVICES"))


def set_device_before_mpi(env) -> None:
    """Under an MPI launcher, make this rank's GPU current before MPI starts (CUDA-aware MPI
    would otherwise open a context on GPU 0 in every rank)."""
    from .launch_env import LaunchError, discover
    try:
        where = discover(env, use_mpi=False)  # the launcher's local rank, without MPI
    except LaunchError:
        return  # PMIx alone names no local rank before MPI: set after the group forms
    backend, device = device_of_rank(where, env)
    if backend == "nccl":
        torch.cuda.set_device(device)


def adopt_group_device(where) -> torch.device:
    """The device for a process group someone else created (deepspeed.init_distributed,
    dist.init_process_group): made current for NCCL; a group or current device that is
    already another GPU is an error (the rank would talk to NCCL on the wrong GPU)."""
    backend = dist.get_backend()
    if "nccl" not in backend:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    device = choose_device("nccl", where.local_rank, count, where.launcher,
                           os.environ.get("CUDA_VISIBLE_DEVICES"))
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound != device:
        raise DeviceError(f"the process group was created with device_id={bound} but local "
                          f"rank {where.local_rank}'s device is {device}")
    current = torch.cuda.current_device()
    if current not in (0, device.index):  # 0 is also CUDA's default: nobody chose it
        raise DeviceError(f"the current CUDA device is cuda:{current} but local rank "
                          f"{where.local_rank}'s device is {device}: call "
                          f"torch.cuda.set_device({device.index}) or leave it to initialize")
    torch.cuda.set_device(device)
    return device


def default_device(group=None) -> torch.device:
    """The device a process group's tensors live on when nobody said: the current CUDA device
    when NCCL serves CUDA tensors in `group`, else the CPU (what `materialize(device=None)`
    uses outside the engine; inside it, `engine.device`)."""
    from .collectives import backend_for
    config = dist.get_backend_config(group if group is not None else dist.group.WORLD)
    try:
        if backend_for(config, "cuda") == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    except ValueError:  # no backend for CUDA tensors in this group
        pass
    return torch.device("cpu")


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Move a CPU model to this rank's GPU before wrapping (as DeepSpeed's engine does). A
    model on meta stays there (initialize materializes it after wrapping); a model that mixes
    meta with real tensors (unless a vescale zero.Init built it: then the real ones, added
    after the build, move), or sits on another device than this rank's, is an error."""
    from .zero_init import deferred_record
    named = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, tensor in named if tensor.device.type == "meta"]
    if meta and len(meta) < len(named) and deferred_record(model) is not None:
        # built under a vescale zero.Init, then given real tensors (PEFT adapters, a new head):
        # those move (the deferred modules' own wait for initialize: zero_init)
        return model.to(device) if device.type == "cuda" else model
    if meta and len(meta) < len(named):
        real = next((name, t.device) for name, t in named if t.device.type != "meta")
        raise DeviceError(f"{meta[0]} is on the meta device but {real[0]} is on {real[1]}: "
                          "build the whole model on meta (initialize materializes it) or on CPU")
    if meta:
        return model
    for name, tensor in named:
        where = tensor.device
        if where != device and not (where.type == "cpu" and device.type == "cuda"):
            raise DeviceError(f"{name} is on {where} but this rank's device is {device}: build "
                              f"the model on CPU, or on {device} (engine.device)")
    return model.to(device) if device.type == "cuda" else model
