"""`vescale plan --time` on the command line: the table, the sweep and --scan's strong
scaling, --json's `time` key (the same numbers the library gives), the scaling plot, and bad
input as one line before any planning."""
import json
import os
import subprocess
import sys

import pytest

from vescale_engine.plan.capacity import Setup
from vescale_engine.plan.model_plan import load_shapes
from vescale_engine.plan.step_time import load_cluster
from vescale_engine.plan.step_time.report import Workload, predict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_8B = os.path.join("examples", "models", "llama-3.1-8b.json")


def vescale(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_table_names_every_system_and_what_moves_ours():
    out = vescale("plan", "--shapes", LLAMA_8B, "--world-size", "128", "--time", "--seq",
                  "8192", "--micro-batch", "2", "--checkpointing", "selective",
                  "--reduce-dtype", "fp32")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "step time: llama-3.1-8b on h100" in text and "2 x 8,192 tokens per rank" in text
    for label in ("ours", "FSDP2", "ZeRO-3"):
        assert any(line.startswith(label) for line in text.splitlines()), label
    assert "what moves ours most:" in text and "left out: stragglers" in text


def test_json_time_equals_the_library_and_memory_still_comes():
    out = vescale("plan", "--shapes", LLAMA_8B, "--world-size", "64", "--time", "--memory",
                  "--seq", "4096", "--cluster", "h200", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {"memory", "traffic", "time"} <= set(result)
    time = result["time"]
    assert time["cluster"] == "h200" and time["workload"]["seq_len"] == 4096
    expected = predict("ours", load_shapes(os.path.join(ROOT, LLAMA_8B)), Setup(world_size=64),
                       load_cluster("h200"), Workload(4096, 1))
    assert time["ours"] == expected   # JSON keeps a float exactly
    assert time["strong"] is None and len(time["settings"]) > 0


def test_scan_prints_weak_and_strong_scaling_and_plots(tmp_path):
    png = tmp_path / "scan.png"
    out = vescale("plan", "--shapes", os.path.join("examples", "models", "gpt-oss-120b.json"),
                  "--world-size", "8,64,512,8192", "--time", "--scan", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "weak scaling" in text and "strong scaling" in text
    strong = text[text.index("strong scaling"):].splitlines()
    rows = [line.split() for line in strong if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [8, 64, 512, 8192]
    assert [int(r[1]) for r in rows] == [1024, 128, 16, 1]   # micro-steps: one global batch
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--world-size", "8", "--cluster", "h100"], "--cluster needs --time"),
    (["--world-size", "8", "--time", "--scan"], "--scan needs a --world-size list"),
    (["--world-size", "8", "--time", "--cluster", "a100"], "unknown cluster"),
    (["--world-size", "8", "--time", "--cluster", "missing.json"], "missing.json"),
    (["--world-size", "64", "--time", "--tp", "8"], "TP/EP"),
    (["--world-size", "12", "--time"], "whole nodes"),
    (["--world-size", "8", "--time", "--seq", "0"], "--seq must be a positive integer"),
    (["--world-size", "8", "--time", "--sp", "2"], "--sp needs --memory"),
    (["--world-size", "8", "--time", "--checkpointing", "full",
      "--activation-checkpointing"], None),
])
def test_bad_input_is_one_line(args, message):
    out = vescale("plan", "--shapes", LLAMA_8B, *args)
    if message is None:   # full and --activation-checkpointing agree
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode == 2, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert out.stdout == ""


def test_a_shapes_file_without_architecture_is_one_line(tmp_path):
    data = json.load(open(os.path.join(ROOT, LLAMA_8B)))
    data.pop("architecture")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    out = vescale("plan", "--shapes", str(path), "--world-size", "8", "--time")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "architecture" in out.stderr


def test_the_command_scans_the_largest_model_to_8192_ranks_in_seconds():
    """Kimi K2 (1T parameters, 384 experts: the slowest shipped file to plan), 8 to 8,192
    ranks, weak and strong, three systems, through the command: seconds (7 s on a 2-core EPYC;
    a generous 90 s bound for a loaded machine)."""
    import time
    started = time.monotonic()
    out = vescale("plan", "--shapes", os.path.join("examples", "models", "kimi-k2.json"),
                  "--world-size", ",".join(str(2 ** k) for k in range(3, 14)), "--time",
                  "--scan")
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert "strong scaling" in out.stdout and took < 90, took


def test_a_granularity_sweep_labels_its_rows():
    out = vescale("plan", "--shapes", LLAMA_8B, "--world-size", "64,128", "--granularity",
                  "rows:1,rows:128", "--time")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout[out.stdout.index("weak scaling"):].splitlines()
            if line.startswith("rows:")]
    assert [(r[0], r[1]) for r in rows] == [("rows:1", "64"), ("rows:1", "128"),
                                            ("rows:128", "64"), ("rows:128", "128")]


def test_an_unset_reduce_dtype_says_what_the_installed_torch_does():
    """Without --reduce-dtype the plans reduce in the compute dtype, as FSDP2 up to torch 2.14;
    from 2.15, FSDP2 and ours reduce in fp32 then: a note says so, only there."""
    from importlib import metadata

    from vescale_engine.versions import _release
    newer = _release(metadata.version("torch")) >= (2, 15)
    plain = vescale("plan", "--shapes", LLAMA_8B, "--world-size", "64", "--memory")
    assert plain.returncode == 0, plain.stderr
    assert ("pass --reduce-dtype fp32 to plan that" in plain.stderr) == newer, plain.stderr
    given = vescale("plan", "--shapes", LLAMA_8B, "--world-size", "64", "--memory",
                    "--reduce-dtype", "bf16")
    assert given.returncode == 0 and "--reduce-dtype" not in given.stderr, given.stderr
