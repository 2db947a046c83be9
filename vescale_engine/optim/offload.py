"""ZeRO-Offload (`zero_optimization.offload_optimizer` and `offload_param`, device "cpu").

For each offloaded DBuffer one host allocation (pinned when asked and the device is an
accelerator) holds the fp32 master shard, the fp32 gradient shard and the optimizer's
state (AdamW's two moments; AdamW8bit's codes and scales), plus the compute-dtype shard where
it lives on the host (offload_param) or the staging tensor its refresh casts into. The master
moves there for good (`DBuffer.move_master_to_host`): the sharded parameters are re-pointed at
it (`ShardedParameter.bind_storage`, the same Parameter objects), so checkpoints, Hugging Face
loading and GatheredParameters read and write the host master. The device keeps a shard in the
compute dtype that all-gather sends (shard/compute_shard.py; refreshed after every host step
and whenever the master's version counter moved): 2 bytes per element for bf16 compute
instead of 8 (master + gradient). Each reduction's result goes to the host gradient shard as
its unit finishes reducing (`PendingReduction.finish`: cast to fp32 on the device, copied
asynchronously into pinned memory, waited for at the end of backward; accumulation adds on the
host), so clipping, fp16 unscaling and the overflow check read host gradients. With
offload_param the compute shard lives on the host too and each all-gather copies it into this
rank's slot of the full buffer: nothing of an offloaded buffer stays on the device between uses.

Per offloaded buffer (`OffloadStats` counts the bytes): the gradient shard to the host once
per reduction (4 bytes per element, every micro-step), and per step one vectorized step of
the whole flat shard there with the same kernel as the device path (torch's fused AdamW, CPU
build), then the compute shard refreshed: 2 bytes per element back for bf16 (4 for fp32). With
offload_param nothing comes back at the step; each all-gather copies the compute shard to the
device instead (2 bytes per element per gather).

`ratio` < 1 offloads whole buffers, largest shard first, until that fraction of the optimizer's
bytes is offloaded; the rest keep master and state on the device and step there (offload_param
acts on the offloaded buffers only). Shard sizes are the same on every rank, so every rank
chooses the same buffers.

AdamW, AdamW8bit and Muon (ours) offload; `check_offloadable` names what works for the others.
Muon keeps its per-parameter state (momentum, and AdamW's moments for what is not a matrix) in
host memory beside the host master and steps it there; only Newton-Schulz runs on the device
(optim/muon.py says what that moves).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OffloadStats", "HostShard", "OptimizerOffload", "check_offloadable",
           "choose_offloaded", "faces_in"]


@dataclass
class OffloadStats:
    """Bytes the offload copied (each way) and the host steps it ran, for tests and estimates."""
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    host_steps: int = 0

    def reset(self):
        self.bytes_to_host = self.bytes_to_device = self.host_steps = 0


class HostShard:
    """One buffer's host memory, one allocation: the master, the gradient copy, the optimizer's
    state tensors (`parts`, by name) as its `state_layout` lists them, and the compute-dtype
    shard (`compute`, with offload_param) or the staging tensor its refresh casts into
    (`staging`, an accelerator and a compute dtype other than the master's), when needed. Each
    part has a version counter of its own: a write to one is not a write to the master."""

    def __init__(self, buf, state_layout, pin_memory: bool, offload_param: bool = False):
        S = buf.shard_size
        master_dtype = buf.master.dtype
        layout = [("master", master_dtype, S), ("grad", master_dtype, S), *state_layout]
        if buf.param_dtype != master_dtype:
            if offload_param:
                layout.append(("compute", buf.param_dtype, S))
            elif buf.device.type != "cpu":
                layout.append(("staging", buf.param_dtype, S))
        # widest elements first: every part starts aligned for its dtype
        layout.sort(key=lambda part: -part[1].itemsize)
        pin = pin_memory and buf.device.type != "cpu"  # pinning needs an accelerator
        total = sum(dtype.itemsize * n for _, dtype, n in layout)
        self.storage = torch.zeros(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.parts, at = {}, 0
        for name, dtype, n in layout:
            part = torch.empty(0, dtype=dtype, device="cpu")
            part.set_(self.storage.untyped_storage(), at // dtype.itemsize, (n,))
            self.parts[name] = part
            at += dtype.itemsize * n
        self.master, self.grad = self.parts["master"], self.parts["grad"]
        self.pinned = pin


def check_offloadable(optimizer) -> None:
    """A one-line error unless `optimizer` can offload (ours AdamW, AdamW8bit:
    `offload_to_host`)."""
    if not hasattr(optimizer, "offload_to_host"):
        cls = type(optimizer)
        name = cls.__name__ if cls.__module__.startswith("vescale_engine") else \
            f"{cls.__module__}.{cls.__name__}"
        raise ValueError(f"zero_optimization.offload_optimizer: optimizer {name} is not yet "
                         "supported with offload; offload works with optimizer types AdamW, "
                         "AdamW8bit and Muon (ours, over whole flat buffers)")


def faces_in(params):
    """`faces_of` for OptimizerOffload: every ShardedParameter laid out in a buffer, found
    through the units of the optimizer's `params` (so a frozen tensor of the same buffer, which
    the optimizer was not given, is re-pointed at the host master too)."""
    units = {id(p._vescale.unit): p._vescale.unit for p in params}

    def faces_of(buf):
        return [sp for unit in units.values() for sp in unit.params if sp.buffer is buf]
    return faces_of


def choose_offloaded(buffers, ratio: float) -> list:
    """The buffers to offload: largest shard first until `ratio` of all shard bytes are."""
    total = sum(b.shard_size for b in buffers)
    chosen, done = [], 0
    for buf in sorted(buffers, key=lambda b: -b.shard_size):  # stable: same order everywhere
        if done >= ratio * total or ratio <= 0:
            break
        chosen.append(buf)
        done += buf.shard_size
    return chosen


class OptimizerOffload:
    """Which of an optimizer's buffers step on the host, their host memory and the copies."""

    def __init__(self, buffers, state_layout, *, ratio: float = 1.0, pin_memory: bool = False,
                 faces_of, offload_param: bool = False):
        """`state_layout(buf)`: [(name, dtype, numel)] of the state the host allocation holds
        besides the master and gradient; `faces_of(buf)`: every ShardedParameter laid out in
        it, re-pointed at the host master."""
        self.state_layout = state_layout
        self.ratio = ratio
        self.pin_memory = pin_memory
        self.offload_param = offload_param
        self.stats = OffloadStats()
        chosen = choose_offloaded(buffers, ratio)
        self._offloaded = {id(b) for b in chosen}
        self._hosts = {}
        for buf in chosen:  # the masters move now: nothing has read them on the device yet
            host = self.host(buf)
            buf.move_master_to_host(host.master, host.grad, compute_on_host=offload_param,
                                    host_compute=host.parts.get("compute"),
                                    staging=host.parts.get("staging"), stats=self.stats)
            for sp in faces_of(buf):
                sp.bind_storage()

    def offloads(self, buf) -> bool:
        return id(buf) in self._offloaded

    def host(self, buf) -> HostShard:
        """The buffer's host memory, made on first use."""
        host = self._hosts.get(id(buf))
        if host is None:
            host = self._hosts[id(buf)] = HostShard(buf, self.state_layout(buf), self.pin_memory,
                                                    self.offload_param)
        return host

    def to_host(self, buf) -> HostShard:
        """The buffer's host memory, once the gradient shard copied there as its reductions
        finished has arrived (`DBuffer.wait_grad_copies`): what the host step reads."""
        buf.wait_grad_copies()
        return self.host(buf)

    def stepped(self, buf) -> None:
        """The host step wrote the master (torch's fused kernels do not move its version
        counter): refresh the compute shard now, asynchronously from pinned memory."""
        buf.compute.refresh(force=True)
        self.stats.host_steps += 1

    @property
    def host_bytes(self) -> int:
        return sum(h.storage.numel() for h in self._hosts.values())

    def release(self) -> None:
        """Drop the optimizer's references; the masters stay (the parameters view them)."""
        self._hosts.clear()
