"""OffloadState: what a DBuffer whose master and gradient shards moved to host memory
(ZeRO-Offload: DBuffer.move_master_to_host) keeps beside them: the shard its all-gathers send
(a ComputeShard), whether the host gradient shard holds a gradient (it belongs to the caller's
host allocation and is never freed), the last asynchronous copy of a reduction into it, and
the offload's byte counters.

Must not know about modules, optimizers or config.
"""
from __future__ import annotations

import torch

from .compute_shard import ComputeShard

__all__ = ["OffloadState"]


class OffloadState:
    def __init__(self, compute: ComputeShard, stats=None):
        """`stats`: an object whose `bytes_to_host` / `bytes_to_device` get the bytes copied
        each way, or None."""
        self.compute = compute
        self.stats = stats
        self.grad_live = False  # the host gradient shard holds a gradient
        self._grad_copied = None  # the event after the last asynchronous copy into it

    def wait_grad_copies(self) -> None:
        """The last asynchronous copy of a reduction into the host gradient shard is done."""
        if self._grad_copied is not None:
            self._grad_copied.synchronize()
            self._grad_copied = None

    def receive(self, grad: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """The reduced shard `out` into the host gradient shard `grad`: cast to its dtype on
        the device, then one copy (asynchronous into pinned memory: the step waits,
        `wait_grad_copies`); added there when accumulating."""
        if out.dtype != grad.dtype:
            out = out.to(grad.dtype)
        if accumulate:  # the sum needs the values on the host now
            self.wait_grad_copies()
            grad.add_(out.to(grad.device))
        else:
            pinned = grad.is_pinned() and out.device.type != "cpu"
            grad.copy_(out, non_blocking=pinned)
            if pinned:
                self._grad_copied = torch.Event(device=out.device)
                self._grad_copied.record()
        if self.stats is not None:
            self.stats.bytes_to_host += out.numel() * out.element_size()
