"""FP8 weights (quantization_format "fp8_e4m3"): a matrix whose planner blocks are whole rows
of a width that is a multiple of 128 travels as float8_e4m3 bytes with one fp32 scale per
(block rows x 128) tile (quantize.py's TileLayout); every other tensor as int8 groups."""
from __future__ import annotations

import torch

from ...plan.quantization import TILE_COLS
from ..quantize import GroupLayout, TileLayout, dequantize_tiles, quantize_tiles
from .int8 import Int8Gather

__all__ = ["Fp8TileGather"]


class Fp8TileGather(Int8Gather):
    """FP8 weights: matrices of whole-row blocks travel as FP8 bytes in the payload where their
    piece's one int8 group would be, with one fp32 scale per tile (quantize.py's TileLayout)
    in a third all-gather; every other tensor (norms, biases) as int8 groups. With `keep_fp8`
    (fp8_matmul) the last gather's FP8 values and tile scales stay with `full` for the
    Linears that compute from them (fp8_tensor)."""

    def __init__(self, layout, group):
        super().__init__(GroupLayout(layout, group, tiles=True))
        self.tiles = TileLayout(layout)
        self.kept = None  # (gathered bytes, gathered tile scales, the full views' versions)

    def to(self, device) -> None:
        super().to(device)
        self.tiles.to(device)

    def forget(self) -> None:
        self.kept = None

    def __call__(self, buf, async_op=True, tag=None, backward=False):
        self.kept = None
        return super().__call__(buf, async_op, tag, backward)

    def pack(self, buf, source) -> list:
        """The int8 groups' payload (the tiles' values as FP8 bytes, written into the groups
        quantize skipped) and scales, then the tiles' scales."""
        sent, tiles = super().pack(buf, source), self.tiles
        if tiles.max_tiles:
            tile_scales = quantize_tiles(source, sent[0][0].view(torch.uint8),
                                         tiles.pieces[buf.rank], tiles.max_tiles)
            sent.append((tile_scales, torch.empty(buf.world_size * tiles.max_tiles,
                                                  dtype=torch.float32, device=buf.device)))
        return sent

    def unpack(self, buf, sent) -> None:
        super().unpack(buf, sent)
        if len(sent) > 2:  # the tiled tensors, which dequantize skipped
            dequantize_tiles(buf.full, sent[0][1].view(torch.uint8), sent[2][1],
                             self.tiles.tensors)
            if self.keep_fp8:  # the full views made now, so that their versions count
                self.kept = (sent[0][1].view(torch.uint8), sent[2][1],
                             [view._version for view in buf.full_views()])

    def fp8_tensor(self, index, weight):
        held = self.kept
        if (held is None or index not in self.tiles.tensor_of
                or weight._version != held[2][index]):
            return None
        offset, numel, width, rows_per_tile, tiles = self.tiles.tensor_of[index]
        values = held[0][offset:offset + numel].view(torch.float8_e4m3fn)
        return (values.view(numel // width, width),
                held[1][tiles].view(-1, width // TILE_COLS), rows_per_tile)
