"""Big models without building them whole: init and load peaks per rank, ours vs the others.

    python benchmarks/big_model_init.py --out benchmarks/results/big_model_init.md
    python benchmarks/big_model_init.py --smoke --out /tmp/big.md   # small sizes (the suite's)

Three parts, each system in fresh processes, systems alternated, medians over --rounds:

1. init, W ranks on gloo (default 2): the tests' GPT (tests/fsdp_models.py at 310M parameters,
   tied embedding, torch's init contract) with its blocks and the root as units.
   - whole: built whole on each rank (seeded), then `fully_shard`: what users do today.
   - ours:  built on meta, `fully_shard` (plans from shapes), `materialize` (one module at a
            time into the shards).
   - fsdp2: built on meta, torch `fully_shard` per block and root, `to_empty(device="cpu")`,
            then every module's `reset_parameters`, in construction order.
   Metric: peak RSS growth per rank (VmHWM - VmRSS, VmHWM reset just before the model is built);
   target for ours: <= 1.1 x shard + largest module's own parameters + 64 MiB. Each system's
   weights are compared with a one-process build at the same seed (parameters that differ).
2. load, W ranks: a Hugging Face checkpoint (bf16, several safetensors files) into the fp32
   shards of a meta-built model.
   - ours:   `load_hf_checkpoint` (each rank reads only its own byte ranges).
   - gather: `gathered_parameters(writeback=True)` + `load_state_dict` of every file (what a
            user can do without it: every rank holds the whole model and reads every file).
   - dcp_hf: torch DCP's `HuggingFaceStorageReader` into FSDP2's sharded state dict.
   Metrics: peak RSS growth per rank, seconds, bytes read per rank (ours: the loader's counter;
   the others: /proc/self/io rchar, which misses memory-mapped reads, so their files' total is
   shown as what they touch).
3. scale: one process as rank 0 of --fake-world (512) on the fake process group materializes a
   Llama-style model (Llama-3-8B shapes, `LlamaForCausalLM` from transformers, built on meta)
   with a constant init_fn. Target: peak <= shard + the largest module (the embedding) + slack.
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
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MB = 1e6
MiB = 2 ** 20
SLACK = 64 * MiB

from ranks import (add_worker_flags, alternate, command_line, cpu_model,  # noqa: E402
                   peak, reset_peak, run_one, run_ranks, worst_rank_median, write_report)


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


# ---------------------------------------------------------------------------------------------
# Models.

def make_gpt(args, device="cpu"):
    """The tests' GPT (tied embedding, torch's init contract: each module's reset_parameters),
    at the benchmark's size, seeded."""
    import torch
    from fsdp_models import GPT
    torch.manual_seed(args.seed)
    with torch.device(device):
        return GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers,
                   seq=args.seq)


def shard_blocks(model, shard):
    for block in model.blocks:
        shard(block)
    return shard(model)


