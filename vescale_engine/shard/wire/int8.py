"""ZeRO++'s int8 groups (quantize.py's GroupLayout): weights (qwZ) all-gathered as int8 values
and one fp32 scale per group, dequantized into `full` by every rank; gradients (qgZ) quantized
by their owner's groups, exchanged all-to-all and summed in fp32 by the owner."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives
from ..quantize import dequantize, dequantize_sum, quantize
from ..stats import STATS
from .base import GatherFormat, ReduceFormat

__all__ = ["Int8Gather", "Int8Reduce"]


class Int8Gather(GatherFormat):
    """This rank's shard quantized by `groups`, payload and scales all-gathered (one
    collective each), every shard dequantized into `full` when the handle is waited for.
    A format that sends more beside them extends `pack` and `unpack` (fp8.py)."""

    def __init__(self, groups):
        self.groups = groups

    def to(self, device) -> None:
        self.groups.to(device)

    def send(self, buf, source):
        sent = self.pack(buf, source)
        STATS.bytes_gathered += sum(out.numel() * out.element_size() for _, out in sent)
        works = [collectives.all_gather(out, mine, buf.shard_group, async_op=True,
                                        native=buf.comm.native) for mine, out in sent]
        return collectives.Joined(works, lambda: self.unpack(buf, sent))

    def pack(self, buf, source) -> list:
        """[(what this rank sends, where every rank's lands)]: int8 values, group scales."""
        groups, W = self.groups, buf.world_size
        q, scales = quantize(source, groups.lengths[buf.rank], groups.max_groups,
                             groups.runs(buf.rank))
        return [(q, torch.empty(W * buf.shard_size, dtype=q.dtype, device=buf.device)),
                (scales, torch.empty(W * groups.max_groups, dtype=torch.float32,
                                     device=buf.device))]

    def unpack(self, buf, sent) -> None:
        dequantize(buf.full, sent[0][1], sent[1][1], self.groups.padded, self.groups.runs())


class Int8Reduce(ReduceFormat):
    """ZeRO++'s qgZ: every rank's range of the full gradients quantized by that range's
    groups, exchanged all-to-all (int8 and scales), then dequantized and summed in fp32 by its
    owner into `out` when the handle is waited for (the sum: the reduction divides after, as
    for the exchange)."""

    sums_itself = True

    def __init__(self, groups):
        self.groups = groups

    def to(self, device) -> None:
        self.groups.to(device)

    def __call__(self, buf, out, source):
        groups, W = self.groups, buf.world_size
        q, scales = quantize(source, groups.padded, W * groups.max_groups, groups.runs())
        q_in, scales_in = torch.empty_like(q), torch.empty_like(scales)
        STATS.bytes_reduced += q.numel() + scales.numel() * 4
        works = [dist.all_to_all_single(q_in, q, group=buf.shard_group, async_op=True),
                 dist.all_to_all_single(scales_in, scales, group=buf.shard_group,
                                        async_op=True)]
        handle = collectives.Joined(works, lambda: dequantize_sum(
            out, q_in, scales_in, groups.lengths[buf.rank], groups.max_groups,
            groups.runs(buf.rank)))
        handle.sent = (q, scales)  # alive until the exchange is done, whatever the backend keeps
        return handle
