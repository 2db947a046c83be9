"""FP8 matmuls on the gathered FP8 weights (fully_shard(fp8_matmul=True); the config's
`vescale.fp8_matmul`): an nn.Linear whose weight travelled as FP8 tiles (quantization_format
"fp8_e4m3", shard/quantize.py's TileLayout) computes its forward from the gathered FP8 bytes
and tile scales, not from the dequantized weight. The input is quantized by 1 x 128 tiles
(DeepSeek-V3's activations), so the product is that of the two FP8 operands with their scales,
accumulated in fp32. Backward computes as nn.Linear's does, from the dequantized weight (the
parameter) and the saved input.

The matmul runs as one `torch._scaled_mm` per 128 columns of K, each with row-wise scales (the
input's per row, the weight's per tile row), summed in fp32: the form that runs on CPU (as an
emulation) and on any GPU with FP8 row-wise scaling. Hopper's block-scaled kernel
(`torch.nn.functional.scaled_mm` with BlockWise1x128 x BlockWise128x128) computes the same
product in one call; `blockwise_matmul` is it, measured against this one by the GPU check and
not used for training until it has been checked there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..plan.quantization import TILE_COLS
from ..shard.quantize import to_fp8

__all__ = ["quantize_input", "tile_matmul", "blockwise_matmul", "install_fp8_linears"]


def quantize_input(x: torch.Tensor):
    """x (M, K), K a multiple of 128, as FP8 by 1 x 128 tiles: (values (M, K) float8_e4m3fn,
    scales (M, K / 128) fp32, scale = max|x| / 448 of the tile, 1 for an all-zero tile)."""
    M, K = x.shape
    values, scales = to_fp8(x.reshape(M, K // TILE_COLS, TILE_COLS), (2,))
    return values.view(M, K), scales


def tile_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                rows_per_tile: int) -> torch.Tensor:
    """x (M, K) @ W^T in fp32, W (N, K) given as float8_e4m3fn `weight` with one fp32 scale per
    rows_per_tile x 128 tile (`scales`: (ceil(N / rows_per_tile), K / 128), row-major), x
    quantized by `quantize_input`."""
    N, K = weight.shape
    xq, x_scales = quantize_input(x)
    row_scales = scales.repeat_interleave(rows_per_tile, dim=0)[:N]  # (N, K / 128)
    out = torch.zeros(x.shape[0], N, dtype=torch.float32, device=x.device)
    for c in range(K // TILE_COLS):
        cols = slice(c * TILE_COLS, (c + 1) * TILE_COLS)
        out += torch._scaled_mm(xq[:, cols], weight[:, cols].t(),
                                scale_a=x_scales[:, c:c + 1].contiguous(),
                                scale_b=row_scales[:, c].reshape(1, N).contiguous(),
                                out_dtype=torch.float32)
    return out


def blockwise_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                     out_dtype=torch.bfloat16) -> torch.Tensor:
    """`tile_matmul` for 128 x 128 weight tiles in one block-scaled call (Hopper GPUs): the
    scales laid out as torch's kernel takes them (outer-dimension-major, K's tiles padded to
    a multiple of 4 for the weight)."""
    N, K = weight.shape
    xq, x_scales = quantize_input(x)
    k_tiles = K // TILE_COLS
    padded = torch.zeros(N // TILE_COLS, -(-k_tiles // 4) * 4, dtype=torch.float32,
                         device=x.device)
    padded[:, :k_tiles] = scales
    return F.scaled_mm(xq, weight.t(), x_scales.t().contiguous().t(),
                       F.ScalingType.BlockWise1x128, padded.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


class _TileLinear(torch.autograd.Function):
    """nn.Linear's function with the forward's matmul from FP8 tiles; `weight` (the dequantized
    parameter) is an input so that its gradient takes the parameter's usual path."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8, scales, rows_per_tile):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        out = tile_matmul(flat, fp8, scales, rows_per_tile)
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], fp8.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = (flat_grad.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1]
                  else None)
        grad_b = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


def install_fp8_linears(unit) -> int:
    """Route the forward of each nn.Linear whose weight this unit gathers as FP8 tiles through
    `_TileLinear` while the gathered FP8 values are the ones its weight holds (the buffer's
    `fp8_tensor`); any other time (an exact gather, a weight written since) it is nn.Linear's.
    Returns how many layers were routed."""
    routed = 0
    for sp in unit.params:
        if sp.buffer.tiles is None or sp.index not in sp.buffer.tiles.tensor_of:
            continue
        for module, name in sp.registrations:
            if name == "weight" and type(module).forward is nn.Linear.forward:
                module.forward = _fp8_forward(module, sp)
                routed += 1
    return routed


def _fp8_forward(module: nn.Linear, sp):
    def forward(x):
        weight = module.weight
        packed = (sp.buffer.fp8_tensor(sp.index, weight)
                  if weight is sp.full_face and x.shape[-1] == weight.shape[-1] else None)
        if packed is None:
            return F.linear(x, weight, module.bias)
        return _TileLinear.apply(x, weight, module.bias, *packed)
    return forward