def own_params(module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def largest_module_bytes(model) -> int:
    """The largest single module's own parameters (what materialize holds at full shape)."""
    return max(own_params(m) for m in model.modules()) * 4


def differing(reference: dict, full: dict) -> list:
    return [k for k, v in reference.items() if not __import__("torch").equal(v, full[k])]


# ---------------------------------------------------------------------------------------------
# Part 1: init (a worker is one rank of one system).

def build_sharded(system: str, args):
    """The GPT sharded over the default group, initialized the way `system` does it."""
    import torch
    import torch.distributed as dist
    import vescale_engine
    from vescale_engine import fsdp
    if system == "whole":
        module = shard_blocks(make_gpt(args), fsdp.fully_shard)
    elif system == "ours":
        module = shard_blocks(make_gpt(args, device="meta"), fsdp.fully_shard)
        torch.manual_seed(args.seed)  # the generator state a whole build starts from
        vescale_engine.materialize(module, device=torch.device("cpu"))
    else:  # fsdp2
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        module = shard_blocks(make_gpt(args, device="meta"),
                              lambda m: fully_shard(m, mesh=mesh))
        module.to_empty(device="cpu")
        torch.manual_seed(args.seed)
        for m in module.modules():  # construction order, as a whole build runs them
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return module


def init_worker(system: str, args) -> dict:
    import torch
    import torch.distributed as dist
    import vescale_engine
    from vescale_engine import fsdp
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Once at a tiny size first: imports and one-time setup are not the init's memory.
    build_sharded(system, argparse.Namespace(**{**vars(args), "layers": 1, "dim": 8,
                                                "heads": 1, "vocab": 16, "seq": 4}))
    base = reset_peak()
    start = time.perf_counter()
    module = build_sharded(system, args)
    seconds = time.perf_counter() - start
    growth = peak() - base
    shard = shard_bytes(module)
    largest = largest_module_bytes(make_gpt(args, device="meta"))
    row = {"system": system, "rank": rank, "growth": growth, "seconds": seconds,
           "shard": shard, "largest_module": largest}
    # Exactness against a one-process build at the same seed (after the peak was read).
    if system == "fsdp2":
        full = {k: v.full_tensor() for k, v in module.state_dict().items()}
    else:
        full = vescale_engine.full_state_dict(module)
    reference = make_gpt(args).state_dict()
    row["differing"] = len(differing(reference, full))
    row["parameters"] = len(reference)
    dist.barrier()
    dist.destroy_process_group()
    return row


def shard_bytes(module) -> int:
    """This rank's fp32 parameter storage: our DBuffers' shards (padding included), or FSDP2's
    local DTensor pieces."""
    units = _units(module)
    if units:
        return sum(buf.shard_size * buf.master.element_size() for u in units for buf in u.buffers)
    return sum(p.to_local().numel() * p.element_size() for p in module.parameters())


def _units(module):
    from vescale_engine.fsdp import unit_of
    return [unit_of(m) for m in module.modules() if unit_of(m) is not None]


# ---------------------------------------------------------------------------------------------
# Part 2: load.

def write_checkpoint(args, path: str) -> int:
    """A Hugging Face style checkpoint of the GPT (bf16, several files); its tensor bytes."""
    import torch
    from vescale_engine.checkpoint.safetensors_format import save_file
    model = make_gpt(args)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()
          if k != "head.weight"}  # tied to wte.weight: saved once, as transformers does
    files, current, size, limit = [], {}, 0, args.shard_mb * MB
    for name, tensor in sd.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            files.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    files.append(current)
    weight_map = {}
    for i, chunk in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(chunk, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in chunk})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def load_worker(system: str, args) -> dict:
    import torch
    import torch.distributed as dist
    import vescale_engine
    from vescale_engine import fsdp
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = args.checkpoint
    if system in ("ours", "gather"):
        module = shard_blocks(make_gpt(args, device="meta"), fsdp.fully_shard)
        from vescale_engine.materialize import allocate_shards
        allocate_shards(module, torch.device("cpu"))
    else:  # dcp_hf: FSDP2's DTensor shards
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        module = shard_blocks(make_gpt(args, device="meta"),
                              lambda m: fully_shard(m, mesh=mesh))
        module.to_empty(device="cpu")
    import torch.distributed.checkpoint  # noqa: F401  (imports are not the load's memory)
    import vescale_engine.checkpoint.hf  # noqa: F401
    dist.barrier()
    base, read0 = reset_peak(), bytes_read()
    start = time.perf_counter()
    counted = None
    if system == "ours":
        stats = vescale_engine.load_hf_checkpoint(module, path)
        counted = stats.bytes_read
    elif system == "gather":
        from vescale_engine.checkpoint.safetensors_format import load_file
        with fsdp.gathered_parameters(module, writeback=True):
            state = {}
            for fname in sorted(set(json.load(open(os.path.join(
                    path, "model.safetensors.index.json")))["weight_map"].values())):
                state.update(load_file(os.path.join(path, fname)))
            state["head.weight"] = state["wte.weight"]
            module.load_state_dict({k: v.float() for k, v in state.items()})
            del state
    else:
        import torch.distributed.checkpoint as dcp
        sd = module.state_dict()
        sd.pop("head.weight")  # tied: loaded through wte.weight
        dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(path))
    seconds = time.perf_counter() - start
    growth, read = peak() - base, bytes_read() - read0
    full = {k: v.full_tensor() for k, v in module.state_dict().items()} \
        if system == "dcp_hf" else vescale_engine.full_state_dict(module)
    reference = {k: v.to(torch.bfloat16).float() for k, v in make_gpt(args).state_dict().items()}
    shard = shard_bytes(module)
    row = {"system": system, "rank": rank, "growth": growth, "seconds": seconds, "rchar": read,
           "counted": counted, "shard": shard, "differing": len(differing(reference, full)),
           "parameters": len(reference)}
    dist.barrier()
    dist.destroy_process_group()
    return row


