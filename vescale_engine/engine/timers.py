"""`wall_clock_breakdown`: where an optimizer step's time goes.

forward, backward and optimizer are wall-clock spans the engine opens and closes;
communication is the stall that waiting for all-gathers, reduce-scatters and replica
all-reduces put on compute, i.e. what prefetch and overlap did not hide (shard/stats.py's
STATS). It falls inside forward and backward, so the four do not add up to the step time.
Reported as milliseconds per optimizer step, averaged since the last report.

How communication is measured depends on where the tensors live: on an accelerator wait() only
enqueues a stream wait, so host time inside it says nothing; there each wait is bracketed by
timing events on the compute stream (the stall as the device saw it). On CPU it is host time
inside wait(), and the progress line says so: "communication (host wait)".
"""
from __future__ import annotations

import time

import torch

from ..shard.stats import STATS

__all__ = ["WallClockBreakdown"]

PHASES = ("forward", "backward", "communication", "optimizer")
HOST_WAIT_LABEL = "communication (host wait)"


def _sync():
    """Device work is asynchronous: a span must end when the device finished it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class WallClockBreakdown:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._open = {}
        self._steps = 0
        if enabled:
            STATS.time_device_waits = True
        self._host_mark = STATS.wait_s
        self._device_mark = STATS.device_wait_s
        self.device_timed = False  # whether the last report's communication came from events

    def start(self, phase: str) -> None:
        if self.enabled and phase not in self._open:
            _sync()
            self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.enabled and phase in self._open:
            _sync()
            self._totals[phase] += time.perf_counter() - self._open.pop(phase)

    def optimizer_step_done(self) -> None:
        if self.enabled:
            self._steps += 1

    def report(self) -> dict:
        """{phase: ms per optimizer step} since the last report; resets the totals."""
        _sync()
        self.device_timed = bool(STATS.pending_device_waits)
        STATS.settle()
        self._totals["communication"] = (STATS.wait_s - self._host_mark
                                         + STATS.device_wait_s - self._device_mark)
        steps = max(self._steps, 1)
        out = {phase: 1000.0 * self._totals[phase] / steps for phase in PHASES}
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._host_mark = STATS.wait_s
        self._device_mark = STATS.device_wait_s
        self._steps = 0
        return out

    def line(self) -> str:
        """The progress line's suffix, e.g. "forward 12.1 ms | backward ...", or ""."""
        if not self.enabled:
            return ""
        report = self.report()
        label = {"communication": "communication" if self.device_timed else HOST_WAIT_LABEL}
        return " | ".join(f"{label.get(phase, phase)} {ms:.1f} ms"
                          for phase, ms in report.items())
