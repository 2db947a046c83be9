"""What the collective path did (CollectiveStats, one process-wide STATS), and the handle that
counts the stall a collective's wait() puts on compute (TimedWork). The wire formats and
DBuffer count into STATS; the engine's wall-clock breakdown and the tests read it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["CollectiveStats", "STATS", "TimedWork"]


@dataclass
class CollectiveStats:
    """What the collective path did: the bytes it copied (the design says zero), how many
    collectives it issued (and how many of them were the backend's own, `native`), and, when
    `record` is set, the order of events (for tests).

    Communication time (wall_clock_breakdown) is the stall that waiting for a collective put
    on compute, i.e. what prefetch and overlap did not hide. On CPU that is host time inside
    wait() (`wait_s`). On an accelerator wait() only makes the compute stream wait, so while
    `time_device_waits` is set each wait is bracketed by two timing events on the compute
    stream (`pending_device_waits`), read once the device has finished them (`settle`)."""
    bytes_copied: int = 0
    bytes_gathered: int = 0     # the all-gathers' outputs (int8 and scales when quantized)
    bytes_reduced: int = 0      # the reduce-scatters' inputs
    hpz_gathers: int = 0        # all-gathers from the hpZ secondary copy (inside its group)
    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    native: int = 0
    wait_s: float = 0.0         # host seconds inside wait() (CPU tensors)
    device_wait_s: float = 0.0  # compute-stream stall measured by events (accelerators)
    time_device_waits: bool = False
    pending_device_waits: list = field(default_factory=list)
    record: bool = False
    events: list = field(default_factory=list)

    def log(self, *event):
        if self.record:
            self.events.append(event)

    def settle(self) -> None:
        """Add the finished event pairs' stalls into device_wait_s (the device must be done
        with them: the caller synchronizes first)."""
        for start, end in self.pending_device_waits:
            self.device_wait_s += start.elapsed_time(end) / 1000.0
        self.pending_device_waits.clear()

    def reset(self):
        self.bytes_copied = self.all_gathers = self.reduce_scatters = self.all_reduces = 0
        self.bytes_gathered = self.bytes_reduced = self.hpz_gathers = 0
        self.native = 0
        self.wait_s = self.device_wait_s = 0.0
        self.pending_device_waits.clear()
        self.events.clear()


def _timing_event(device: torch.device):
    return torch.Event(device=device, enable_timing=True)


class TimedWork:
    """A collective's handle whose wait() counts the stall it causes (see CollectiveStats)."""

    def __init__(self, work, device: torch.device,
                 event_factory: Callable[[torch.device], object] = _timing_event):
        self.work = work
        self.device = device
        self.event_factory = event_factory

    def wait(self):
        if self.device.type == "cpu":
            start = time.perf_counter()
            self.work.wait()
            STATS.wait_s += time.perf_counter() - start
        elif STATS.time_device_waits:
            start, end = self.event_factory(self.device), self.event_factory(self.device)
            start.record()
            self.work.wait()  # enqueues the compute stream's wait on the collective
            end.record()
            STATS.pending_device_waits.append((start, end))
        else:
            self.work.wait()


STATS = CollectiveStats()
