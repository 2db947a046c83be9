"""The timeline both simulations (ours.py, fsdp2.py) replay one step on: live bytes by name and
kind, the peak of everything and of the transient part per phase, and the memory summary read
from it."""
from __future__ import annotations

__all__ = ["Timeline"]


class Timeline:
    """Live bytes by name and kind; the peak of everything and of the transient part."""

    PERSISTENT = ("master", "grad", "optimizer", "param")

    def __init__(self):
        self.live = {}
        self.total = 0
        self.peak = 0
        self.transient = 0
        self.peak_transient = {"forward_backward": 0, "optimizer_step": 0}
        self.phase = "forward_backward"
        self.at_peak = {}

    def alloc(self, key, nbytes: int, kind: str = "transient") -> None:
        if key in self.live or nbytes <= 0:
            return
        self.live[key] = (nbytes, kind)
        self.total += nbytes
        if kind not in self.PERSISTENT:
            self.transient += nbytes
            self.peak_transient[self.phase] = max(self.peak_transient[self.phase],
                                                  self.transient)
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = {"phase": self.phase}

    def free(self, key) -> None:
        if key in self.live:
            nbytes, kind = self.live.pop(key)
            self.total -= nbytes
            if kind not in self.PERSISTENT:
                self.transient -= nbytes

    def spike(self, nbytes: int) -> None:
        """A temporary that is made and dropped before anything else happens."""
        self.alloc(("spike",), nbytes)
        self.free(("spike",))

    def bytes_of(self, kind: str) -> int:
        return sum(n for n, k in self.live.values() if k == kind)

    def summary(self, master: int, padding_bytes: float, padding_ratio: float) -> dict:
        """The memory result of one system: persistent parts, transient peaks, the total peak
        and its phase, the padding."""
        return {"master": int(master), "grad": int(self.bytes_of("grad")),
                "optimizer": int(self.bytes_of("optimizer")),
                "gathered_peak": int(self.peak_transient["forward_backward"]),
                "optimizer_step_peak": int(self.peak_transient["optimizer_step"]),
                "total": int(self.peak), "peak_phase": self.at_peak.get("phase"),
                "padding": int(round(padding_bytes)), "padding_ratio": padding_ratio}
