"""Sequence parallelism (DeepSpeed Ulysses / ALST) under veScale Engine beside DeepSpeed ZeRO-3:
activation memory, peak memory and step time per rank at several sequence lengths, with and
without sequence parallelism, 2 gloo ranks.

Both systems run DeepSpeed's tutorial recipe on the same tiny Llama (sdpa attention) built
locally with seed 0: `UlyssesSPAttentionHF.register_with_transformers` (sp 2: both ranks compute
one sequence together; sp 1: plain data parallelism, each rank its own sequence), the
config's "sequence_parallel_size", `UlyssesSPDataLoaderAdapter`'s split of each sequence, the
tutorial's loss aggregation over the SP group; ours after `vescale_engine.patch_deepspeed()`
with a "vescale" section, DeepSpeed as it is. Per rank and step:

- activation bytes: what autograd keeps for backward during one training forward (the
  distinct storages its saved-tensor hooks see; parameters excluded), the number the planner's
  `--sp --memory` estimate is checked against;
- peak RSS above the rank's RSS just before the step (glibc's free memory returned to the
  system first with malloc_trim, then VmHWM reset: the step's transient memory: activations,
  gathered parameters, gradients, the communication buffers);
- step time (forward, backward, optimizer step), median of the timed steps.

Runs are fresh processes; systems alternate round by round; medians over rounds of the worst
rank. WORKAROUNDS, both systems alike: on gloo the backward of torch's
`torch.distributed.nn.functional.all_gather` scatters from a group rank where torch expects a
global rank, so the loss aggregation uses an all-gather whose backward is an all-reduce; and
DeepSpeed 0.19.3's UlyssesSPDataLoaderAdapter all-gathers a 0-dim length into 1-element
tensors, which gloo refuses (0.19.8 sends 1 element), so its 0-dim all-gather inputs are sent
as 1 element.

    python benchmarks/sequence_parallel.py                 # writes results/sequence_parallel.md
    python benchmarks/sequence_parallel.py --seqs 256 --rounds 1 --steps 2   # a quick smoke run
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ranks import (add_worker_flags, alternate, command_line, cpu_model,  # noqa: E402
                   git_describe, peak, reset_peak, run_ranks, write_report)

SYSTEMS = ("vescale", "deepspeed")
LABELS = {"vescale": "veScale Engine", "deepspeed": "DeepSpeed ZeRO-3"}
MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
ACTIVATION_TARGET = 0.10  # activation bytes at sp 2 within 10% of half those at sp 1


def _parser():
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_flags(parser, SYSTEMS)
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--sps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "sequence_parallel.md"))
    return parser


# ----------------------------------------------------------------------------- in a rank

# What the ranks of this benchmark and of tests/integration/test_sequence_parallel.py share.

def gather_for_loss(group, value):
    """torch.distributed.nn.functional.all_gather with a gloo-safe backward (an all-reduce,
    the same sum of gradients; module docstring): the loss aggregation's gather."""
    return _gather_function().apply(group, value)


def _gather_function():
    """The autograd Function behind gather_for_loss, made on first use (torch imported then)."""
    import torch
    import torch.distributed as dist

    global _GATHER
    if _GATHER is None:
        class Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, group, value):
                ctx.group = group
                out = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
                dist.all_gather(out, value.contiguous(), group=group)
                return tuple(out)

            @staticmethod
            def backward(ctx, *grads):
                stacked = torch.stack(grads).contiguous()
                dist.all_reduce(stacked, group=ctx.group)
                return None, stacked[dist.get_rank(ctx.group)]
        _GATHER = Gather
    return _GATHER


_GATHER = None


def gloo_safe_adapter():
    """DeepSpeed 0.19.3's adapter on gloo (module docstring): deepspeed.comm as ulysses_sp
    sees it, a 0-dim all-gather input sent as 1 element (idempotent)."""
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    comm = ulysses_sp.dist
    if getattr(comm, "gloo_safe", False):
        return

    class Comm:
        gloo_safe = True

        def __getattr__(self, name):
            return getattr(comm, name)

        def all_gather(self, tensor_list, tensor, *args, **kwargs):
            return comm.all_gather(tensor_list, tensor.reshape(1) if tensor.dim() == 0
                                   else tensor, *args, **kwargs)

    ulysses_sp.dist = Comm()


def saved_activation_bytes(run_forward, module):
    """(bytes of the distinct storages autograd saves for backward during `run_forward()`,
    its result), parameters excluded: a storage a parameter of `module` holds when it is saved
    (DeepSpeed saves the gathered Parameter itself, ours a view of the unit's gathered buffer;
    both are the engine's, counted by the planner's other rows)."""
    import torch
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in {p.untyped_storage().data_ptr()
                                      for p in module.parameters()}:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    return sum(seen.values()), out