# ---------------------------------------------------------------------------------------------
# Part 3: rank 0 of many on the fake process group.

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=8192, tie_word_embeddings=False)


def scale_worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM
    import vescale_engine
    from vescale_engine import fsdp
    shapes = dict(LLAMA_8B)
    if args.smoke:
        shapes.update(vocab_size=4096, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shapes))
    params = sum(p.numel() for p in model.parameters())
    largest = largest_module_bytes(model)
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    shard = shard_bytes(model)

    def constant(module):  # cheap: the point is memory, not the init's arithmetic
        for p in module.parameters(recurse=False):
            p.data.fill_(0.02)
        for b in module.buffers(recurse=False):
            if b.is_floating_point():
                b.data.fill_(1.0)

    base = reset_peak()
    start = time.perf_counter()
    vescale_engine.materialize(model, device=torch.device("cpu"), init_fn=constant)
    seconds = time.perf_counter() - start
    growth = peak() - base
    dist.destroy_process_group()
    return {"system": "ours", "params": params, "fp32_bytes": params * 4, "shard": shard,
            "largest_module": largest, "growth": growth, "seconds": seconds,
            "world_size": args.fake_world}


# ---------------------------------------------------------------------------------------------
# Driver.

def worker_flags(args) -> list:
    flags = ["--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads),
             "--vocab", str(args.vocab), "--seq", str(args.seq), "--seed", str(args.seed),
             "--shard-mb", str(args.shard_mb), "--fake-world", str(args.fake_world)]
    if args.checkpoint:
        flags += ["--checkpoint", args.checkpoint]
    return flags + (["--smoke"] if args.smoke else [])


def run_part(part, systems, args):
    flags = ["--part", part, *worker_flags(args)]

    def launch(system):
        return run_ranks(os.path.abspath(__file__), system, args.world, flags,
                         timeout_s=args.timeout)

    def describe(rows):
        return " ".join(f"r{r['rank']}: {r['growth'] / MB:,.0f} MB {r['seconds']:.2f} s"
                        for r in rows)
    return alternate(systems, args.rounds, launch, describe, label=f"[{part}] ")


def init_table(runs, args) -> list:
    ours = runs["ours"][0]
    target = max(1.1 * r["shard"] + r["largest_module"] + SLACK for r in ours)
    out = [f"## 1. Init: GPT {args.params / 1e6:,.0f}M parameters at {args.world} ranks (gloo)",
           "",
           "| system | peak growth per rank (MB, worst rank) | seconds | shard per rank (MB) | "
           "parameters differing from a one-process build |",
           "|---|---:|---:|---:|---:|"]
    for system, rows in runs.items():
        out.append(f"| {system} | {worst_rank_median(rows, 'growth') / MB:,.0f} | "
                   f"{worst_rank_median(rows, 'seconds'):.2f} | "
                   f"{max(r['shard'] for r in rows[0]) / MB:,.0f} | "
                   f"{max(r['differing'] for r in rows[0])} of {rows[0][0]['parameters']} |")
    got = worst_rank_median(runs["ours"], "growth")
    out += ["", f"Target for ours: peak growth <= 1.1 x shard + largest module's own parameters "
            f"({ours[0]['largest_module'] / MB:,.0f} MB) + 64 MiB = {target / MB:,.0f} MB: "
            f"**{'met' if got <= target else 'MISSED'}** ({got / MB:,.0f} MB)."]
    return out


