"""Train a small character-level GPT on Tiny Shakespeare with veScale Engine.

    vescale run --nproc 2 examples/train_gpt.py --config examples/configs/vescale_default.json
    vescale run --nproc 8 examples/train_gpt.py --config examples/configs/vescale_bf16.json  (GPUs)
    torchrun --nproc_per_node 2 examples/train_gpt.py --config ...   (or deepspeed, mpirun)

The only veScale-specific line is the `initialize` import; the rest is a DeepSpeed script.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vescale_engine  # noqa: E402  (the one changed line: was `import deepspeed`)
from gpt_model import GPT, GPTConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=os.path.join(HERE, "data", "tinyshakespeare.txt"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    vescale_engine.add_config_arguments(parser)
    args = parser.parse_args()
    args.deepspeed_config = args.deepspeed_config or os.path.join(HERE, "configs",
                                                                  "vescale_default.json")
    return args


def main():
    args = parse_args()
    text = open(args.data, encoding="utf-8").read()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=len(vocab), block_size=args.seq, n_layer=args.layers,
                          n_head=max(1, args.dim // 32), n_embd=args.dim))
    engine, _, _, _ = vescale_engine.initialize(args=args, model=model)  # moves it to its GPU
    rank, world = engine.global_rank, engine.world_size
    on_gpu = engine.device.type == "cuda"  # batches go where the model is: engine.device
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    micro = engine.train_micro_batch_size_per_gpu()
    start, first_loss, tokens = time.perf_counter(), None, 0
    total_micro = args.steps * engine.gradient_accumulation_steps()
    tty = sys.stdout.isatty()
    # A bar (30 updates) or 10 lines. Reading the loss waits for the GPU, so only then.
    every, end = (max(1, args.steps // 30), "\r") if tty else (max(1, args.steps // 10), "")
    for i in range(total_micro):
        starts = torch.randint(0, len(data) - args.seq - 1, (micro,), generator=gen)
        batch = torch.stack([data[s:s + args.seq + 1] for s in starts])
        if on_gpu:  # pinned host memory: the copy overlaps the previous step's work
            batch = batch.pin_memory().to(engine.device, non_blocking=True)
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        tokens += batch[:, :-1].numel() * world
        first_loss = first_loss if first_loss is not None else loss.detach()
        steps_done = engine.global_steps
        if rank == 0 and (i + 1) % engine.gradient_accumulation_steps() == 0 and \
                (steps_done % every == 0 or steps_done == args.steps):
            rate = tokens / (time.perf_counter() - start)
            bar = "#" * (30 * steps_done // args.steps)
            print(f"{end}[{bar:<30}] step {steps_done}/{args.steps} loss {loss.item():.3f} "
                  f"{rate:,.0f} tok/s", end="" if end else "\n", flush=True)
    if rank == 0:
        last_loss = loss.item()  # waits for the GPU: the time below includes all the work
        elapsed = time.perf_counter() - start
        print(f"{chr(10) if tty else ''}trained {args.steps} steps on {world} rank(s) in "
              f"{elapsed:.1f} s: loss {first_loss.item():.3f} -> {last_loss:.3f}, "
              f"{tokens / elapsed:,.0f} tokens/s")


if __name__ == "__main__":
    main()