def worker(args):
    import deepspeed
    import torch
    import torch.distributed as dist
    if args.system == "vescale":
        import vescale_engine
        vescale_engine.patch_deepspeed()
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (UlyssesSPAttentionHF,
                                                                 UlyssesSPDataLoaderAdapter)
    from transformers import LlamaConfig, LlamaForCausalLM
    deepspeed.init_distributed(dist_backend="gloo")
    gloo_safe_adapter()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, max_position_embeddings=args.seq,
                                         tie_word_embeddings=False, attn_implementation="sdpa"))
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.sp,
        micro_batch_size=1, seq_length=args.seq, seq_length_is_variable=True)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    if args.sp > 1:
        config["sequence_parallel_size"] = args.sp
    if args.system == "vescale":
        config["vescale"] = {}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config, mpu=mpu)
    data = torch.randint(0, MODEL["vocab_size"], (world * (args.steps + 1), args.seq),
                         generator=torch.Generator().manual_seed(1))
    samples = [{"input_ids": ids, "labels": ids, "position_ids": torch.arange(args.seq)}
               for ids in data]
    sampler = torch.utils.data.distributed.DistributedSampler(samples, num_replicas=world,
                                                              rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(samples, batch_size=1, sampler=sampler)
    group = None
    if args.sp > 1:
        from deepspeed.utils import groups
        group = groups._get_sequence_parallel_group()
        loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=groups._get_sequence_parallel_rank(),
                                            sp_group=group, sp_world_size=args.sp,
                                            device=engine.device)

    def forward(batch):
        if args.sp == 1:
            labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        else:
            labels = batch["shift_labels"]
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 labels.reshape(-1), ignore_index=-100)
        if group is None:
            return loss
        good = (labels != -100).sum().float()
        losses, goods = gather_for_loss(group, loss), gather_for_loss(group, good)
        return sum(l * g for l, g in zip(losses, goods)) / max(sum(goods), 1)

    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    times, peaks, activations = [], [], []
    batches = iter(loader)
    for step in range(args.steps + 1):
        batch = next(batches)
        dist.barrier()
        libc.malloc_trim(0)  # what the last step freed leaves the RSS: both systems alike
        base = reset_peak()
        start = time.perf_counter()
        act, loss = saved_activation_bytes(lambda: forward(batch), engine.module)
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        if step:  # the first is warm-up
            times.append(elapsed)
            peaks.append(peak() - base)
            activations.append(act)
    print(json.dumps({"rank": rank, "step_s": statistics.median(times),
                      "peak_above_step_start": max(peaks), "activation_bytes": max(activations),
                      "engine": type(engine).__name__}), flush=True)


# ----------------------------------------------------------------------------- the driver

def _mb(n):
    return n / 2 ** 20


def main():
    args = _parser().parse_args()
    if args.worker:
        return worker(args)
    cases = [(seq, sp) for seq in args.seqs for sp in args.sps]
    results = {}
    for seq, sp in cases:
        flags = ["--seq", str(seq), "--sp", str(sp), "--steps", str(args.steps)]
        runs = alternate(
            SYSTEMS, args.rounds,
            lambda system: run_ranks(__file__, system, args.world, flags),
            lambda rows: f"step {max(r['step_s'] for r in rows):.3f} s, peak "
                         f"{_mb(max(r['peak_above_step_start'] for r in rows)):.1f} MB, "
                         f"activations {_mb(max(r['activation_bytes'] for r in rows)):.2f} MB",
            label=f"seq {seq} sp {sp} ")
        results[(seq, sp)] = {
            system: {key: statistics.median(max(r[key] for r in rows) for rows in rounds)
                     for key in ("step_s", "peak_above_step_start", "activation_bytes")}
            for system, rounds in runs.items()}
    _report(args, results)


def _report(args, results):
    from vescale_engine.plan.activations import DecoderDims, activation_bytes
    dims = DecoderDims.from_hf_config(MODEL)
    lines = ["# Sequence parallelism (DeepSpeed Ulysses): veScale Engine vs DeepSpeed ZeRO-3", "",
             f"Command: `{command_line(__file__)}`  ", f"Code: {git_describe()}  ",
             f"CPU: {cpu_model()}, {args.world} gloo ranks, OMP_NUM_THREADS=1  ",
             f"Model: Llama {MODEL}, fp32, micro-batch 1, sdpa attention; "
             f"{args.steps} timed steps after 1 warm-up, {args.rounds} alternated rounds, "
             "medians over rounds of the worst rank.", "",
             "| seq | sp | system | step (s) | peak above step start (MB) | activations (MB) | "
             "planner estimate (MB) |", "|---:|---:|---|---:|---:|---:|---:|"]
    for (seq, sp), systems in results.items():
        estimate = activation_bytes(dims, seq, sp=sp, dtype="fp32")
        for system, row in systems.items():
            lines.append(f"| {seq} | {sp} | {LABELS[system]} | {row['step_s']:.3f} | "
                         f"{_mb(row['peak_above_step_start']):.1f} | "
                         f"{_mb(row['activation_bytes']):.2f} | {_mb(estimate):.2f} |")
    lines += ["", "## Against the targets", ""]
    longest = max(seq for seq, _ in results)
    for sp in sorted({sp for _, sp in results if sp > 1}):
        if (longest, 1) not in results or (longest, sp) not in results:
            continue
        for system in SYSTEMS:
            one = results[(longest, 1)][system]["activation_bytes"]
            many = results[(longest, sp)][system]["activation_bytes"]
            ratio = many / (one / sp)
            lines.append(f"- {LABELS[system]}, seq {longest}: activations at sp {sp} are "
                         f"{ratio:.3f}x the ideal 1/{sp} of sp 1's (target within "
                         f"{1 + ACTIVATION_TARGET:.2f}x): "
                         f"{'met' if abs(ratio - 1) <= ACTIVATION_TARGET else 'missed'}")
    for (seq, sp), systems in results.items():
        ours, theirs = systems["vescale"], systems["deepspeed"]
        estimate = activation_bytes(dims, seq, sp=sp, dtype="fp32")
        lines.append(
            f"- seq {seq}, sp {sp}: ours / DeepSpeed step time "
            f"{ours['step_s'] / theirs['step_s']:.3f}x, peak "
            f"{ours['peak_above_step_start'] / theirs['peak_above_step_start']:.3f}x (target "
            f"<= 1 both); planner estimate / measured activations "
            f"{estimate / ours['activation_bytes']:.3f}x (target within 10%)")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
