"""Train a small character-level GPT on Tiny Shakespeare with veScale Engine.

    vescale run --nproc 2 examples/train_gpt.py --config examples/configs/vescale_default.json
    vescale run --nproc 8 examples/train_gpt.py --config examples/configs/vescale_bf16.json  (GPUs)
    torchrun --nproc_per_node 2 examples/train_gpt.py --config ...   (or deepspeed, mpirun)
    ... --steps 1000 --save-dir runs/gpt --save-every 200   (later: the same line with --resume)

It trains on the first 90% of the text and evaluates on the last 10% (--eval-every), writes one
CSV row per step (step,loss,eval_loss,lr,tokens_per_s; --log-csv) and the loss curve next to
it (--plot; matplotlib, which .ci/setup-venv installs: without it one line says it skipped). The lr schedule spans --steps: the configs say
"total_num_steps": "auto" and this script fills it in (a fixed number must equal --steps).

The only veScale-specific line is the `initialize` import; the rest is a DeepSpeed script.
"""
import argparse
import csv
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vescale_engine  # noqa: E402  (the one changed line: was `import deepspeed`)
from gpt_model import GPT, GPTConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CSV_COLUMNS = ["step", "loss", "eval_loss", "lr", "tokens_per_s"]
# DeepSpeed's schedulers whose length is a parameter (total_num_steps).
SCHEDULES_WITH_LENGTH = ("WarmupCosineLR", "WarmupDecayLR")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=os.path.join(HERE, "data", "tinyshakespeare.txt"))
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps in all (a "
                        "resumed run trains from the checkpoint's step up to this one)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", metavar="DIR", help="save checkpoints here "
                        "(engine.save_checkpoint): every --save-every steps and at the end")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="steps between checkpoints (default 0: only at the end)")
    parser.add_argument("--resume", nargs="?", const="", metavar="CKPT",
                        help="continue from the latest checkpoint in --save-dir, or from CKPT "
                        "(a save dir, or one checkpoint in it: DIR/global_step200); where "
                        "there is none, start from step 0")
    parser.add_argument("--eval-every", type=int, metavar="N", help="evaluate on the held-out "
                        "last 10%% of the text every N steps and at the last step (default: "
                        "--steps/5; 0: never)")
    parser.add_argument("--eval-batches", type=int, default=10, metavar="N",
                        help="micro-batches per rank in each evaluation (default 10)")
    parser.add_argument("--log-csv", metavar="FILE", help="one row per step (default: "
                        "SAVE_DIR/metrics.csv with --save-dir, else train_gpt_metrics.csv; "
                        "'': none)")
    parser.add_argument("--plot", metavar="FILE.png", help="the loss curve, drawn from the "
                        "CSV at the end when matplotlib is installed (default: the CSV's "
                        "name with .png; '': none)")
    vescale_engine.add_config_arguments(parser)
    args = parser.parse_args()
    args.deepspeed_config = args.deepspeed_config or os.path.join(HERE, "configs",
                                                                  "vescale_default.json")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.resume == "" and not args.save_dir:
        parser.error("--resume without a checkpoint path needs --save-dir (where to look)")
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 5)
    if args.log_csv is None:
        args.log_csv = os.path.join(args.save_dir, "metrics.csv") if args.save_dir \
            else "train_gpt_metrics.csv"
    if args.plot is None:
        args.plot = os.path.splitext(args.log_csv)[0] + ".png" if args.log_csv else ""
    return args


