"""Block-wise int8 communication (DeepSpeed ZeRO++'s `zero_quantized_weights`, qwZ, and
`zero_quantized_gradients`, qgZ): what crosses the network is int8 values plus one fp32 scale
per group (about half of bf16's bytes).

Weights: each rank quantizes its own shard, the all-gather moves payload and scales, and every
rank dequantizes all shards into the full buffer, its own included, so that every rank computes
with the same weights. Gradients: each rank quantizes every rank's range of its full gradient
buffer by that range's groups, the ranges are exchanged all-to-all, and each owner dequantizes
and sums what it received in fp32 (`dequantize_sum`). The master weights and the optimizer never
see quantized values; saved and gathered state (state_dict, GatheredParameters, checkpoints)
gathers the master shards exactly.

A group is a run of at most `group` elements inside one planner block of one tensor: the
planner never lets a shard boundary cut a block, so each group lies on one rank and its scale
is computed from its own values alone, never by a collective, and does not change when a shard
boundary moves. The planner's block of a tensor with blocks smaller than `group` (a bias, a
norm's weight, rows shorter than `group`) is raised to the whole blocks that fit in `group`
(plan/quantization.py); a larger block is cut into groups of `group` elements from its start.
Padding between tensors is a group of its own (zeros, sent as zeros).

Symmetric: scale = max|x| / 127 over the group (1 for an all-zero group), q = round(x / scale)
in [-127, 127], value = q * scale computed in fp32 (and cast to the compute dtype).
"""
from __future__ import annotations

import bisect

import torch

from ..plan.quantization import DEFAULT_GROUP, shard_group_lengths

__all__ = ["GroupLayout", "quantize", "dequantize", "dequantize_sum"]

_QMAX = 127.0


class GroupLayout:
    """The quantization groups of every shard of one buffer layout (planner.BufferLayout),
    from the layout alone (plan/quantization.py's shard_group_lengths): `lengths[r]` the group
    lengths of rank r's shard in order; `max_groups` the most any rank has (the collectives
    send that many scales per rank); `padded` (W x max_groups, flat) with zero lengths after a
    rank's own."""

    def __init__(self, layout, group: int = DEFAULT_GROUP):
        if group < 1:
            raise ValueError(f"quantization group must be >= 1 element, got {group}")
        self.group = group
        per_rank = shard_group_lengths(layout, group)
        self.lengths = [torch.tensor(g, dtype=torch.int64) for g in per_rank]
        self.max_groups = max(len(g) for g in per_rank)
        padded = torch.zeros(layout.world_size, self.max_groups, dtype=torch.int64)
        for r, g in enumerate(per_rank):
            padded[r, :len(g)] = self.lengths[r]
        self.padded = padded.flatten()
        self._runs = {}

    def to(self, device) -> None:
        """The lengths where the buffer's storage is (copied once, not at every collective)."""
        if torch.device(device).type != "meta":
            self.lengths = [g.to(device) for g in self.lengths]
            self.padded = self.padded.to(device)

    def runs(self, rank=None) -> list:
        """The loops' runs of groups (`_chunks`) over `rank`'s groups, or over `padded`."""
        if rank not in self._runs:
            self._runs[rank] = _chunks((self.padded if rank is None else
                                        self.lengths[rank]).cpu())
        return self._runs[rank]


CHUNK = 1 << 22  # elements per step of the loops below: their fp32 temporaries stay ~50 MB


def _chunks(lengths: torch.Tensor, limit: int = CHUNK) -> list:
    """[(first group, end group, first element, end element)]: runs of whole groups of about
    `limit` elements (one group longer than it, a padding gap, is a run of its own)."""
    ends = lengths.cumsum(0).tolist()
    out, g0, e0 = [], 0, 0
    while g0 < len(ends):
        g1 = max(g0 + 1, bisect.bisect_right(ends, e0 + limit, lo=g0))
        out.append((g0, g1, e0, ends[g1 - 1]))
        g0, e0 = g1, ends[g1 - 1]
    return out


def quantize(values: torch.Tensor, lengths: torch.Tensor, scale_slots: int, runs=None):
    """`values` as int8 plus one fp32 scale per group (`lengths`, zeros allowed: a GroupLayout's
    `padded` rows for several shards), the scales padded with ones to `scale_slots`. `runs`:
    `_chunks(lengths)`, when the caller keeps it."""
    device = values.device
    lengths = lengths.to(device)
    q = torch.empty(values.numel(), dtype=torch.int8, device=device)
    scales = torch.ones(scale_slots, dtype=torch.float32, device=device)
    for g0, g1, e0, e1 in runs or _chunks(lengths.cpu()):
        x = values.detach()[e0:e1].float()
        run = lengths[g0:g1]
        amax = torch.segment_reduce(x.abs(), "max", lengths=run, unsafe=True, initial=0.0)
        mine = scales[g0:g1]
        mine.copy_(amax / _QMAX).masked_fill_(amax == 0, 1.0)
        per_element = mine.repeat_interleave(run, output_size=e1 - e0)
        q[e0:e1] = torch.round(x / per_element).clamp_(-_QMAX, _QMAX)
    return q, scales


def dequantize(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
               lengths: torch.Tensor, runs=None) -> None:
    """`out` = q * scale of its group (fp32, cast to out's dtype). `lengths` and `scales` may
    cover several shards (a GroupLayout's `padded` rows and the gathered scales)."""
    lengths_here = lengths.to(scales.device)
    for g0, g1, e0, e1 in runs or _chunks(lengths.cpu()):
        per_element = scales[g0:g1].repeat_interleave(lengths_here[g0:g1],
                                                      output_size=e1 - e0)
        if out.dtype == torch.float32:
            torch.mul(q[e0:e1], per_element, out=out[e0:e1])
        else:
            out[e0:e1] = q[e0:e1] * per_element


def dequantize_sum(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   lengths: torch.Tensor, max_groups: int, runs=None) -> None:
    """`out` (S elements) = the fp32 sum over senders of their dequantized copies of one shard:
    `q` holds W senders' int8 values (W x S), `scales` their scales (W x `max_groups`, the
    shard's groups `lengths` first in each row); each sender's copy dequantized by runs of
    groups, added in sender order."""
    S = out.numel()
    W = q.numel() // max(1, S)
    total = torch.zeros(S, dtype=torch.float32, device=out.device)
    lengths_here = lengths.to(out.device)
    runs = runs or _chunks(lengths.cpu())
    for sender in range(W):
        for g0, g1, e0, e1 in runs:
            per_element = scales[sender * max_groups + g0:sender * max_groups + g1] \
                .repeat_interleave(lengths_here[g0:g1], output_size=e1 - e0)
            total[e0:e1] += q[sender * S + e0:sender * S + e1] * per_element
    out.copy_(total)
