"""Rank 0's progress line every `steps_per_print` optimizer steps: step, loss, learning rate,
global gradient norm, throughput, step time and peak memory; the engine may add parts (loss
scale and skipped steps under fp16, the wall-clock breakdown)."""
from __future__ import annotations

import logging
import resource
import time

import torch

__all__ = ["peak_memory_gb", "Progress"]

LOG = logging.getLogger("vescale_engine")


def peak_memory_gb(device: torch.device) -> float:
    """The device's peak allocation on CUDA; the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


class Progress:
    def __init__(self, every: int, rank: int, device=torch.device("cpu")):
        self.every = every
        self.device = torch.device(device)
        self.rank = rank
        self._since = time.perf_counter()
        self._samples = 0
        self._tokens = 0
        self._steps = 0

    def micro_step(self, samples: int, tokens: int | None):
        self._samples += samples
        self._tokens += tokens or 0

    def due(self, step: int) -> bool:
        """Will optimizer step `step` be reported?"""
        return step % self.every == 0

    def optimizer_step(self, step: int, loss, lr: float, grad_norm, extra=()) -> str | None:
        """Log (on rank 0) when `step` is a multiple of `every`; returns the line logged."""
        self._steps += 1
        if not self.due(step):
            return None
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        parts = [f"step {step}",
                 f"loss {float(loss):.4f}" if loss is not None else "loss n/a",
                 f"lr {lr:.3e}",
                 f"grad norm {float(grad_norm):.4f}" if grad_norm is not None else "",
                 f"{self._samples / elapsed:.1f} samples/s",
                 f"{self._tokens / elapsed:.0f} tokens/s" if self._tokens else "",
                 f"step {elapsed / self._steps:.3f} s",
                 f"peak mem {peak_memory_gb(self.device):.2f} GB", *extra]
        line = " | ".join(p for p in parts if p)
        self._since, self._samples, self._tokens, self._steps = time.perf_counter(), 0, 0, 0
        if self.rank == 0:
            LOG.info(line)
        return line
