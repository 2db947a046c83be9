"""ComputeShard: what a DBuffer whose fp32 master lives in host memory all-gathers.

With ZeRO-Offload the master shard is a host tensor (optim/offload.py puts it there) and the
sharded parameters are views of it. The all-gather must not read it straight from the host in
the master's dtype, so the buffer keeps this rank's shard in the compute dtype (`tensor`):

- on the device (offload_optimizer): refreshed from the master by a cast on the host into a
  staging tensor of the compute dtype and one host-to-device copy (2 bytes per element for
  bf16); with fp32 compute, or when the "device" is the CPU, one copy without staging;
- on the host (offload_param): refreshed by a cast on the host (nothing moves); each all-gather
  copies it into this rank's slot of the full buffer just before the collective. With fp32
  compute it is the master itself.

Staleness is the master's version counter (`tensor._version`, shared with every view of it:
the sharded parameters, checkpoint and Hugging Face loads, GatheredParameters' write-back, any
in-place write through a sharded face, inference_mode included), read at every all-gather. Two
writes do not move it: torch's fused optimizer kernels (the step refreshes explicitly, `refresh
(force=True)`) and writes through `.data` (`p.data.copy_(x)` hides the write from autograd and
from this check: write through the parameter under torch.no_grad() instead).

Copies out of pinned host memory are asynchronous; a refresh waits for the last one before it
writes the host memory that copy reads. (A write to a host master while its own asynchronous
copy is in flight, fp32 compute, is the caller's to avoid: the step waits for the stream first.)

Must not know about modules, optimizers or config.
"""
from __future__ import annotations

import torch

__all__ = ["ComputeShard"]


class ComputeShard:
    def __init__(self, master: torch.Tensor, dtype: torch.dtype, device: torch.device, *,
                 on_host: bool, host_tensor: torch.Tensor | None = None,
                 staging: torch.Tensor | None = None, stats=None):
        """`host_tensor`: the host compute shard to use when `on_host` and the dtypes differ;
        `staging`: the host tensor to cast into before the copy to an accelerator (both in the
        compute dtype, made here when not given). `stats`: an object whose `bytes_to_device`
        this adds the bytes it copies toward the device to (optim/offload.py's OffloadStats)."""
        S = master.numel()
        self.master = master
        self.on_host = on_host
        self.device = torch.device(device)
        self.stats = stats
        accelerator = self.device.type != "cpu"
        self.staging = None
        if on_host:
            if dtype == master.dtype:
                self.tensor = master  # nothing to cast: the master is what is gathered
            else:
                self.tensor = host_tensor if host_tensor is not None else \
                    torch.empty(S, dtype=dtype, device="cpu", pin_memory=master.is_pinned())
        else:
            self.tensor = torch.empty(S, dtype=dtype, device=self.device)
            if accelerator and dtype != master.dtype:  # cast on the host: half the PCIe bytes
                self.staging = staging if staging is not None else \
                    torch.empty(S, dtype=dtype, device="cpu", pin_memory=master.is_pinned())
        self._copied = None  # event of the last asynchronous copy out of host memory
        self.version = None  # the master's version the tensor holds; None: never filled
        self.refreshes = 0
        self.gathers = 0  # all-gathers served (each one a copy to the device when on the host)

    @property
    def stale(self) -> bool:
        return self.tensor is not self.master and self.version != self.master._version

    def _count(self, nbytes: int) -> None:
        if self.stats is not None:
            self.stats.bytes_to_device += nbytes

    @torch.no_grad()
    def refresh(self, force: bool = False) -> None:
        """Make `tensor` hold the master's value (when stale, or always with `force`)."""
        if self.tensor is self.master or not (force or self.stale):
            return
        self._wait_for_copies()  # host memory an asynchronous copy still reads is written next
        if self.staging is not None:
            self.staging.copy_(self.master)  # the cast, on the host
            self._copy(self.tensor, self.staging)
        elif self.on_host:
            self.tensor.copy_(self.master)  # the cast, on the host
        else:
            self._copy(self.tensor, self.master)
        if not self.on_host:
            self._count(self.tensor.numel() * self.tensor.element_size())
        self.version = self.master._version
        self.refreshes += 1

    def gather_source(self, slot: torch.Tensor) -> torch.Tensor:
        """The all-gather's input for this rank: the device compute shard, or (on the host) the
        host compute shard copied into `slot`, this rank's part of the full buffer."""
        self.refresh()
        self.gathers += 1
        if not self.on_host:
            return self.tensor
        with torch.no_grad():
            self._copy(slot, self.tensor)
        self._count(slot.numel() * slot.element_size())
        return slot

    def _copy(self, out: torch.Tensor, host: torch.Tensor) -> None:
        """Host to device: asynchronous from pinned memory, remembered until done."""
        asynchronous = host.is_pinned() and out.device.type != "cpu"
        out.copy_(host, non_blocking=asynchronous)
        if asynchronous:
            self._copied = torch.Event(device=out.device)
            self._copied.record()

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
