"""`wall_clock_breakdown`: where an optimizer step's time goes.

forward, backward and optimizer are wall-clock spans the engine opens and closes; communication
is the time spent waiting for all-gathers and reduce-scatters (dbuffer.STATS.wait_s), i.e. what
prefetch and overlap did not hide. It falls inside forward and backward, so the four do not add
up to the step time. Reported as milliseconds per optimizer step, averaged since the last report.
"""
from __future__ import annotations

import time

import torch

from .dbuffer import STATS

PHASES = ("forward", "backward", "communication", "optimizer")


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
        self._wait_mark = STATS.wait_s

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
        self._totals["communication"] = STATS.wait_s - self._wait_mark
        steps = max(self._steps, 1)
        out = {phase: 1000.0 * self._totals[phase] / steps for phase in PHASES}
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._wait_mark = STATS.wait_s
        self._steps = 0
        return out

    def line(self) -> str:
        """The progress line's suffix, e.g. "forward 12.1 ms | backward ...", or ""."""
        if not self.enabled:
            return ""
        return " | ".join(f"{phase} {ms:.1f} ms" for phase, ms in self.report().items())
