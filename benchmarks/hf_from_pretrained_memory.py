"""from_pretrained under a ZeRO-3 config: peak memory per rank, ours vs whole vs DeepSpeed.

    python benchmarks/hf_from_pretrained_memory.py     # -> results/hf_from_pretrained_memory.md
    python benchmarks/hf_from_pretrained_memory.py --smoke --out /tmp/hf.md  # small, 1 round

A Llama checkpoint of a few hundred MB (`LlamaForCausalLM` from a `LlamaConfig`, untied, saved
with `save_pretrained` in bf16 as hub checkpoints are) is loaded with `dtype=torch.float32` on
W ranks (gloo, default 2), each system in fresh processes, systems alternated over --rounds:

- ours:  `HfDeepSpeedConfig` holding the config with its "vescale" section (what
         TrainingArguments(deepspeed=...) sets up) + `patch_deepspeed()`: from_pretrained builds
         on meta and reads the headers only; `deepspeed.initialize` (ours) wraps it and each rank
         reads its own byte ranges into its fp32 shard.
- whole: plain from_pretrained (no DeepSpeed config: every rank loads the whole model), then
         the same `deepspeed.initialize` (ours) shards it.
- deepspeed: the config without the vescale section: DeepSpeed's own zero.Init partitions as
         the model is built, rank 0 reads the checkpoint and scatters it module by module
         (transformers' ZeRO-3 loader); then DeepSpeed's engine (`torch_adam`).

Metric: peak RSS growth per rank (VmHWM - VmRSS, VmHWM reset after the imports and a warm-up
load of a tiny checkpoint), after from_pretrained and after initialize. Target for ours:
growth <= its fp32 shard + the largest module's own parameters (fp32) + 64 MiB; the baseline
(RSS of the process with the imports, before the measured work) is reported beside it. Each
system's loaded weights are compared with the file (parameters differing from it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from ranks import (add_worker_flags, alternate, command_line, cpu_model,  # noqa: E402
                   peak, reset_peak, run_ranks, worst_rank_median, write_report)

MB = 1e6
MiB = 2 ** 20
SLACK = 64 * MiB
SYSTEMS = ("ours", "whole", "deepspeed")
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}
DEEPSPEED = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
             "optimizer": OPTIMIZER, "zero_optimization": {"stage": 3}}
VESCALE = {**DEEPSPEED, "vescale": {}}


def llama_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       max_position_embeddings=256, tie_word_embeddings=False)


def write_checkpoint(args, path, tiny=False):
    """A bf16 save_pretrained directory; returns its tensor bytes."""
    import torch
    from transformers import LlamaForCausalLM
    sizes = argparse.Namespace(vocab=64, hidden=16, intermediate=32, layers=1, heads=2) \
        if tiny else args
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(sizes)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size=f"{args.file_mb}MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Worker: one rank of one system.

def load(system, path):
    """from_pretrained + initialize as `system` does them; (engine, seconds, peak after
    from_pretrained)."""
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    config = {"ours": VESCALE, "whole": None, "deepspeed": DEEPSPEED}[system]
    start = time.perf_counter()
    held = HfDeepSpeedConfig(config) if config is not None else None
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    after_load = peak()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config or VESCALE)
    del held
    return engine, time.perf_counter() - start, after_load


def worker(system, args) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    import vescale_engine
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    deepspeed.init_distributed(dist_backend="gloo")
    vescale_engine.patch_deepspeed()
    rank = dist.get_rank()
    warm, _, _ = load(system, args.tiny)  # imports, code pages, one-time setup
    unset_hf_deepspeed_config()
    warm.destroy()
    del warm
    base = reset_peak()
    engine, seconds, after_load = load(system, args.checkpoint)
    unset_hf_deepspeed_config()
    growth = peak() - base
    row = {"system": system, "rank": rank, "base": base, "seconds": seconds,
           "growth_load": after_load - base, "growth": growth}
    module = engine.module
    if system == "deepspeed":
        row["shard"] = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                           for p in module.parameters())
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            full = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        from vescale_engine.fsdp import _units
        row["shard"] = sum(b.shard_size * b.master.element_size()
                           for u in _units(module) for b in u.buffers)
        full = vescale_engine.full_state_dict(module)
    row["largest_module"] = max(sum(p.numel() for p in m.parameters(recurse=False))
                                for m in module.modules()) * 4
    if system == "deepspeed":  # DeepSpeed's module holds partitions: the model's shapes
        row["largest_module"] = max(sum(p.ds_numel for p in m.parameters(recurse=False))
                                    for m in module.modules()) * 4
    row["differing"], row["parameters"] = differing_from_file(full, args.checkpoint)
    dist.barrier()
    return row


def differing_from_file(full, path):
    import torch
    from safetensors.torch import load_file
    stored = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            stored.update(load_file(os.path.join(path, name)))
    bad = [k for k, v in stored.items()
           if k not in full or not torch.equal(full[k].float(), v.float())]
    return len(bad), len(stored)


# ---------------------------------------------------------------------------------------------
# Driver.

def report(runs, args, total, command) -> list:
    import torch
    params = total // 2
    lines = ["# from_pretrained under a ZeRO-3 config: peak memory per rank", "",
             f"Produced by `{command}` (torch {torch.__version__}, lscpu model name: "
             f"{cpu_model()}, {os.cpu_count()} CPUs; {args.rounds} round(s), systems "
             "alternated, fresh processes, medians of the worst rank). MB = 10^6 bytes; growth "
             "= VmHWM - VmRSS, VmHWM reset after the imports and a warm-up load of a tiny "
             "checkpoint; baseline = that RSS.", "",
             f"Checkpoint: `LlamaForCausalLM` ({params / 1e6:,.0f}M parameters, untied, "
             f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}) saved in bf16: "
             f"{total / MB:,.0f} MB of tensors in {args.files} files; loaded with "
             f"dtype=torch.float32 ({2 * total / MB:,.0f} MB) on {args.world} ranks (gloo).", "",
             "| system | growth after from_pretrained (MB) | growth after initialize (MB) | "
             "baseline (MB) | fp32 shard per rank (MB) | seconds | parameters differing from "
             "the file |", "|---|---:|---:|---:|---:|---:|---:|"]
    for system, rows in runs.items():
        lines.append(f"| {system} | {worst_rank_median(rows, 'growth_load') / MB:,.0f} | "
                     f"{worst_rank_median(rows, 'growth') / MB:,.0f} | "
                     f"{worst_rank_median(rows, 'base') / MB:,.0f} | "
                     f"{max(r['shard'] for r in rows[0]) / MB:,.0f} | "
                     f"{worst_rank_median(rows, 'seconds'):.2f} | "
                     f"{max(r['differing'] for r in rows[0])} of {rows[0][0]['parameters']} |")
    ours = runs["ours"]
    target = max(r["shard"] + r["largest_module"] + SLACK for r in ours[0])
    got = worst_rank_median(ours, "growth")
    lines += ["", f"Target for ours: growth <= fp32 shard + the largest module's own parameters "
              f"({ours[0][0]['largest_module'] / MB:,.0f} MB, the embedding) + 64 MiB = "
              f"{target / MB:,.0f} MB per rank: **{'met' if got <= target else 'MISSED'}** "
              f"({got / MB:,.0f} MB). whole holds the fp32 model on every rank before it "
              "shards it; deepspeed's rank 0 reads the whole checkpoint, and its engine adds "
              "an fp32 master copy and the optimizer states at initialize."]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "hf_from_pretrained_memory.md"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2752)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--file-mb", type=int, default=100, help="checkpoint file size")
    parser.add_argument("--systems", nargs="*", default=list(SYSTEMS))
    parser.add_argument("--smoke", action="store_true", help="small sizes, one round")
    parser.add_argument("--timeout", type=float, default=1800)
    add_worker_flags(parser)  # run_ranks' side
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.system, args)), flush=True)
        return
    if args.smoke:
        args.vocab, args.hidden, args.intermediate, args.layers, args.heads = 512, 64, 128, 2, 4
        args.rounds, args.file_mb = 1, 1
    command = command_line(__file__)
    with tempfile.TemporaryDirectory(prefix="hf-from-pretrained-") as tmp:
        checkpoint, tiny = os.path.join(tmp, "model"), os.path.join(tmp, "tiny")
        total = write_checkpoint(args, checkpoint)
        write_checkpoint(args, tiny, tiny=True)
        args.files = sum(name.endswith(".safetensors") for name in os.listdir(checkpoint))
        flags = ["--checkpoint", checkpoint, "--tiny", tiny]

        def launch(system):
            return run_ranks(os.path.abspath(__file__), system, args.world, flags,
                             timeout_s=args.timeout)

        def describe(rows):
            return " ".join(f"r{r['rank']}: {r['growth_load'] / MB:,.0f}/{r['growth'] / MB:,.0f}"
                            f" MB {r['seconds']:.1f} s" for r in rows)
        runs = alternate(args.systems, args.rounds, launch, describe)
    write_report(args.out, report(runs, args, total, command))


if __name__ == "__main__":
    main()
