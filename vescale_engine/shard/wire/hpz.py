"""ZeRO++'s hpZ (zero_hpz_partition_size): every forward gather leaves this rank's 1/N of
`full` in a secondary copy (N = the hpZ group's size, consecutive ranks); a backward gather of
the same iteration (`tag`) gathers from those copies inside the group instead of over every
rank, and so computes with what that forward did."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives
from ..stats import STATS, TimedWork
from .base import GatherFormat

__all__ = ["HpzGather"]


class HpzGather(GatherFormat):
    """The secondary copy and its gather around `primary`, the format of every other gather
    (whatever it keeps or offers is the primary's)."""

    def __init__(self, primary: GatherFormat, group):
        self.primary = primary
        self.hpz_group = group
        self.secondary = None
        self.tag = None  # the iteration whose forward filled `secondary`

    def __call__(self, buf, async_op=True, tag=None, backward=False):
        self.primary.forget()
        if backward and tag is not None and self.tag == tag:
            return self._from_secondary(buf, async_op)
        work = self.primary.send(buf, buf.gather_input())
        if tag is not None and not backward:
            work = collectives.Joined([work], lambda: self._keep(buf, tag))
        if not async_op:
            work.wait()
            return None
        return TimedWork(work, buf.device)

    def send(self, buf, source):
        return self.primary.send(buf, source)

    def _keep(self, buf, tag) -> None:
        """This rank's part of the gathered `full` into its secondary copy."""
        n, j = dist.get_world_size(self.hpz_group), dist.get_rank(self.hpz_group)
        part = buf.full.numel() // n
        if self.secondary is None:
            self.secondary = torch.empty(part, dtype=buf.param_dtype, device=buf.device)
        self.secondary.copy_(buf.full[j * part:(j + 1) * part])
        self.tag = tag

    def _from_secondary(self, buf, async_op: bool):
        STATS.all_gathers += 1
        STATS.hpz_gathers += 1
        STATS.bytes_gathered += buf._full_bytes
        STATS.log("all_gather_hpz", buf.name)
        work = collectives.all_gather(buf.full, self.secondary, self.hpz_group,
                                      async_op=async_op, native=buf.comm.native)
        return TimedWork(work, buf.device) if async_op else work

    def to(self, device) -> None:
        self.primary.to(device)

    def forget(self) -> None:
        self.primary.forget()

    def held(self) -> list:
        return [("secondary", self.secondary)] + self.primary.held()

    @property
    def tiles(self):
        return self.primary.tiles

    @property
    def keep_fp8(self):
        return self.primary.keep_fp8

    @keep_fp8.setter
    def keep_fp8(self, keep: bool) -> None:
        self.primary.keep_fp8 = keep

    def fp8_tensor(self, index, weight):
        return self.primary.fp8_tensor(index, weight)
