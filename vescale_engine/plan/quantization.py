"""What quantized communication asks of the planner (pure Python, as the planner is): the
default group size and the planner block a tensor gets so that no shard boundary cuts a group
(shard/quantize.py quantizes and dequantizes)."""
from __future__ import annotations

__all__ = ["DEFAULT_GROUP", "TILE_COLS", "quantization_block", "shard_group_lengths",
           "shard_group_counts", "tile_rows"]

DEFAULT_GROUP = 256  # elements per int8 group: one fp32 scale each (~1.6% of the bytes)


def quantization_block(block: int, group: int) -> int:
    """The planner block of a tensor whose blocks are `block` elements under quantized
    communication in groups of `group`: blocks smaller than a group joined into runs of as many
    whole blocks as fit in one (one at least); larger blocks unchanged (cut into groups)."""
    return block * max(1, group // block) if block < group else block


def _chunks(length: int, group: int) -> list:
    return [group] * (length // group) + ([length % group] if length % group else [])


def _pieces(layout, rank: int):
    """(placement or None for padding, start, end) covering rank `rank`'s shard, in order."""
    S = layout.shard_size
    lo, hi = rank * S, (rank + 1) * S
    at = lo
    for p in sorted(layout.placements, key=lambda p: p.offset):
        a, b = max(p.offset, lo), min(p.offset + p.numel, hi)
        if a >= b:
            continue
        if a > at:
            yield None, at, a
        yield p, a, b
        at = b
    if hi > at:
        yield None, at, hi


def _piece_groups(p, a: int, b: int, group: int, count_only: bool):
    """The groups of tensor `p` in [a, b) (buffer coordinates, `a` on one of its block edges):
    each block cut into runs of `group` elements from its start; their lengths, or count."""
    if (a - p.offset) % p.block:
        raise ValueError(f"{p.name}: a shard starts inside one of its blocks")
    whole, rest = divmod(b - a, p.block)
    per_block = -(-p.block // group)
    if count_only:
        return whole * per_block + -(-rest // group)
    return _chunks(p.block, group) * whole + _chunks(rest, group)


def shard_group_lengths(layout, group: int, tiles: bool = False):
    """Per rank, the lengths of its shard's quantization groups in order (they sum to the shard
    size): a tensor's blocks cut into runs of at most `group` elements, each padding gap one
    group. No group crosses a shard boundary, since no block does. With `tiles`, a piece of
    a tensor quantized by FP8 tiles (`tile_rows`) is one group (its values come from the
    tiles). Returns (lengths, tiled): per rank, its group lengths, and the indices of its
    tiled groups among them."""
    lengths, tiled = [], []
    for r in range(layout.world_size):
        mine, skip = [], []
        for p, a, b in _pieces(layout, r):
            if p is not None and tiles and tile_rows(p.spec):
                skip.append(len(mine))
                mine.append(b - a)
            else:
                mine += [b - a] if p is None else _piece_groups(p, a, b, group, False)
        lengths.append(mine)
        tiled.append(skip)
    return lengths, tiled


def shard_group_counts(layout, group: int) -> list:
    """Per rank, how many groups `shard_group_lengths` gives it (without listing them)."""
    return [sum(1 if p is None else _piece_groups(p, a, b, group, True)
                for p, a, b in _pieces(layout, r)) for r in range(layout.world_size)]


TILE_COLS = 128  # FP8 weights: tiles of (rows per planner block) x 128 columns, one scale each


def tile_rows(spec) -> int | None:
    """Rows per FP8 tile of a tensor (TensorSpec): its planner block's rows when the block is
    whole rows of a matrix (or stack) whose width is a multiple of TILE_COLS, else None (its
    groups are contiguous runs). DeepSeek-V3's 128x128 weight tiles: `tile:128x128`."""
    shape = tuple(spec.shape)
    if len(shape) < 2 or shape[-1] % TILE_COLS or spec.block % shape[-1]:
        return None
    return spec.block // shape[-1]
