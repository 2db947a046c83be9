"""The weights and gradients as they are: one native collective each (collectives.py; gloo's
point-to-point exchange unless the buffer asked for native ones)."""
from __future__ import annotations

from .. import collectives
from ..stats import STATS
from .base import GatherFormat, ReduceFormat

__all__ = ["PlainGather", "PlainReduce"]


class PlainGather(GatherFormat):
    """The shard in the compute dtype, all-gathered straight into `full`."""

    plain = True

    def send(self, buf, source):
        STATS.bytes_gathered += buf._full_bytes
        return collectives.all_gather(buf.full, source, buf.shard_group, async_op=True,
                                      native=buf.comm.native)


class PlainReduce(ReduceFormat):
    """The full gradients reduce-scattered with the buffer's reduction op."""

    plain = True

    def __call__(self, buf, out, source):
        STATS.bytes_reduced += source.numel() * source.element_size()
        return collectives.reduce_scatter(out, source, buf.shard_group,
                                          op=buf.comm.reduction.reduce_scatter_op,
                                          native=buf.comm.native)
