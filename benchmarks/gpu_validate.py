"""Engine checks on one device (a GPU, or the CPU as a dry run), world size 1.

Each check passes or fails on its own and the run goes on; the results go to
OUT/gpu_validate.json and a table to OUT/gpu_validate.md. Started by benchmarks/gpu_check.sh:

    torchrun --standalone --nproc_per_node 1 benchmarks/gpu_validate.py --out DIR
    VESCALE_BACKEND=gloo python benchmarks/gpu_validate.py --device cpu --out DIR   # dry run

Checks: placement (every DBuffer and optimizer-state tensor on the engine's device, for AdamW,
AdamW8bit, Muon and Shampoo), parity_fp32 (10 steps against unsharded torch AdamW + torch clipping on
the same device, TF32 off; on CPU through the backend's native collectives), bf16_accumulation
(accumulation 2, both gradient-accumulation modes), fp16_overflow (a huge initial loss scale is
skipped down, then training steps), host_syncs (CUDA only: torch.cuda.set_sync_debug_mode counts
synchronisations in forward + backward and in the step), memory (no gathered or gradient buffer
survives a step; CUDA: memory_allocated does not drift over 10 steps), collectives (the ragged
redistributions, an all-to-all with empty splits, an object all-gather), checkpoints (save, load,
resume for AdamW, AdamW8bit, Muon and Shampoo: resumed losses equal, loaded state on the device), stage0
(the replicate-only path), big_models (meta-device init bitwise on the device, Hugging Face
checkpoint load into meta-built shards and save).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import vescale_engine  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from ranks import free_port, write_report  # noqa: E402  (benchmarks/: the script's directory)

OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "AdamW8bit": {"type": "AdamW8bit", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "Muon": {"type": "Muon", "params": {"lr": 2e-2}},
    # preconditioning from step 2, roots every 2 steps: the host-sync check's step 3 applies
    # the roots without recomputing them (a recomputation's eigh reads its error flags)
    "Shampoo": {"type": "Shampoo", "params": {"lr": 1e-3, "precondition_frequency": 2}},
}
MICRO, SEQ, VOCAB = 4, 64, 256


def make_model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128))
    return model.to(device)


def config(optimizer="AdamW", **top):
    vescale = top.pop("vescale", {})
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10_000,
            "optimizer": copy.deepcopy(OPTIMIZERS[optimizer]),
            "zero_optimization": {"stage": 3},
            "vescale": {"wrap_policy": {"module_classes": ["Block"]}, **vescale}, **top}


def batch(step, device):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen)
    data = data.to(device, non_blocking=True)
    return data[:, :-1], data[:, 1:]


def build(cfg, seed=0):
    engine, optimizer, _, _ = vescale_engine.initialize(model=make_model(seed), config=cfg)
    return engine, optimizer


def train(engine, steps, first=0):
    """Optimizer steps over micro-batches first, first+1, ...; the losses as floats."""
    losses = []
    micro = first * engine.gradient_accumulation_steps()
    for _ in range(steps):
        window = []
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(*batch(micro, engine.device))
            engine.backward(loss)
            engine.step()
            window.append(loss.detach())
            micro += 1
        losses.append(torch.stack(window).float().mean().item())
    return losses


def dbuffers(module):
    from vescale_engine.fsdp import unit_of
    return [buf for m in module.modules() if unit_of(m) is not None
            for buf in unit_of(m).buffers]


def state_tensors(optimizer):
    """The optimizer's state tensors, less Shampoo's step count, which it keeps on the host by
    design (its schedule reads it every step)."""
    out = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" and isinstance(optimizer, vescale_engine.optim.Shampoo):
                continue
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, dict):
                out += [v for v in value.values() if isinstance(v, torch.Tensor)]
    return out


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# -- checks -------------------------------------------------------------------------------------

def check_placement(device):
    details = {}
    for name in OPTIMIZERS:
        engine, optimizer = build(config(name, gradient_clipping=1.0))
        train(engine, 2)
        wrong = []
        for buf in dbuffers(engine.module):
            tensors = {"master": buf.master, "grad": buf.grad, "full": buf.full,
                       "full_grad": buf.unreduced.full_grad}
            for attr, t in tensors.items():  # full buffers are None until first needed
                if t is not None and t.device.type != device.type:
                    wrong.append(f"{buf.name}.{attr} on {t.device}")
        for t in state_tensors(optimizer):
            if t.device.type != device.type:
                wrong.append(f"optimizer state {tuple(t.shape)} on {t.device}")
        details[name] = {"engine.device": str(engine.device), "misplaced": wrong[:5],
                         "misplaced_count": len(wrong)}
        engine.destroy()
        if engine.device.type != device.type or wrong:
            return False, details
    return True, details


def check_parity_fp32(device):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    steps, lr, wd = 10, 1e-3, 0.01
    ref = make_model(0, device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd, eps=1e-8)
    ref_losses = []
    for step in range(steps):
        loss = ref(*batch(step, device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    cfg = config("AdamW", gradient_clipping=1.0,
                 vescale={"native_collectives": True})
    cfg["optimizer"]["params"].update(eps=1e-8)
    engine, _ = build(cfg)
    losses = train(engine, steps)
    full = vescale_engine.full_state_dict(engine.module)
    ref_state = ref.state_dict()
    dparam = max((full[k].float() - v.float()).abs().max().item() for k, v in ref_state.items())
    dloss = max(abs(a - b) for a, b in zip(losses, ref_losses))
    engine.destroy()
    ok = dloss < 1e-4 and dparam < 1e-4
    return ok, {"max_abs_dloss": dloss, "max_abs_dparam": dparam, "steps": steps,
                "last_loss": losses[-1], "ref_last_loss": ref_losses[-1]}


def check_bf16_accumulation(device):
    """bf16 compute with accumulation 2 in both accumulation modes: the modes agree, each
    follows the fp32 run within bf16's resolution, the parameters moved, and each mode did the
    reduce-scatters it should. (A falling loss is no test here: 6 steps on random tokens can
    end on the loss they began with at bf16's 0.4% resolution; the H200 run of 2026-11-30 did.)"""
    from vescale_engine.shard.stats import STATS
    details, runs, reductions, moved = {}, {}, {}, {}
    for local in (False, True, "fp32"):
        precision = {} if local == "fp32" else {"bf16": {"enabled": True}}
        cfg = config("AdamW", gradient_accumulation_steps=2, gradient_clipping=1.0,
                     vescale={"local_grad_accumulation": local is True}, **precision)
        engine, _ = build(cfg)
        before = STATS.reduce_scatters
        initial = vescale_engine.full_state_dict(engine.module)
        runs[local] = train(engine, 6)
        reductions[local] = STATS.reduce_scatters - before
        after = vescale_engine.full_state_dict(engine.module)
        moved[local] = any(not torch.equal(initial[k], after[k]) for k in initial)
        engine.destroy()
        name = "fp32_reference" if local == "fp32" else f"local_grad_accumulation={local}"
        details[name] = {"losses": [round(x, 4) for x in runs[local]],
                         "reduce_scatters": reductions[local], "parameters_changed": moved[local]}
    finite = all(torch.isfinite(torch.tensor(v)).all() for v in runs.values())
    agree = max(rel(a, b) for a, b in zip(runs[False], runs[True]))
    vs_fp32 = max(rel(a, b) for local in (False, True) for a, b in zip(runs[local], runs["fp32"]))
    details.update(max_rel_difference_between_modes=agree, max_rel_difference_to_fp32=vs_fp32)
    # The default reduce-scatters every micro-step (2 per step), the opt-in once per step.
    ok = finite and agree < 2e-2 and vs_fp32 < 2e-2 and all(moved.values()) and \
        reductions[False] == 2 * reductions[True] > 0
    return ok, details


def check_fp16_overflow(device):
    cfg = config("AdamW", fp16={"enabled": True, "initial_scale_power": 32})
    engine, _ = build(cfg)
    before = {k: v.clone() for k, v in vescale_engine.full_state_dict(engine.module).items()}
    losses = []
    for step in range(40):
        losses += train(engine, 1, first=step)
        if engine.global_steps > engine.skipped_steps:  # a step was taken
            break
    after = vescale_engine.full_state_dict(engine.module)
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    scale = engine.loss_scaler.loss_scale
    details = {"skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
               "loss_scale": scale, "parameters_changed": changed, "last_loss": losses[-1]}
    engine.destroy()
    ok = engine.skipped_steps >= 1 and scale < 2.0 ** 32 and changed and \
        all(map(lambda x: x == x and abs(x) != float("inf"), losses))
    return ok, details


def _syncs(caught):
    """The synchronisation warnings among `caught`: torch also warns, once per process, that
    the debug mode itself is a prototype (the H200 run of 2026-11-30 counted that one)."""
    return [w for w in caught if "debug mode is a prototype" not in str(w.message)]


def check_host_syncs(device):
    if device.type != "cuda":
        return None, {"note": "not applicable on CPU (no device synchronisation)"}
    details, ok = {}, True
    for name in OPTIMIZERS:
        engine, _ = build(config(name, gradient_clipping=1.0))
        train(engine, 2)  # warm-up: allocator, lazily built tables
        torch.cuda.synchronize()
        counts = {}
        for phase in ("forward_backward", "step"):
            counts[phase] = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = engine(*batch(7, engine.device))
                engine.backward(loss)
                counts["forward_backward"] = len(_syncs(caught))
                engine.step()
                counts["step"] = len(_syncs(caught)) - counts["forward_backward"]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        details[name] = counts
        details[name + "_first_step_sync"] = [str(w.message)[:120] for w in _syncs(caught)][:3]
        engine.destroy()
        ok = ok and counts["forward_backward"] == 0 and counts["step"] <= 1
    return ok, details


def check_memory(device):
    engine, _ = build(config("AdamW", gradient_clipping=1.0))
    allocated = []
    for step in range(15):
        train(engine, 1, first=step)
        if device.type == "cuda":
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
    held = [f"{buf.name}.{attr}" for buf in dbuffers(engine.module)
            for attr, nbytes in (("full_bytes_held", buf.full_bytes_held),
                                 ("full_grad_bytes_held", buf.unreduced.bytes_held)) if nbytes]
    engine.destroy()
    details = {"full_buffers_held_after_step": held}
    ok = not held
    if allocated:
        drift = max(allocated[5:]) - min(allocated[5:])
        details.update(memory_allocated_mb=allocated[-1] / 1e6, drift_bytes_steps_5_to_14=drift)
        ok = ok and drift == 0
    return ok, details


def check_collectives(device):
    import torch.distributed as dist
    from vescale_engine.shard.ragged import (RaggedShard, ragged_to_ragged, ragged_to_replicate,
                                             ragged_to_root, root_to_ragged)
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.arange(6 * 10, dtype=torch.float32, device=device).view(6, 10)
    spec = RaggedShard.even((6, 10), 10, world)
    start, end = spec.local_range(rank)
    local = full.reshape(-1)[start:end].clone()
    results = {
        "ragged_to_replicate": torch.equal(ragged_to_replicate(local, spec), full),
        "ragged_to_root": torch.equal(ragged_to_root(local, spec, 0).reshape(-1),
                                      full.reshape(-1)) if rank == 0 else True,
        "root_to_ragged": torch.equal(root_to_ragged(full if rank == 0 else None, spec, 0,
                                                     dtype=full.dtype, device=device), local),
        "ragged_to_ragged": torch.equal(ragged_to_ragged(local, spec, spec), local),
    }
    empty = torch.empty(0, device=device)
    out = torch.empty(0, device=device)
    dist.all_to_all_single(out, empty, output_split_sizes=[0] * world,
                           input_split_sizes=[0] * world)
    results["all_to_all_single_empty"] = out.numel() == 0
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    results["all_gather_object"] = objects == [{"rank": r} for r in range(world)]
    results["tensors_on_device"] = ragged_to_replicate(local, spec).device.type == device.type
    return all(results.values()), results


def check_checkpoints(device):
    details, ok = {}, True
    for name in OPTIMIZERS:
        with tempfile.TemporaryDirectory() as tmp:
            engine, _ = build(config(name, gradient_clipping=1.0))
            train(engine, 3)
            engine.save_checkpoint(tmp, tag="step3")
            expected = train(engine, 3, first=3)
            engine.destroy()
            resumed, optimizer = build(config(name, gradient_clipping=1.0), seed=1)
            resumed.load_checkpoint(tmp, tag="step3")
            misplaced = [t.device for t in state_tensors(optimizer)
                         if t.device.type != device.type]
            misplaced += [b.master.device for b in dbuffers(resumed.module)
                          if b.master.device.type != device.type]
            got = train(resumed, 3, first=3)
            resumed.destroy()
        worst = max(rel(a, b) for a, b in zip(got, expected))
        details[name] = {"max_rel_dloss_after_resume": worst, "misplaced": len(misplaced)}
        ok = ok and worst < 1e-6 and not misplaced
    return ok, details


def check_stage0(device):
    engine, _ = build(config("AdamW", zero_optimization={"stage": 0}))
    losses = train(engine, 3)
    engine.destroy()
    ok = all(x == x for x in losses) and losses[-1] < losses[0]
    return ok, {"losses": [round(x, 4) for x in losses]}


def check_big_models(device):
    """Issue 14 on the device: a meta-built model (the tests' GPT, torch's init contract)
    materialized on the device equals a whole build there with the same seed, bitwise; a
    Hugging Face style checkpoint (fp32: in place; bf16: through pinned staging) loads into
    meta-built shards exactly; save_hf_checkpoint writes what was loaded."""
    import torch.distributed as dist
    from fsdp_models import GPT as TorchInitGPT
    from vescale_engine import fsdp
    from vescale_engine.launch.process_group import join_process_group
    from vescale_engine.checkpoint.safetensors_format import load_file, save_file
    if not dist.is_initialized():
        join_process_group(120)
    size = dict(vocab=512, dim=128, heads=4, layers=3, seq=64)

    def sharded_meta():
        with torch.device("meta"):
            model = TorchInitGPT(**size)
        for block in model.blocks:
            fsdp.fully_shard(block)
        return fsdp.fully_shard(model)

    torch.manual_seed(0)
    with torch.device(device):
        reference = {k: v.detach().cpu() for k, v in TorchInitGPT(**size).state_dict().items()}
    model = sharded_meta()
    torch.manual_seed(0)
    vescale_engine.materialize(model, device=device)
    full = {k: v.cpu() for k, v in vescale_engine.full_state_dict(model).items()}
    details = {"materialize_on": str(next(model.parameters()).device),
               "materialize_differing": [k for k in reference if not torch.equal(reference[k],
                                                                                 full[k])]}
    ok = details["materialize_on"].startswith(device.type) and not details["materialize_differing"]
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            path = os.path.join(tmp, str(dtype)[6:])
            os.makedirs(path)
            save_file({k: v.to(dtype) for k, v in reference.items() if k != "head.weight"},
                      os.path.join(path, "model.safetensors"))
            loaded = sharded_meta()
            result = vescale_engine.load_hf_checkpoint(loaded, path)
            got = {k: v.cpu() for k, v in vescale_engine.full_state_dict(loaded).items()}
            bad = [k for k, v in reference.items() if not torch.equal(v.to(dtype).float(), got[k])]
            details[f"load_{str(dtype)[6:]}"] = {"differing": bad,
                                                 "bytes_read": result.bytes_read,
                                                 "on": str(next(loaded.parameters()).device)}
            ok = ok and not bad and result.bytes_read > 0
        out = os.path.join(tmp, "saved")
        vescale_engine.save_hf_checkpoint(model, out, dtype="fp32")
        saved = {}
        for name in os.listdir(out):
            if name.endswith(".safetensors"):
                saved.update(load_file(os.path.join(out, name)))
        bad = [k for k, v in saved.items() if not torch.equal(v, reference[k])]
        details["save_fp32"] = {"tensors": len(saved), "differing": bad}
        ok = ok and saved and not bad
    return ok, details


CHECKS = [check_placement, check_parity_fp32, check_bf16_accumulation, check_fp16_overflow,
          check_host_syncs, check_memory, check_collectives, check_checkpoints, check_stage0,
          check_big_models]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", required=True, help="directory for the JSON and the table")
    parser.add_argument("--only", nargs="*", help="run only these checks (names without check_)")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # started without torchrun: a one-rank job of our own
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if args.device == "cpu":
        os.environ["VESCALE_BACKEND"] = "gloo"
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_validate: --device cuda but torch.cuda.is_available() is False")
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for check in CHECKS:
        name = check.__name__[len("check_"):]
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            ok, details = check(device)
        except Exception:  # noqa: BLE001  (one failing check must not stop the others)
            ok, details = False, {"error": traceback.format_exc()[-2500:]}
        status = "n/a" if ok is None else "PASS" if ok else "FAIL"
        row = {"check": name, "status": status, "seconds": round(time.perf_counter() - start, 1),
               "details": details}
        results.append(row)
        print(f"[{status}] {name} ({row['seconds']} s): {json.dumps(details, default=str)[:600]}",
              flush=True)
    report = {"device": str(device), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
              "checks": results}
    with open(os.path.join(args.out, "gpu_validate.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    lines = [f"# gpu_validate on {report['gpu'] or device} (torch {torch.__version__})", "",
             "| check | status | s | details |", "|---|---|---:|---|"]
    for row in results:
        text = json.dumps(row["details"], default=str).replace("|", "/")[:400]
        lines.append(f"| {row['check']} | {row['status']} | {row['seconds']} | {text} |")
    write_report(os.path.join(args.out, "gpu_validate.md"), lines, echo=False)
    failed = [r["check"] for r in results if r["status"] == "FAIL"]
    print(f"gpu_validate: {len(results) - len(failed)} of {len(results)} checks passed or n/a"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
