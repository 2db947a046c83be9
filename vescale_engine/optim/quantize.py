"""Block-wise 8-bit quantization of a flat tensor cut into segments of known lengths.

A flat shard is described by `lengths`: consecutive segments (quantization blocks, and the
padding between tensors) that together cover it. Each segment gets one fp32 scale, its absolute
maximum, and every element one 8-bit code: the index of the nearest entry of a code table after
dividing by the scale. Everything is one pass over the whole flat tensor (`segment_reduce` for
the maxima, `repeat_interleave` to spread the scales back), whatever the number of tensors.

Two code tables: `linear` (evenly spaced) and `dynamic` (roughly logarithmic: a few values per
decade near zero, many near one, so the small entries of Adam's second moment keep their
relative precision). Signed tables (first moment) have 255 entries in [-1, 1] stored as int8;
unsigned tables (second moment) have 256 entries in [0, 1] stored as uint8. Both contain 0 and 1
exactly, so a block's largest element and a block of zeros round-trip exactly.
"""
from __future__ import annotations

import functools

import torch

MAPS = ("dynamic", "linear")


def _dynamic_positive(decades: int) -> list:
    """2**i values in decade i (of `decades`), counting up to 1: linear fractions inside each
    decade, the midpoints of its cells except in the top decade, which ends exactly at 1."""
    values = []
    for i in range(decades):
        edges = torch.linspace(0.1, 1.0, 2 ** i + 1, dtype=torch.float64)
        points = edges[1:] if i == decades - 1 else (edges[:-1] + edges[1:]) / 2
        values += (points * 10.0 ** (i - decades + 1)).tolist()
    return values


@functools.lru_cache(maxsize=None)
def code_table(kind: str, signed: bool) -> torch.Tensor:
    """The sorted fp32 values that the 8-bit codes stand for."""
    if kind not in MAPS:
        raise ValueError(f"unknown quantization map {kind!r} (expected one of {', '.join(MAPS)})")
    if kind == "linear":
        table = torch.arange(-127, 128, dtype=torch.float64) / 127 if signed else \
            torch.arange(256, dtype=torch.float64) / 255
    else:
        positive = torch.tensor(_dynamic_positive(7 if signed else 8), dtype=torch.float64)
        table = torch.cat([-positive.flip(0), torch.zeros(1, dtype=torch.float64), positive]) \
            if signed else torch.cat([torch.zeros(1, dtype=torch.float64), positive])
    return table.to(torch.float32)


@functools.lru_cache(maxsize=None)
def _midpoints(kind: str, signed: bool) -> torch.Tensor:
    table = code_table(kind, signed)
    return (table[:-1] + table[1:]) / 2


_KEY_SHIFT = 15  # keys: a float's top 17 bits (sign, exponent, 8 mantissa bits)
_KEY_OFFSET = 1 << (31 - _KEY_SHIFT)


@functools.lru_cache(maxsize=None)
def _nearest_code_lookup(kind: str, signed: bool):
    """For every key, how many midpoints lie below the smallest float with that key; plus the
    midpoints with +inf appended. A key's floats span less than the gap between two midpoints
    of either table (2^-8 relative against >= 1/255 near 1), so at most one midpoint falls
    inside, and one comparison against it finishes the nearest-code search exactly: what
    `bucketize` on the midpoints computes, in a few flat passes instead of a binary search."""
    mid = _midpoints(kind, signed)
    keys = torch.arange(-_KEY_OFFSET, _KEY_OFFSET, dtype=torch.int32)
    low = (keys << _KEY_SHIFT).view(torch.float32)
    high = ((keys << _KEY_SHIFT) | ((1 << _KEY_SHIFT) - 1)).view(torch.float32)
    smallest = torch.minimum(low, high).nan_to_num(0.0)  # NaN/inf keys never occur in [-1, 1]
    below = torch.searchsorted(mid, smallest).to(torch.int16)
    return below, torch.cat([mid, torch.tensor([float("inf")])])


def nearest_codes(normalized: torch.Tensor, kind: str, signed: bool) -> torch.Tensor:
    """Index of the nearest table entry for each value in [-1, 1] (ties as `bucketize`)."""
    below, mid = _nearest_code_lookup(kind, signed)
    below, mid = below.to(normalized.device), mid.to(normalized.device)
    key = (normalized.view(torch.int32) >> _KEY_SHIFT).add_(_KEY_OFFSET)
    index = below[key.long()].long()
    return index.add_(mid[index] < normalized)


class BlockQuantizer:
    """Quantizes and restores flat tensors of `sum(lengths)` elements, one scale per segment."""

    def __init__(self, lengths: torch.Tensor, kind: str = "dynamic"):
        self.lengths = lengths.to(torch.int64)
        self.numel = int(self.lengths.sum())
        self.kind = kind
        code_table(kind, True)  # an unknown map fails here, at construction

    @property
    def num_blocks(self) -> int:
        return self.lengths.numel()

    def quantize(self, x: torch.Tensor, signed: bool, codes: torch.Tensor, scales: torch.Tensor):
        """Write x's codes into `codes` (int8 when signed, else uint8) and its per-segment
        absolute maxima into `scales`."""
        scales.copy_(torch.segment_reduce(x.abs(), "max", lengths=self.lengths, unsafe=True))
        spread = torch.repeat_interleave(scales.clamp(min=torch.finfo(torch.float32).tiny),
                                         self.lengths, output_size=self.numel)
        normalized = x / spread  # in [-1, 1]; a block of zeros stays zero
        index = nearest_codes(normalized, self.kind, signed)
        if signed:
            index -= 127  # table entry 127 is 0: int8 code 0
        codes.copy_(index)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
        table = code_table(self.kind, signed).to(codes.device)
        index = codes.to(torch.int64)
        if signed:
            index += 127
        spread = torch.repeat_interleave(scales, self.lengths, output_size=self.numel)
        return table[index].mul_(spread)