def engine_config(args):
    """The JSON config with the lr schedule fitted to --steps. A schedule's length lives in the
    config, the run's length on the command line: left to the script ("auto"), it becomes
    --steps; a fixed length that differs is refused, since it would silently train part of the
    run at the schedule's floor (or end it before the decay)."""
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    scheduler = config.get("scheduler") or {}
    if scheduler.get("type") not in SCHEDULES_WITH_LENGTH:
        return config
    params = scheduler.setdefault("params", {})
    total = params.get("total_num_steps", "auto")
    if total == "auto":
        params["total_num_steps"] = total = args.steps
    elif total != args.steps:
        sys.exit(f"{args.deepspeed_config}: scheduler.params.total_num_steps is {total} but "
                 f"--steps is {args.steps}: set it to \"auto\" (then it follows --steps) or "
                 f"pass --steps {total}")
    warmup = params.get("warmup_num_steps")
    if warmup == "auto":  # a tenth of the run, as nanoGPT's and most recipes' warmups
        params["warmup_num_steps"] = max(1, total // 10)
    elif isinstance(warmup, int) and warmup >= total:
        sys.exit(f"{args.deepspeed_config}: scheduler.params.warmup_num_steps is {warmup}, not "
                 f"below --steps {total}: the lr would never decay; set it to \"auto\" (a "
                 "tenth of --steps) or lower")
    return config


def load_text(path):
    """The characters as token ids, split: the first 90% to train on, the last 10% held out."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(len(data) * 0.9)
    return data[:split], data[split:], len(vocab)


def batch_starts(data, seq, micro, gen):
    """Where the sequences of the next micro-batch start: the only draw from `gen`, so a resumed
    run replays these draws to reach the same position in the data (skip_batches)."""
    return torch.randint(0, len(data) - seq - 1, (micro,), generator=gen)


def get_batch(data, seq, micro, gen, device):
    """micro sequences of seq + 1 tokens (inputs, and the targets one token later)."""
    starts = batch_starts(data, seq, micro, gen)
    batch = torch.stack([data[s:s + seq + 1] for s in starts])
    if device.type == "cuda":  # pinned host memory: the copy overlaps the previous step's work
        batch = batch.pin_memory().to(device, non_blocking=True)
    return batch


def skip_batches(data, seq, micro, gen, count):
    for _ in range(count):
        batch_starts(data, seq, micro, gen)


def resume(engine, args):
    """Load the checkpoint --resume names into the engine; its client state (the step and how
    many micro-batches each rank had drawn), or None where there is no checkpoint."""
    source = args.resume or args.save_dir
    load_dir, tag = source, None
    if os.path.isdir(source) and any(n == "vescale_state.json" or n.endswith("model_states.pt")
                                     for n in os.listdir(source)):  # one checkpoint (ours or
        # DeepSpeed's), not a save dir: DeepSpeed's API takes its parent and its tag
        load_dir, tag = os.path.split(os.path.normpath(source))
    # Every rank calls it (it is collective): a missing directory, or one without `latest`, is
    # "nothing to resume", (None, None) with a warning, as under DeepSpeed. Deciding per rank
    # with os.path.isdir would race with rank 0 creating --save-dir for the CSV.
    path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if path is None:
        return None
    client_state = dict(client_state or {})
    client_state.setdefault("step", engine.global_steps)  # a checkpoint another script saved
    client_state.setdefault("micro_batches",
                            engine.global_steps * engine.gradient_accumulation_steps())
    client_state["path"] = path
    return client_state


@torch.no_grad()
def evaluate(engine, val, args, micro):
    """The mean held-out loss over --eval-batches micro-batches per rank, averaged over ranks.
    Every evaluation sees the same batches (a fixed seed), so the values compare across steps;
    the training generator is untouched, so evaluating does not change what trains."""
    engine.eval()
    gen = torch.Generator().manual_seed(10 ** 6 + args.seed * 1000 + engine.global_rank)
    total = torch.zeros((), device=engine.device)
    for _ in range(args.eval_batches):  # every rank the same count: forward is a collective
        batch = get_batch(val, args.seq, micro, gen, engine.device)
        total += engine(batch[:, :-1], batch[:, 1:]).float()
    dist.all_reduce(total)
    engine.train()
    return total.item() / (args.eval_batches * engine.world_size)


def mean_over_ranks(losses, world):
    """The step losses (device scalars) averaged over ranks, as floats: one collective and one
    host read for a window of steps, so the GPU is not waited on at every step."""
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    return (stacked / world).tolist()


def open_csv(path, resumed_step):
    """Start the CSV (rank 0): a header, and when resuming the rows up to the checkpoint's step
    (the rows after it are trained again). Rows are appended as training goes."""
    rows = []
    if resumed_step and os.path.isfile(path):
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resumed_step]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def append_csv(path, rows):
    with open(path, "a", newline="") as f:
        csv.writer(f).writerows(rows)


def plot(csv_path, png_path):
    """The loss curve (and the evaluations) from the CSV; matplotlib is optional."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as err:
        print(f"plot skipped: matplotlib is not importable ({err}); pip install matplotlib")
        return
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], label="train")
    evals = [r for r in rows if r["eval_loss"]]
    ax.plot([int(r["step"]) for r in evals], [float(r["eval_loss"]) for r in evals], "o-",
            label="held out")
    ax.set(xlabel="step", ylabel="loss", title="train_gpt.py: Tiny Shakespeare")
    ax.legend()
    fig.savefig(png_path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {png_path}")


def announce(args, config, state):
    """Rank 0's first lines: the lr schedule this run follows, and where it starts."""
    scheduler = config.get("scheduler") or {}
    params = scheduler.get("params", {})
    if "total_num_steps" in params:
        print(f"lr schedule: {scheduler['type']} over {params['total_num_steps']} steps, "
              f"{params.get('warmup_num_steps', 'default')} of warmup")
    if state is not None:
        print(f"resumed from {state['path']} at step {state['step']}")
        if state.get("steps", args.steps) != args.steps:
            print(f"note: that run was for {state['steps']} steps; the lr schedule now spans "
                  f"--steps {args.steps}")
    elif args.resume is not None:
        print(f"no checkpoint in {args.resume or args.save_dir}: starting from step 0")


def train_step(engine, data, args, micro, gen):
    """One optimizer step (gradient_accumulation_steps micro-batches); its mean loss, left on
    the device."""
    accum = engine.gradient_accumulation_steps()
    step_loss = 0.0
    for _ in range(accum):
        batch = get_batch(data, args.seq, micro, gen, engine.device)
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()  # the optimizer steps (and the scheduler moves) on the last micro-batch
        step_loss = step_loss + loss.detach().float() / accum
    return step_loss


def main():
    args = parse_args()
    config = engine_config(args)  # before initialize: a refused config starts nothing
    train_data, val_data, vocab_size = load_text(args.data)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=args.seq, n_layer=args.layers,
                          n_head=max(1, args.dim // 32), n_embd=args.dim))
    # The config as a dict (the schedule filled in): DeepSpeed's initialize takes one too.
    engine, _, _, _ = vescale_engine.initialize(model=model, config=config)  # moves it to its GPU
    rank, world = engine.global_rank, engine.world_size
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches

    state = resume(engine, args) if args.resume is not None else None
    start_step, micro_batches = (state["step"], state["micro_batches"]) if state else (0, 0)
    skip_batches(train_data, args.seq, micro, gen, micro_batches)  # the same data order
    if rank == 0:
        announce(args, config, state)
        if args.log_csv:
            open_csv(args.log_csv, start_step)
    if start_step >= args.steps:
        if rank == 0:
            print(f"nothing to train: the checkpoint is at step {start_step}, --steps is "
                  f"{args.steps}")
        return

    tty = sys.stdout.isatty()
    # A bar (30 updates) or 10 lines. Reading the loss waits for the GPU, so only then (and at
    # evaluations and saves); the steps in between keep their losses on the device.
    every, end = (max(1, args.steps // 30), "\r") if tty else (max(1, args.steps // 10), "")
    start = time.perf_counter()
    train_s, tokens, window_tokens, window_start = 0.0, 0, 0, start
    pending, first_loss, last_loss = [], None, None  # pending: (step, loss on device, lr)
    for step in range(start_step + 1, args.steps + 1):
        lr = float(engine.get_lr()[0])  # what this step uses: the scheduler moves it after
        pending.append((step, train_step(engine, train_data, args, micro, gen), lr))
        micro_batches += accum
        window_tokens += accum * micro * args.seq * world

        evaluating = args.eval_every > 0 and (step % args.eval_every == 0 or step == args.steps)
        saving = args.save_dir and (step == args.steps or
                                    args.save_every > 0 and step % args.save_every == 0)
        printing = step % every == 0 or step == args.steps
        if not (evaluating or saving or printing):
            continue
        # Read the window's losses (this waits for the device), then evaluate and save; the
        # rate counts training only.
        losses = mean_over_ranks([loss for _, loss, _ in pending], world)
        now = time.perf_counter()
        train_s, tokens = train_s + now - window_start, tokens + window_tokens
        rate = window_tokens / (now - window_start)
        first_loss = losses[0] if first_loss is None else first_loss
        last_loss = losses[-1]
        eval_loss = evaluate(engine, val_data, args, micro) if evaluating else None
        if rank == 0 and args.log_csv:  # eval_loss only in the row of the step it follows
            append_csv(args.log_csv, [
                [s, f"{value:.9g}", f"{eval_loss:.9g}" if evaluating and s == step else "",
                 f"{lr_used:.9g}", f"{rate:.0f}"]
                for (s, _, lr_used), value in zip(pending, losses)])
        if rank == 0 and (printing or evaluating):
            bar = "#" * (30 * step // args.steps)
            held_out = f" eval {eval_loss:.3f}" if evaluating else ""
            # An evaluation's line stays on screen; the bar's others overwrite each other.
            stays = not tty or evaluating or step == args.steps
            print(f"{end}[{bar:<30}] step {step}/{args.steps} loss {last_loss:.3f}{held_out} "
                  f"{tokens / train_s:,.0f} tok/s", end="\n" if stays else "", flush=True)
        if saving:  # the client state says where the data stream is; the engine has the rest
            engine.save_checkpoint(args.save_dir, client_state={
                "step": step, "micro_batches": micro_batches, "steps": args.steps,
                "seed": args.seed})
        pending, window_tokens, window_start = [], 0, time.perf_counter()

    if rank == 0:
        elapsed = time.perf_counter() - start
        resumed = f" (steps {start_step + 1}-{args.steps})" if start_step else ""
        print(f"trained {args.steps - start_step} steps{resumed} on {world} rank(s) in "
              f"{elapsed:.1f} s: loss {first_loss:.3f} -> {last_loss:.3f}, "
              f"{tokens / train_s:,.0f} tokens/s")
        if args.log_csv:
            print(f"wrote {args.log_csv}" + (f", checkpoints in {args.save_dir}"
                                             if args.save_dir else ""))
            if args.plot:
                plot(args.log_csv, args.plot)


if __name__ == "__main__":
    main()
