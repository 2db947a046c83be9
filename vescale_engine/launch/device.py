"""One device model: which backend and which device each rank uses (weights.place_model
puts the model there). NCCL ranks use `cuda:(local_rank % visible GPUs)` (one GPU per rank; NCCL refuses two
ranks on one GPU), gloo ranks use the CPU. The choices are pure functions of the launch
environment and the visible GPU count, so every launcher's case is testable without a GPU."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["DeviceError", "choose_backend", "choose_device", "device_of_rank",
           "adopt_group_device", "NCCL_WITH_CPU"]

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
    """(backend, device) for the rank `where` (a launch.env.Placement) on this machine."""
    env = os.environ if env is None else env
    backend = choose_backend(env, torch.cuda.is_available())
    count = torch.cuda.device_count() if backend == "nccl" else 0
    return backend, choose_device(backend, where.local_rank, count, where.launcher,
                                  env.get("CUDA_VISIBLE_DEVICES"))


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
