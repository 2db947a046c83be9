"""A Linear's forward on weights gathered as FP8 tiles (128 x 128, one scale each): three
ways, the same weights, one process.

- dequantize + matmul: the tiles dequantized to bf16, then a bf16 matmul (what the engine does
  with `quantization_format: fp8_e4m3` alone);
- tile_matmul: `vescale.fp8_matmul`'s matmul, one row-scaled `torch._scaled_mm` per 128
  columns of K, summed in fp32 (the input quantized by 1 x 128 tiles);
- blockwise: the same product in one block-scaled call (`torch.nn.functional.scaled_mm`,
  BlockWise1x128 x BlockWise128x128; Hopper GPUs only; its error is reported, not hidden).

Per shape: the median time over `--repeats` calls (after `--warmup`), and each result's
relative error against the fp64 product of the dequantized operands (blockwise and
tile_matmul quantize the input; dequantize + matmul does not, so its error is the input's
rounding to bf16 only).

    python benchmarks/fp8_matmul.py --device cuda      # the GPU check's part (10)
    python benchmarks/fp8_matmul.py --smoke            # CPU, small shapes: a check that it runs
    python benchmarks/fp8_matmul.py --shape 2048x1024x1024 --shape 1024x4096x4096  # CPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from ranks import command_line, cpu_model, write_report  # noqa: E402

# (tokens M, out features N, in features K): Llama-3-8B's attention output and MLP down
# projections at 8 sequences of 1,024 tokens, and a small one
SHAPES = ((8192, 4096, 4096), (8192, 4096, 14336), (2048, 1024, 1024))
SMOKE_SHAPES = ((64, 256, 384), (32, 128, 128))


def _time(fn, device, warmup, repeats):
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(M, N, K, device, warmup, repeats):
    import torch
    from vescale_engine.fsdp.fp8_linear import blockwise_matmul, quantize_input, tile_matmul
    from vescale_engine.shard.quantize import dequantize_tiles, quantize_tiles
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(N, K, device=device, generator=gen) * K ** -0.5
    x = torch.randn(M, K, device=device, generator=gen)
    q = torch.empty(N * K, dtype=torch.uint8, device=device)
    tiles = -(-N // 128) * (K // 128)
    scales = quantize_tiles(w.flatten(), q, [(0, N, K, 128)], tiles)
    index = torch.arange(tiles, device=device)
    fp8 = q.view(torch.float8_e4m3fn).view(N, K)
    tile_scales = scales.view(-1, K // 128)
    x16 = x.to(torch.bfloat16)
    w_back = torch.empty(N * K, device=device)
    dequantize_tiles(w_back, q, scales, [(0, N * K, K, 128, index)])
    xq, xs = quantize_input(x16)  # what the FP8 matmuls quantize
    x_back = (xq.float().view(M, -1, 128) * xs[..., None]).view(M, K)
    exact = x_back.double() @ w_back.view(N, K).double().t()
    exact_bf16_input = x16.double() @ w_back.view(N, K).double().t()

    def dequantize_then_matmul():
        full = torch.empty(N * K, dtype=torch.bfloat16, device=device)
        dequantize_tiles(full, q, scales, [(0, N * K, K, 128, index)])
        return x16 @ full.view(N, K).t()

    runs = {"dequantize + bf16 matmul": (dequantize_then_matmul, exact_bf16_input),
            "tile_matmul (row-scaled per 128 of K)":
                (lambda: tile_matmul(x16, fp8, tile_scales, 128), exact),
            "blockwise (one block-scaled call)":
                (lambda: blockwise_matmul(x16, fp8, tile_scales), exact)}
    rows = []
    for name, (fn, reference) in runs.items():
        try:
            error = ((fn().double() - reference).norm() / reference.norm()).item()
            rows.append((name, _time(fn, device, warmup, repeats), error, ""))
        except Exception as e:  # noqa: BLE001 (a kernel this device lacks: reported)
            rows.append((name, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--smoke", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--shape", action="append", default=[],
                        help="MxNxK (repeatable): instead of the default shapes")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "fp8_matmul.md"))
    args = parser.parse_args()
    import torch
    torch.manual_seed(0)
    shapes = ([tuple(int(n) for n in shape.split("x")) for shape in args.shape] or
              (SMOKE_SHAPES if args.smoke else SHAPES))
    where = (torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_model())
    lines = ["# A Linear's forward on FP8 weight tiles: dequantize + bf16 vs FP8 matmuls", "",
             f"Produced by `{command_line(__file__)}` on {where}, torch {torch.__version__}; "
             f"median of {args.repeats} calls after {args.warmup}; error: relative norm "
             "against the fp64 product of the dequantized operands.", "",
             "| M x N x K | way | time (ms) | x dequantize + bf16 | relative error | note |",
             "|---|---|---:|---:|---:|---|"]
    for M, N, K in shapes:
        rows = measure(M, N, K, args.device, 1 if args.smoke else args.warmup,
                       2 if args.smoke else args.repeats)
        base = rows[0][1]
        for name, t, error, note in rows:
            lines.append(f"| {M} x {N} x {K} | {name} | "
                         f"{'-' if t is None else f'{t * 1e3:.3f}'} | "
                         f"{'-' if t is None or not base else f'{t / base:.2f}'} | "
                         f"{'-' if error is None else f'{error:.2e}'} | {note} |")
        print("\n".join(lines[-3:]), flush=True)
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
