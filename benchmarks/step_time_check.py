"""`vescale plan --time` against a measured step: benchmarks/gpu_step_time.py's GPT at world
size 1 (its JSON), predicted on the cluster file of the GPU it ran on, for ours and FSDP2.

On a GPU the predictions must be within --tolerance (10%) of the measured medians; the
device's cluster file is picked from its name (H100 -> h100, H200 -> h200) unless --cluster
names one. A CPU run (the GPU check's dry run) has no cluster of its own: the predictions on
h100 are printed, not compared.

    python benchmarks/step_time_check.py --measured OUT/gpu_step_time_cuda.json --out F.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
if HERE not in sys.path:  # imported by path (tests/core/plan/): ranks.py beside it
    sys.path.append(HERE)
from ranks import write_report  # noqa: E402

SYSTEMS = {"veScale": "ours", "FSDP2": "fsdp2"}


def gpt_shapes(layers: int, dim: int, vocab: int, seq: int, head_dim: int = 128) -> dict:
    """examples/gpt_model.py's GPT as a shapes file: tied embedding (used twice), learned
    positions, blocks of LayerNorm, fused qkv, output projection and a 4x MLP; heads of
    `head_dim` (gpu_step_time.py's n_head = dim // 128; fsdp_step_time.py's dim // 64)."""
    def t(name, shape, **extra):
        return {"name": name, "shape": shape, **extra}
    block = [t("ln_1.weight", [dim]), t("ln_1.bias", [dim]), t("attn.weight", [3 * dim, dim]),
             t("attn_proj.weight", [dim, dim]), t("ln_2.weight", [dim]), t("ln_2.bias", [dim]),
             t("fc.weight", [4 * dim, dim]), t("proj.weight", [dim, 4 * dim])]
    return {"name": f"gpt-{layers}x{dim}",
            "architecture": {"layers": layers, "hidden": dim,
                             "heads": max(1, dim // head_dim), "head_dim": min(dim, head_dim),
                             "vocab": vocab,
                             "tied_embeddings": True},
            "groups": [{"name": "embeddings", "repeat": 1,
                        "tensors": [t("wte.weight", [vocab, dim], uses=2),
                                    t("wpe.weight", [seq, dim])]},
                       {"name": "blocks", "repeat": layers, "tensors": block},
                       {"name": "head", "repeat": 1,
                        "tensors": [t("ln_f.weight", [dim]), t("ln_f.bias", [dim])]}]}


def cluster_for(device_name: str) -> str | None:
    for key in ("H200", "H100"):
        if key in device_name.upper():
            return key.lower()
    return None


def predict(measured: dict, cluster_name: str) -> dict:
    """{system label: (predicted seconds, MFU)} for the measured run's GPT at world size 1:
    bf16 compute, fp32 reduction, no activation checkpointing (gpu_step_time.py's setup)."""
    from vescale_engine.plan.capacity import Setup
    from vescale_engine.plan.model_plan import load_shapes
    from vescale_engine.plan.step_time import load_cluster
    from vescale_engine.plan.step_time.report import Workload, predict as predict_one

    cluster = load_cluster(cluster_name)
    work = Workload(seq_len=measured["seq"], micro_batch=measured["batch"])
    out = {}
    with tempfile.TemporaryDirectory() as tmp:   # the shapes file is read while planning
        path = os.path.join(tmp, "gpt.json")
        with open(path, "w") as f:
            json.dump(gpt_shapes(measured["layers"], measured["dim"], measured["vocab"],
                                 measured["seq"]), f)
        model = load_shapes(path)
        for label, system in SYSTEMS.items():
            r = predict_one(system, model, Setup(world_size=1, reduce_dtype="fp32"), cluster,
                            work)
            out[label] = (r["step_s"], r["mfu"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", required=True, help="gpu_step_time.py's JSON")
    ap.add_argument("--cluster", help="cluster name or file (default: from the GPU's name)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.measured) as f:
        measured = json.load(f)
    on_gpu = measured["device"] == "cuda"
    name = args.cluster or cluster_for(measured["device_name"]) or ("h100" if not on_gpu
                                                                     else None)
    if name is None:
        raise SystemExit(f"step_time_check: no shipped cluster file for "
                         f"{measured['device_name']!r}: pass --cluster FILE.json")
    predicted = predict(measured, name)
    rows = [f"# `vescale plan --time` against a measured step ({measured['device_name']}, "
            f"world size 1)", "", f"`python benchmarks/step_time_check.py "
            f"{' '.join(sys.argv[1:])}`", "",
            f"GPT {measured['layers']} x {measured['dim']}, vocab {measured['vocab']}, batch "
            f"{measured['batch']} x {measured['seq']}; predicted on cluster {name}.", "",
            "| system | measured (s) | predicted (s) | predicted / measured | predicted MFU |",
            "|---|---:|---:|---:|---:|"]
    worst = 0.0
    for label, (seconds, mfu) in predicted.items():
        real = measured["step_s"][label]
        worst = max(worst, abs(seconds / real - 1))
        rows.append(f"| {label} | {real:.4g} | {seconds:.4g} | {seconds / real:.3f} | "
                    f"{100 * mfu:.1f}% |")
    if on_gpu:
        verdict = "within" if worst <= args.tolerance else "NOT within"
        rows += ["", f"{verdict} {100 * args.tolerance:.0f}% (worst {100 * worst:.1f}%)"]
    else:
        rows += ["", "CPU run: the prediction is for an H100, shown and not compared"]
    write_report(args.out, rows)
    if on_gpu and worst > args.tolerance:
        sys.exit(1)


if __name__ == "__main__":
    main()
