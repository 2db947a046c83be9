"""`vescale plan --memory`: the per-rank estimate equals the fake-process-group measurement of a
real training step within the tolerance and its traffic equals the bytes the step's collectives
move (the benchmark's own code, on tiny models), the JSON contract, and bad input as one-line
errors."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vescale_engine.plan import capacity, model_plan

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("capacity_check",
                                               ROOT / "benchmarks" / "capacity_check.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# Tiny versions of the benchmark's three structures (parameters ~1-2 MB per unit, so the few KB
# of activations the measurement includes stay far below the tolerance).
TINY = {
    "dense": dict(name="dense-tiny", vocab=2048, H=128, layers=4, Hq=128, Hkv=64, F=512),
    "moe": dict(name="moe-tiny", vocab=2048, H=64, layers=4, Hq=64, Hkv=32, F=64, experts=16,
                bias=True),
    "tied": dict(name="tied-tiny", vocab=4096, H=128, layers=4, Hq=128, Hkv=32, F=256,
                 tied=True),
}
# (model, system, world size, setup changes): every structure, both systems, every optimizer,
# and the mixed-precision, HSDP, accumulation and no-reshard paths.
CASES = [
    ("dense", "ours", 8, {}),
    ("dense", "fsdp2", 64, {"reshard_after_forward": False}),
    ("dense", "ours", 64, {"optimizer": "AdamW8bit", "hsdp": 2}),
    ("moe", "ours", 256, {"param_dtype": "bf16", "reduce_dtype": "fp32"}),
    ("moe", "fsdp2", 32, {"param_dtype": "bf16", "reduce_dtype": "fp32"}),
    ("tied", "ours", 16, {"optimizer": "Muon", "grad_accum": 2}),
    ("tied", "fsdp2", 8, {"grad_accum": 2}),
]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    paths = {}
    for kind, dims in TINY.items():
        paths[kind] = folder / f"{kind}.json"
        paths[kind].write_text(json.dumps(bench.model_shapes(**dims)))
    return paths


_MEASURED = {}


def measured(tiny_models, kind, system, world, changes):
    """The benchmark's measurement of one case (a fresh process), once per module."""
    key = (kind, system, world, json.dumps(changes, sort_keys=True))
    if key not in _MEASURED:
        case = {"model": kind, "path": str(tiny_models[kind]), "system": system,
                "world_size": world, "label": "test", **bench.DEFAULT_SETUP, **changes}
        _MEASURED[key] = (case, bench.run_case(case, timeout=300))
    return _MEASURED[key]


@pytest.mark.parametrize("kind,system,world,changes", CASES,
                         ids=[f"{k}-{s}-W{w}-" + "-".join(f"{a}={b}" for a, b in c.items())
                              for k, s, w, c in CASES])
def test_estimate_matches_fake_pg_measurement(tiny_models, kind, system, world, changes):
    case, found = measured(tiny_models, kind, system, world, changes)
    est = bench.estimate(case)
    row = bench.compare(found, est)
    assert abs(row["error"]) <= bench.TOLERANCE, (row, found["peak"])
    traffic = est["traffic"] if system == "ours" else est["traffic"][system]
    assert {k: traffic[k] for k in found["traffic"]} == found["traffic"]  # bytes, exactly
    assert row["traffic_exact"]
    mine = est["memory"][system]
    # The persistent parts are exact: the same shards and states the runtime allocated.
    assert mine["master"] == found["master"]
    assert mine["grad"] == found["grad"]
    if system == "fsdp2" or changes.get("optimizer", "AdamW") == "AdamW":
        assert mine["optimizer"] == found["optimizer"]
    else:  # AdamW8bit's quantizer and Muon's per-piece steps: within a few bytes per tensor
        assert mine["optimizer"] == pytest.approx(found["optimizer"], rel=0.02)


def test_comparison_tells_setups_apart(tiny_models):
    """The tolerance is tight enough to fail a wrong model of the runtime: the same measured
    step (units resharded after forward) against the estimate of keeping them gathered, or of
    FSDP2, is off by more than the tolerance."""
    case, found = measured(tiny_models, "dense", "ours", 8, {})
    kept = bench.estimate({**case, "world_size": 8, "reshard_after_forward": False})
    assert kept["memory"]["ours"]["total"] > (1 + bench.TOLERANCE) * found["peak"]
    fsdp2 = bench.estimate(case)["memory"]["fsdp2"]["total"]
    assert fsdp2 > (1 + bench.TOLERANCE) * found["peak"]


# --------------------------------------------------------------------------------------------
# The command line.

