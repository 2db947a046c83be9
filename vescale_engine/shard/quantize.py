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

FP8 weights (quantization_format "fp8_e4m3", TileLayout): a matrix whose planner blocks are
whole rows of a width that is a multiple of 128 travels as float8_e4m3 bytes with one fp32
scale per (block rows x 128) tile (scale = max|x| / 448), in the payload where its piece's one
group would be; the int8 loops skip those groups (GroupLayout's `runs`).
"""
from __future__ import annotations

import bisect

import torch

from ..plan.quantization import DEFAULT_GROUP, TILE_COLS, shard_group_lengths, tile_rows

__all__ = ["GroupLayout", "TileLayout", "quantize", "dequantize", "dequantize_sum",
           "to_fp8", "quantize_tiles", "dequantize_tiles"]

_QMAX = 127.0
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: what max|x| of an FP8 tile maps to


class GroupLayout:
    """The quantization groups of every shard of one buffer layout (planner.BufferLayout),
    from the layout alone (plan/quantization.py's shard_group_lengths): `lengths[r]` the group
    lengths of rank r's shard in order; `max_groups` the most any rank has (the collectives
    send that many scales per rank); `padded` (W x max_groups, flat) with zero lengths after a
    rank's own. With `tiles` (FP8 weights), a piece of a tiled tensor is one group that the
    loops below skip (`runs`): its values and scales come from quantize_tiles."""

    def __init__(self, layout, group: int = DEFAULT_GROUP, tiles: bool = False):
        if group < 1:
            raise ValueError(f"quantization group must be >= 1 element, got {group}")
        self.group = group
        per_rank, tiled = shard_group_lengths(layout, group, tiles)
        self.lengths = [torch.tensor(g, dtype=torch.int64) for g in per_rank]
        self.max_groups = max(len(g) for g in per_rank)
        padded = torch.zeros(layout.world_size, self.max_groups, dtype=torch.int64)
        for r, g in enumerate(per_rank):
            padded[r, :len(g)] = self.lengths[r]
        self.padded = padded.flatten()
        self._skipped = {r: set(t) for r, t in enumerate(tiled)}
        self._skipped[None] = {r * self.max_groups + g for r, t in enumerate(tiled) for g in t}
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
                                        self.lengths[rank]).cpu(),
                                       skipped=self._skipped[rank])
        return self._runs[rank]


CHUNK = 1 << 22  # elements per step of the loops below: their fp32 temporaries stay ~50 MB


def _chunks(lengths: torch.Tensor, limit: int = CHUNK, skipped=frozenset()) -> list:
    """[(first group, end group, first element, end element)]: runs of whole groups of about
    `limit` elements (one group longer than it, a padding gap, is a run of its own); the
    groups in `skipped` are in no run."""
    ends = lengths.cumsum(0).tolist()
    out, g0, e0 = [], 0, 0
    while g0 < len(ends):
        if g0 in skipped:
            g0, e0 = g0 + 1, ends[g0]
            continue
        g1 = max(g0 + 1, bisect.bisect_right(ends, e0 + limit, lo=g0))
        g1 = min([g1] + [g for g in skipped if g0 < g < g1])
        out.append((g0, g1, e0, ends[g1 - 1]))
        g0, e0 = g1, ends[g1 - 1]
    return out


def quantize(values: torch.Tensor, lengths: torch.Tensor, scale_slots: int, runs=None):
    """`values` as int8 plus one fp32 scale per group (`lengths`, zeros allowed: a
    GroupLayout's `padded` rows for several shards), the scales padded with ones to
    `scale_slots`. `runs`: `_chunks(lengths)` or a GroupLayout's `runs`, when the caller keeps
    it (elements of skipped groups are left as they are, their scales 1)."""
    device = values.device
    lengths = lengths.to(device)
    q = torch.empty(values.numel(), dtype=torch.int8, device=device)
    scales = torch.ones(scale_slots, dtype=torch.float32, device=device)
    for g0, g1, e0, e1 in _chunks(lengths.cpu()) if runs is None else runs:
        x = values.detach()[e0:e1].float()
        run = lengths[g0:g1]
        amax = torch.segment_reduce(x.abs(), "max", lengths=run, unsafe=True, initial=0.0)
        mine = scales[g0:g1]
        mine.copy_(amax / _QMAX).masked_fill_(amax == 0, 1.0)
        per_element = mine.repeat_interleave(run, output_size=e1 - e0)
        q[e0:e1] = torch.round(x / per_element).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scales


def dequantize(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
               lengths: torch.Tensor, runs=None) -> None:
    """`out` = q * scale of its group (fp32, cast to out's dtype). `lengths` and `scales` may
    cover several shards (a GroupLayout's `padded` rows and the gathered scales)."""
    lengths_here = lengths.to(scales.device)
    for g0, g1, e0, e1 in _chunks(lengths.cpu()) if runs is None else runs:
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
    runs = _chunks(lengths.cpu()) if runs is None else runs
    for sender in range(W):
        for g0, g1, e0, e1 in runs:
            per_element = scales[sender * max_groups + g0:sender * max_groups + g1] \
                .repeat_interleave(lengths_here[g0:g1], output_size=e1 - e0)
            total[e0:e1] += q[sender * S + e0:sender * S + e1] * per_element
    out.copy_(total)


class TileLayout:
    """FP8 weights' tiles (plan/quantization.py's tile_rows): for every tensor whose planner
    block is R whole rows of a width that is a multiple of TILE_COLS, one scale per R x
    TILE_COLS tile. A rank's piece of such a tensor is whole blocks (the planner's rule), so
    its tiles are its own. `pieces[r]`: rank r's tiled pieces, in buffer order, as (start in the
    shard, rows, width, rows per tile); `max_tiles`: the most tiles any rank has; `tensors`:
    per tiled tensor, (offset, numel, width, rows per tile, index of its tiles' scales in the
    all-gathered W x max_tiles scales, in the tensor's tile order); `tensor_of`: the same by
    the tensor's index in the layout's placements."""

    def __init__(self, layout):
        S, W = layout.shard_size, layout.world_size
        self.pieces = [[] for _ in range(W)]
        counts = [0] * W
        where = {}  # placement index -> [(rank, first tile slot, tiles)]
        for k, p in sorted(enumerate(layout.placements), key=lambda kp: kp[1].offset):
            rows_per_tile = tile_rows(p.spec)
            if rows_per_tile is None:
                continue
            width = p.spec.shape[-1]
            for r in range(W):
                a, b = max(p.offset, r * S), min(p.offset + p.numel, (r + 1) * S)
                if a >= b:
                    continue
                rows = (b - a) // width
                tiles = -(-rows // rows_per_tile) * (width // TILE_COLS)
                self.pieces[r].append((a - r * S, rows, width, rows_per_tile))
                where.setdefault(k, []).append((r, counts[r], tiles))
                counts[r] += tiles
        self.max_tiles = max(counts, default=0)
        self.tensor_of = {}
        for k, spans in where.items():
            p = layout.placements[k]
            index = torch.cat([torch.arange(n) + r * self.max_tiles + first
                               for r, first, n in spans])
            self.tensor_of[k] = (p.offset, p.numel, p.spec.shape[-1], tile_rows(p.spec), index)

    @property
    def tensors(self) -> list:
        return list(self.tensor_of.values())

    def to(self, device) -> None:
        if torch.device(device).type != "meta":
            self.tensor_of = {k: t[:4] + (t[4].to(device),) for k, t in self.tensor_of.items()}


def _tiles_view(flat: torch.Tensor, rows: int, width: int, rows_per_tile: int):
    """`flat` (rows x width, row-major) as (whole blocks view, tail rows view or None): the
    first as (blocks, rows_per_tile, width / TILE_COLS, TILE_COLS), the second the short last
    block as (1, tail, width / TILE_COLS, TILE_COLS)."""
    whole = rows // rows_per_tile * rows_per_tile
    cols = width // TILE_COLS
    head = flat[:whole * width].view(-1, rows_per_tile, cols, TILE_COLS)
    tail = flat[whole * width:rows * width].view(1, rows - whole, cols, TILE_COLS) \
        if rows > whole else None
    return head, tail


def to_fp8(tiles: torch.Tensor, dims):
    """`tiles` (any float dtype) as float8_e4m3fn with one fp32 scale per tile, the tile being
    `dims` (scale = max|x| / 448 over it, 1 for an all-zero tile): (values, scales with `dims`
    reduced away)."""
    x = tiles.float()
    amax = x.abs().amax(dim=dims, keepdim=True)
    scales = (amax / _FP8_MAX).masked_fill_(amax == 0, 1.0)
    return (x / scales).to(torch.float8_e4m3fn), scales.squeeze(dims)


def quantize_tiles(values: torch.Tensor, q: torch.Tensor, pieces: list, slots: int):
    """FP8 by tiles for `pieces` (TileLayout.pieces of this rank) of the shard `values`, into
    the payload `q` (uint8 bytes, the shard's layout); the tiles' scales in order, padded with
    ones to `slots`."""
    scales = torch.ones(max(1, slots), dtype=torch.float32, device=values.device)[:slots]
    at = 0
    for start, rows, width, rows_per_tile in pieces:
        x = values.detach()[start:start + rows * width]
        out = q[start:start + rows * width]
        o_head, o_tail = _tiles_view(out, rows, width, rows_per_tile)
        for part, o in zip(_tiles_view(x, rows, width, rows_per_tile), (o_head, o_tail)):
            if part is None:
                continue
            fp8, scale = to_fp8(part, (1, 3))  # one scale per tile
            o.copy_(fp8.view(torch.uint8))
            scales[at:at + scale.numel()] = scale.flatten()
            at += scale.numel()
    return scales


def dequantize_tiles(full: torch.Tensor, q_full: torch.Tensor, scales_full: torch.Tensor,
                     tensors: list) -> None:
    """Every tiled tensor of the gathered buffer (TileLayout.tensors) into `full`: its FP8
    values times its tiles' scales (fp32, cast to full's dtype)."""
    for offset, numel, width, rows_per_tile, index in tensors:
        rows = numel // width
        scales = scales_full[index]
        parts = _tiles_view(q_full[offset:offset + numel], rows, width, rows_per_tile)
        outs = _tiles_view(full[offset:offset + numel], rows, width, rows_per_tile)
        at = 0
        for part, out in zip(parts, outs):
            if part is None:
                continue
            n = part.shape[0] * part.shape[2]
            scale = scales[at:at + n].view(part.shape[0], 1, part.shape[2], 1)
            out.copy_(part.view(torch.float8_e4m3fn).float() * scale)
            at += n
