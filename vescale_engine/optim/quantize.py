"""Block-wise 8-bit quantization of a flat tensor cut into segments of known lengths.

A flat shard is described by `lengths`: consecutive segments (quantization blocks, and the
padding between tensors) that together cover it. Each segment gets one fp32 scale, its absolute
maximum, and every element one 8-bit code: the index of the nearest entry of a code table after
dividing by the scale.

Built for the GPU as much as for the CPU: the layout is planned once on the host (no device
value is ever read back); a run of equal segments is one `(n, length)` view whose maxima are one
row-wise reduction (`segment_reduce` would give each segment one serial GPU thread); the scales
are spread back with `repeat_interleave`; the code tables live on the data's device, built once
per device. The shard is processed in chunks of whole segments (`CHUNK_ELEMENTS`), so the
temporaries (about 20 bytes per element: the normalized values, int32 keys and indices, the
spread scales and its index) stay bounded however large the shard.

Two code tables: `linear` (evenly spaced) and `dynamic` (roughly logarithmic: a few values per
decade near zero, many near one, so the small entries of Adam's second moment keep their
relative precision). Signed tables (first moment) have 255 entries in [-1, 1] stored as int8;
unsigned tables (second moment) have 256 entries in [0, 1] stored as uint8. Both contain 0 and 1
exactly, so a block's largest element and a block of zeros round-trip exactly.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

import torch

from ..plan.optim_spec import QUANT_CHUNK_ELEMENTS

__all__ = ["BlockQuantizer", "code_table", "nearest_codes", "MAPS", "CHUNK_ELEMENTS"]

MAPS = ("dynamic", "linear")
CHUNK_ELEMENTS = QUANT_CHUNK_ELEMENTS  # elements per chunk: ~80 MB of temporaries at most
_HOST = torch.device("cpu")


def _dynamic_positive(decades: int) -> list:
    """2**i values in decade i (of `decades`), counting up to 1: linear fractions inside each
    decade, the midpoints of its cells except in the top decade, which ends exactly at 1."""
    values = []
    for i in range(decades):
        edges = torch.linspace(0.1, 1.0, 2 ** i + 1, dtype=torch.float64, device=_HOST)
        points = edges[1:] if i == decades - 1 else (edges[:-1] + edges[1:]) / 2
        values += (points * 10.0 ** (i - decades + 1)).tolist()
    return values


def code_table(kind: str, signed: bool, device=_HOST) -> torch.Tensor:
    """The sorted fp32 values that the 8-bit codes stand for, on `device` (cached there)."""
    if kind not in MAPS:
        raise ValueError(f"unknown quantization map {kind!r} (expected one of {', '.join(MAPS)})")
    return _code_table(kind, signed, torch.device(device))


@functools.lru_cache(maxsize=None)
def _code_table(kind: str, signed: bool, device: torch.device) -> torch.Tensor:
    if device != _HOST:
        return _code_table(kind, signed, _HOST).to(device)
    f64 = dict(dtype=torch.float64, device=_HOST)
    if kind == "linear":
        table = torch.arange(-127, 128, **f64) / 127 if signed else torch.arange(256, **f64) / 255
    else:
        positive = torch.tensor(_dynamic_positive(7 if signed else 8), **f64)
        table = torch.cat([-positive.flip(0), torch.zeros(1, **f64), positive]) \
            if signed else torch.cat([torch.zeros(1, **f64), positive])
    return table.to(torch.float32)


@functools.lru_cache(maxsize=None)
def _midpoints(kind: str, signed: bool, device: torch.device = _HOST) -> torch.Tensor:
    table = code_table(kind, signed, device)
    return (table[:-1] + table[1:]) / 2


_KEY_SHIFT = 15  # keys: a float's top 17 bits (sign, exponent, 8 mantissa bits)
_KEY_OFFSET = 1 << (31 - _KEY_SHIFT)


@functools.lru_cache(maxsize=None)
def _nearest_code_lookup(kind: str, signed: bool, device: torch.device = _HOST):
    """For every key, how many midpoints lie below the smallest float with that key; plus the
    midpoints with +inf appended. A key's floats span less than the gap between two midpoints
    of either table (2^-8 relative against >= 1/255 near 1), so at most one midpoint falls
    inside, and one comparison against it finishes the nearest-code search exactly: what
    `bucketize` on the midpoints computes, in a few flat passes instead of a binary search.
    Built on the host once, then copied to each device once (512 KB of int32)."""
    if device != _HOST:
        return tuple(t.to(device) for t in _nearest_code_lookup(kind, signed, _HOST))
    mid = _midpoints(kind, signed)
    keys = torch.arange(-_KEY_OFFSET, _KEY_OFFSET, dtype=torch.int32, device=_HOST)
    low = (keys << _KEY_SHIFT).view(torch.float32)
    high = ((keys << _KEY_SHIFT) | ((1 << _KEY_SHIFT) - 1)).view(torch.float32)
    smallest = torch.minimum(low, high).nan_to_num(0.0)  # NaN/inf keys never occur in [-1, 1]
    below = torch.searchsorted(mid, smallest).to(torch.int32)
    return below, torch.cat([mid, torch.tensor([float("inf")], device=_HOST)])


def nearest_codes(normalized: torch.Tensor, kind: str, signed: bool) -> torch.Tensor:
    """Index (int32) of the nearest table entry for each value in [-1, 1] (ties as
    `bucketize`)."""
    below, mid = _nearest_code_lookup(kind, signed, normalized.device)
    key = (normalized.view(torch.int32) >> _KEY_SHIFT).add_(_KEY_OFFSET)
    index = below[key]
    del key
    return index.add_(mid[index] < normalized)


@dataclass
class _Chunk:
    """Segments [seg_lo, seg_hi) covering elements [lo, hi) of the flat tensor."""
    lo: int
    hi: int
    seg_lo: int
    seg_hi: int
    runs: list            # (element offset, segment offset, length, count), chunk-relative
    lengths: torch.Tensor  # the segments' lengths, on the data's device


def _plan_chunks(lengths: list, limit: int, device) -> list:
    """Cut the segments into chunks of at most `limit` elements (a longer segment alone), each
    described by runs of equal consecutive lengths."""
    runs = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1][1] += 1
        else:
            runs.append([length, 1])
    chunks, pieces, elem, seg = [], [], 0, 0

    def close():
        lo, seg_lo = pieces[0][0], pieces[0][1]
        chunk_lengths = [length for _, _, length, count in pieces for _ in range(count)]
        chunks.append(_Chunk(lo, elem, seg_lo, seg,
                             [(e - lo, s - seg_lo, length, count) for e, s, length, count in pieces],
                             torch.tensor(chunk_lengths, dtype=torch.int64, device=device)))
        pieces.clear()

    for length, count in runs:
        while count:
            used = elem - pieces[0][0] if pieces else 0
            take = min(count, max(0, limit - used) // length)
            if take == 0:
                if pieces:
                    close()
                    continue
                take = 1  # a segment longer than the limit is a chunk of its own
            pieces.append((elem, seg, length, take))
            elem, seg, count = elem + take * length, seg + take, count - take
    if pieces:
        close()
    return chunks


class BlockQuantizer:
    """Quantizes and restores flat tensors of `sum(lengths)` elements, one scale per segment,
    on `device` (the data's)."""

    def __init__(self, lengths, kind: str = "dynamic", device=_HOST,
                 chunk_elements: int = CHUNK_ELEMENTS):
        code_table(kind, True)  # an unknown map fails here, at construction
        lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=_HOST)  # inspection
        self._starts = [0] * len(lengths)
        for i in range(1, len(lengths)):
            self._starts[i] = self._starts[i - 1] + lengths[i - 1]
        self.numel = sum(lengths)
        self.kind = kind
        self.device = torch.device(device)
        self.chunks = _plan_chunks(lengths, chunk_elements, self.device)

    @property
    def num_blocks(self) -> int:
        return len(self._starts)

    def segment_range(self, start: int, end: int):
        """Indices [lo, hi) of the segments starting inside the flat range [start, end)
        (host arithmetic: no device lookup)."""
        return bisect.bisect_left(self._starts, start), bisect.bisect_left(self._starts, end)

    def device_bytes(self) -> int:
        """Bytes this quantizer keeps on the device (the chunks' segment lengths)."""
        return sum(c.lengths.numel() * c.lengths.element_size() for c in self.chunks)

    def quantize(self, x: torch.Tensor, signed: bool, codes: torch.Tensor, scales: torch.Tensor):
        """Write x's codes into `codes` (int8 when signed, else uint8) and its per-segment
        absolute maxima into `scales`."""
        for chunk in self.chunks:
            self.quantize_chunk(chunk, x[chunk.lo:chunk.hi], signed, codes, scales)

    def quantize_chunk(self, chunk: _Chunk, x: torch.Tensor, signed: bool, codes: torch.Tensor,
                       scales: torch.Tensor):
        """`quantize` for one chunk: `x` holds its elements; `codes` and `scales` are whole."""
        chunk_scales = scales[chunk.seg_lo:chunk.seg_hi]
        for offset, seg, length, count in chunk.runs:  # a row-wise max per run of equal blocks
            torch.linalg.vector_norm(x[offset:offset + count * length].view(count, length),
                                     ord=math.inf, dim=1, out=chunk_scales[seg:seg + count])
        normalized = torch.repeat_interleave(  # each element's scale, then x over it, in place
            chunk_scales.clamp(min=torch.finfo(torch.float32).tiny), chunk.lengths,
            output_size=chunk.hi - chunk.lo)
        torch.div(x, normalized, out=normalized)  # in [-1, 1]; a block of zeros stays zero
        index = nearest_codes(normalized, self.kind, signed)
        del normalized
        if signed:
            index -= 127  # table entry 127 is 0: int8 code 0
        codes[chunk.lo:chunk.hi].copy_(index)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=torch.float32, device=codes.device)
        for chunk in self.chunks:
            out[chunk.lo:chunk.hi] = self.dequantize_chunk(chunk, codes, scales, signed)
        return out

    def dequantize_chunk(self, chunk: _Chunk, codes: torch.Tensor, scales: torch.Tensor,
                         signed: bool) -> torch.Tensor:
        """The fp32 values of one chunk's elements, from the whole `codes` and `scales`."""
        index = codes[chunk.lo:chunk.hi].to(torch.int32)
        if signed:
            index += 127
        values = code_table(self.kind, signed, codes.device)[index]
        del index
        return values.mul_(torch.repeat_interleave(scales[chunk.seg_lo:chunk.seg_hi],
                                                   chunk.lengths,
                                                   output_size=chunk.hi - chunk.lo))