def load_table(runs, args, total) -> list:
    out = [f"## 2. Load: a bf16 Hugging Face checkpoint ({total / MB:,.0f} MB of tensors in "
           f"{args.files} files) into fp32 shards at {args.world} ranks", "",
           "| system | peak growth per rank (MB, worst rank) | seconds | bytes read per rank "
           "(MB: counted / rchar) | parameters differing from the file |",
           "|---|---:|---:|---:|---:|"]
    for system, rows in runs.items():
        counted = "/".join(f"{r['counted'] / MB:,.1f}" for r in rows[0]) \
            if rows[0][0]["counted"] is not None else "n/a"
        rchar = "/".join(f"{r['rchar'] / MB:,.1f}" for r in rows[0])
        out.append(f"| {system} | {worst_rank_median(rows, 'growth') / MB:,.0f} | "
                   f"{worst_rank_median(rows, 'seconds'):.2f} | {counted} / {rchar} | "
                   f"{max(r['differing'] for r in rows[0])} of {rows[0][0]['parameters']} |")
    ours = runs["ours"]
    cap = max(r["shard"] for r in ours[0]) + SLACK
    got = worst_rank_median(ours, "growth")
    summed = sum(r["counted"] for r in ours[0])
    own_ok = all(r["counted"] <= r["shard"] / 2 + 1 for r in ours[0])  # bf16: 2 bytes per elem
    out += ["", f"Targets for ours: peak <= shard + 64 MiB = {cap / MB:,.0f} MB: "
            f"**{'met' if got <= cap else 'MISSED'}** ({got / MB:,.0f} MB); bytes read per rank "
            f"<= its own elements x 2: **{'met' if own_ok else 'MISSED'}**; sum over ranks "
            f"{summed:,} = tensor bytes in the files {total:,}: "
            f"**{'met' if summed == total else 'MISSED'}**.",
            "rchar counts read()/pread() bytes; memory-mapped reads (safetensors' and DCP's) do not "
            "appear in it: those readers touch every file they open."]
    return out


def scale_table(row, args) -> list:
    bound = row["shard"] + row["largest_module"] + SLACK
    return [f"## 3. Scale: rank 0 of W = {row['world_size']} (fake process group), "
            f"Llama-style model of {row['params'] / 1e9:.2f}B parameters "
            f"({row['fp32_bytes'] / 1e9:.1f} GB in fp32)", "",
            "| shard (MB) | largest module (MB) | peak growth (MB) | bound: shard + largest "
            "+ 64 MiB (MB) | seconds |", "|---:|---:|---:|---:|---:|",
            f"| {row['shard'] / MB:,.0f} | {row['largest_module'] / MB:,.0f} | "
            f"{row['growth'] / MB:,.0f} | {bound / MB:,.0f} | {row['seconds']:.1f} |", "",
            f"Target: **{'met' if row['growth'] <= bound else 'MISSED'}**."]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "big_model_init.md"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=int, default=200, help="checkpoint file size")
    parser.add_argument("--fake-world", type=int, default=512)
    parser.add_argument("--parts", nargs="*", default=["init", "load", "scale"])
    parser.add_argument("--smoke", action="store_true", help="small sizes, one round")
    parser.add_argument("--timeout", type=float, default=1800)
    add_worker_flags(parser)  # run_ranks' side
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke and not args.worker:
        args.layers, args.dim, args.heads, args.vocab, args.seq = 2, 64, 4, 512, 32
        args.rounds, args.shard_mb, args.fake_world = 1, 1, 8
    if args.worker:
        if args.part == "scale":
            row = scale_worker(args)
        else:
            row = (init_worker if args.part == "init" else load_worker)(args.system, args)
        print(json.dumps(row), flush=True)
        return

    import torch
    args.params = sum(p.numel() for p in make_gpt(args, device="meta").parameters())
    command = command_line(__file__)
    lines = ["# Big models: init and load without building them whole", "",
             f"Produced by `{command}` (torch {torch.__version__}, {os.cpu_count()} CPUs: "
             f"{cpu_model()}; "
             f"{args.rounds} round(s), systems alternated, fresh processes, medians). "
             "MB = 10^6 bytes; growth = VmHWM - VmRSS, VmHWM reset just before the measured "
             "work.", ""]
    if "init" in args.parts:
        lines += init_table(run_part("init", ["whole", "ours", "fsdp2"], args), args) + [""]
    if "load" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            args.checkpoint = tmp
            total = write_checkpoint(args, tmp)
            args.files = len([f for f in os.listdir(tmp) if f.endswith(".safetensors")])
            lines += load_table(run_part("load", ["ours", "gather", "dcp_hf"], args), args,
                                total) + [""]
            args.checkpoint = None
    if "scale" in args.parts:
        row = run_one(__file__, ["--worker", "--part", "scale", *worker_flags(args)],
                      args.timeout, env={"OMP_NUM_THREADS": "2", "PYTHONPATH": ROOT})
        if "error" in row:
            raise SystemExit(f"scale part failed:\n{row['error']}")
        lines += scale_table(row, args)
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
