"""Granularity policies: how a tensor's flattened storage is cut into atomic blocks.

A block is the smallest run of elements that a shard boundary may never cut. Pure Python (no
torch) so that the planner and the `vescale plan` command start instantly.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Granularity", "parse_granularity", "GRANULARITY_HELP"]

GRANULARITY_HELP = "element, block:N, rows:K, tile:RxC, matrix, tensor or shampoo:B"


@dataclass(frozen=True)
class Granularity:
    kind: str  # "element" | "block" | "rows" | "tile" | "matrix" | "tensor" | "shampoo"
    rows: int = 1  # rows per block; for "block", the block length in elements
    cols: int = 1

    def __str__(self) -> str:
        if self.kind == "rows":
            return f"rows:{self.rows}"
        if self.kind == "block":
            return f"block:{self.rows}"
        if self.kind == "tile":
            return f"tile:{self.rows}x{self.cols}"
        if self.kind == "shampoo":
            return f"shampoo:{self.rows}"
        return self.kind

    def block_size(self, shape) -> int:
        """Atomic block size in elements for a tensor of `shape`.

        A tensor smaller than one block is a single block; when the size is not a multiple of
        the block, the last block is shorter (and just as atomic).
        """
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        if numel == 0:
            return 1
        if self.kind == "element":
            block = 1
        elif self.kind == "tensor":
            block = numel
        elif self.kind == "matrix":  # each matrix (each expert of a stack) whole on one rank
            block = shape[-2] * shape[-1] if len(shape) >= 2 else 1
        elif self.kind == "block":  # N consecutive elements, whatever the shape (quantization)
            block = self.rows
        elif self.kind == "rows":
            block = self.rows * (shape[-1] if len(shape) >= 2 else 1)
        elif self.kind == "shampoo":  # Shampoo's B-row runs (optim/shampoo.py): rows:B, but a
            # stack of matrices whose rows are not a multiple of B in whole matrices (a run
            # of B stacked rows would end inside a matrix's last row run)
            stacked = len(shape) >= 3 and math.prod(shape[:-2]) > 1
            block = shape[-2] * shape[-1] if stacked and shape[-2] % self.rows else \
                self.rows * (shape[-1] if len(shape) >= 2 else 1)
        else:  # tile: the R whole rows that enclose an R x C tile
            if len(shape) >= 2:
                if shape[-1] % self.cols:
                    raise ValueError(
                        f"tile:{self.rows}x{self.cols} does not fit shape {list(shape)}: "
                        f"last dimension {shape[-1]} is not a multiple of {self.cols}")
                block = self.rows * shape[-1]
            else:
                block = self.rows * self.cols
        return min(block, numel)


def parse_granularity(spec) -> Granularity:
    """Parse 'element', 'block:N', 'rows:K', 'tile:RxC', 'matrix', 'tensor' or 'shampoo:B' (a
    Granularity passes through)."""
    if isinstance(spec, Granularity):
        return spec
    text = str(spec).strip().lower()
    if text in ("element", "matrix", "tensor"):
        return Granularity(text)
    match = re.fullmatch(r"block:(\d+)", text)
    if match and int(match.group(1)) > 0:
        return Granularity("block", rows=int(match.group(1)))
    match = re.fullmatch(r"rows:(\d+)", text)
    if match and int(match.group(1)) > 0:
        return Granularity("rows", rows=int(match.group(1)))
    match = re.fullmatch(r"shampoo:(\d+)", text)  # what the engine shards Shampoo with
    if match and int(match.group(1)) > 0:
        return Granularity("shampoo", rows=int(match.group(1)))
    match = re.fullmatch(r"tile:(\d+)x(\d+)", text)
    if match and int(match.group(1)) > 0 and int(match.group(2)) > 0:
        return Granularity("tile", rows=int(match.group(1)), cols=int(match.group(2)))
    raise ValueError(f"unknown granularity {spec!r} (expected {GRANULARITY_HELP}, N, K, R, C, "
                     "B > 0)")
