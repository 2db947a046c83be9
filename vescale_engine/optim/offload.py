"""ZeRO-Offload of optimizer state (`zero_optimization.offload_optimizer`, device "cpu").

For each offloaded DBuffer one host allocation (pinned when asked and the device is an
accelerator) holds the fp32 master copy the step updates, the gradient copy and the optimizer's
state (AdamW's two moments; AdamW8bit's codes and scales). The device keeps its fp32 master
shard: the sharded parameters stay views of it, so the all-gather, checkpoints, Hugging Face
loading and anything else that reads or writes parameters between steps work unchanged; what
leaves the device is the optimizer state (8 of AdamW's 16 bytes per element of master, gradient
and moments). Because the device master stays the authoritative value, every step copies it to
the host together with the gradient shard (after clipping and fp16 unscaling, so both stay as
they are), steps the whole flat shard there with the same kernel as the device path (torch's
fused AdamW, CPU build), and copies the master back: nothing written to the parameters between
steps is ever lost. Bytes moved per offloaded buffer
and step: 8 x shard elements to the host, 4 back (`OffloadStats` counts them).

`ratio` < 1 offloads whole buffers, largest shard first, until that fraction of the optimizer's
bytes is offloaded; the rest step on the device. Shard sizes are the same on every rank, so
every rank chooses the same buffers.

AdamW and AdamW8bit (ours) offload; `check_offloadable` names what works for the others.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OffloadStats", "HostShard", "OptimizerOffload", "check_offloadable",
           "choose_offloaded"]


@dataclass
class OffloadStats:
    """Bytes the offload copied (each way) and the host steps it ran, for tests and estimates."""
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    host_steps: int = 0

    def reset(self):
        self.bytes_to_host = self.bytes_to_device = self.host_steps = 0


class HostShard:
    """One buffer's host memory, one allocation: the master and gradient copies, then the
    optimizer's state tensors (`parts`, by name) as its `state_layout` lists them."""

    def __init__(self, buf, state_layout, pin_memory: bool):
        S = buf.shard_size
        layout = [("master", buf.master.dtype, S), ("grad", buf.master.dtype, S),
                  *state_layout]
        # widest elements first: every part starts aligned for its dtype
        layout.sort(key=lambda part: -part[1].itemsize)
        pin = pin_memory and buf.device.type != "cpu"  # pinning needs an accelerator
        total = sum(dtype.itemsize * n for _, dtype, n in layout)
        self.storage = torch.zeros(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.parts, at = {}, 0
        for name, dtype, n in layout:
            self.parts[name] = self.storage[at:at + dtype.itemsize * n].view(dtype)
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
                         "supported with offload; offload works with optimizer types AdamW and "
                         "AdamW8bit (ours, over whole flat buffers)")


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

    def __init__(self, buffers, state_layout, *, ratio: float = 1.0, pin_memory: bool = False):
        """`state_layout(buf)`: [(name, dtype, numel)] of the state the host allocation holds
        besides the master and gradient copies."""
        self.state_layout = state_layout
        self.ratio = ratio
        self.pin_memory = pin_memory
        self.stats = OffloadStats()
        self._offloaded = {id(b) for b in choose_offloaded(buffers, ratio)}
        self._hosts = {}

    def offloads(self, buf) -> bool:
        return id(buf) in self._offloaded

    def host(self, buf) -> HostShard:
        """The buffer's host memory, made on first use."""
        host = self._hosts.get(id(buf))
        if host is None:
            host = self._hosts[id(buf)] = HostShard(buf, self.state_layout(buf), self.pin_memory)
        return host

    def to_host(self, buf) -> HostShard:
        """Copy the device master and gradient shards to the host, and wait for them."""
        host = self.host(buf)
        non_blocking = host.pinned
        host.master.copy_(buf.master, non_blocking=non_blocking)
        host.grad.copy_(buf.grad, non_blocking=non_blocking)
        if non_blocking:  # the host step reads them next
            event = torch.Event(device=buf.device)
            event.record()
            event.synchronize()
        self.stats.bytes_to_host += 2 * buf.shard_size * buf.master.element_size()
        return host

    def to_device(self, buf) -> None:
        """The updated master back into the device shard (asynchronous from pinned memory: the
        next copy to the host is queued behind it on the same stream)."""
        host = self.host(buf)
        buf.master.copy_(host.master, non_blocking=host.pinned)
        self.stats.bytes_to_device += buf.shard_size * buf.master.element_size()
        self.stats.host_steps += 1

    @property
    def host_bytes(self) -> int:
        return sum(h.storage.numel() for h in self._hosts.values())

    def release(self) -> None:
        self._hosts.clear()