def vescale(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


SYSTEM_KEYS = {"master", "grad", "optimizer", "gathered_peak", "total"}


def test_memory_json_schema():
    out = vescale("plan", "--shapes", "examples/models/gpt-oss-120b.json", "--world-size",
                  "64,256", "--granularity", "rows:16", "--memory", "--optimizer",
                  "AdamW8bit", "--hsdp", "2", "--grad-accum", "4", "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert [r["world_size"] for r in results] == [64, 256]
    for r in results:
        assert set(r["memory"]) == {"ours", "fsdp2", "zero3"}
        for system, parts in r["memory"].items():
            assert SYSTEM_KEYS <= set(parts), system
            for key in SYSTEM_KEYS:
                assert isinstance(parts[key], int) and parts[key] >= 0, (system, key)
            assert parts["total"] >= parts["master"] + parts["grad"] + parts["optimizer"]
        assert {"all_gather", "reduce_scatter"} <= set(r["traffic"])
        assert all(isinstance(r["traffic"][k], int) for k in ("all_gather", "reduce_scatter"))
        setup = r["memory_setup"]
        assert (setup["shard_group_size"], setup["optimizer"], setup["grad_accum"]) == \
            (r["world_size"] // 2, "AdamW8bit", 4)
        assert setup["granularity"] == "block:256"   # AdamW8bit shards in its blocks
        assert setup["activations"] == "excluded"
        # the plan's own keys are still there
        assert "groups" in r and "padding_ratio" in r
    # Halving the shard per rank: the persistent parts shrink, the all-gathered bytes do not.
    small, large = results
    assert large["memory"]["ours"]["master"] < small["memory"]["ours"]["master"]
    assert large["traffic"]["all_gather"] > small["traffic"]["all_gather"]


def test_memory_traffic_counts_gathers_and_micro_steps():
    """ours: each rank receives (M-1) shards per gather; units gathered twice unless they are
    the root or the last unit; every micro-step repeats it."""
    model = model_plan.load_shapes(str(ROOT / "examples/models/llama3-70b.json"))
    one = capacity.estimate(model, capacity.Setup(64))["traffic"]
    four = capacity.estimate(model, capacity.Setup(64, grad_accum=4))["traffic"]
    assert four["all_gather"] == 4 * one["all_gather"]
    assert four["reduce_scatter"] == 4 * one["reduce_scatter"]
    numel = model.numel
    # bf16 everywhere, zero padding for this model at 64 ranks: the reduce-scatter sends
    # 63/64 of every gradient once, the all-gather receives it about twice.
    assert one["reduce_scatter"] == 63 * numel * 2 // 64
    assert 1.9 * one["reduce_scatter"] < one["all_gather"] < 2 * one["reduce_scatter"]
    kept = capacity.estimate(model, capacity.Setup(64, reshard_after_forward=False))["traffic"]
    assert kept["all_gather"] * 2 == pytest.approx(one["all_gather"], rel=0.06)


def test_memory_table_says_activations_are_excluded():
    out = vescale("plan", "--shapes", "examples/models/llama3-70b.json", "--world-size", "64",
                  "--memory", "--optimizer", "AdamW8bit", "--device-memory", "80")
    assert out.returncode == 0, out.stderr
    assert "activations excluded" in out.stdout
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in ("ours", "FSDP2", "ZeRO-3")}
    assert set(rows) == {"ours", "FSDP2", "ZeRO-3"}
    assert "fits in 80 GB" in out.stdout


@pytest.mark.parametrize("args,message", [
    (["--memory", "--optimizer", "Adam"], "unknown optimizer 'Adam'"),
    (["--memory", "--hsdp", "3"], "HSDP replicate size 3 does not divide the world size 64"),
    (["--memory", "--grad-accum", "0"], "--grad-accum must be a positive integer"),
    (["--memory", "--param-dtype", "fp8"], "unknown param dtype 'fp8'"),
    (["--memory", "--root", "lm_head"], "root group 'lm_head' is not a group"),
    (["--optimizer", "Muon"], "--optimizer needs --memory"),
])
def test_bad_input_is_one_line(args, message):
    out = vescale("plan", "--shapes", "examples/models/llama3-70b.json", "--world-size", "64",
                  *args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_bad_uses_in_a_shapes_file(tmp_path):
    data = bench.model_shapes(**TINY["tied"])
    data["groups"][0]["tensors"][0]["uses"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    out = vescale("plan", "--shapes", str(path), "--world-size", "8", "--memory")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "'uses' must be a positive integer" in out.stderr


def test_optimizer_facts_match_the_optimizers():
    """capacity/ reads the optimizers' defaults from optim_spec without importing torch;
    the optimizers use the same values."""
    from vescale_engine.plan import optim_spec
    from vescale_engine.optim import adamw8bit, muon, quantize
    assert adamw8bit.DEFAULT_BLOCK == optim_spec.ADAMW8BIT_BLOCK
    assert quantize.CHUNK_ELEMENTS == optim_spec.QUANT_CHUNK_ELEMENTS
    assert muon.ROUNDS_IN_FLIGHT == optim_spec.MUON_ROUNDS_IN_FLIGHT
    assert muon.is_muon_matrix is optim_spec.is_muon_matrix
    assert set(optim_spec.OPTIMIZERS) <= set(__import__("vescale_engine.optim").optim.OURS)
    assert math.isclose(capacity.MASTER_BYTES, 4)
    assert os.path.exists(ROOT / "docs" / "capacity_planning.md")


def test_capacity_guide_shows_the_commands_real_output():
    """docs/capacity_planning.md's answer is what its command prints today."""
    import re
    import shlex
    text = (ROOT / "docs" / "capacity_planning.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    command = next(b for b in blocks if b.startswith("vescale plan"))
    shown = next(b for b in blocks if b.startswith("memory per rank"))
    out = vescale(*shlex.split(command)[1:])
    assert out.returncode == 0, out.stderr
    assert shown.strip() in out.stdout
