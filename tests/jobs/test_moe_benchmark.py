"""Smoke runs that keep benchmark scripts from rotting. benchmarks/moe_ep.py at its smoke size
(2 tiny MoE blocks, 4 gloo ranks, one round): both systems train with the experts Shard(0)
over ep 2 and sharded over efsdp 2, the script's own loss and gradient-norm checks pass (it
exits non-zero otherwise), and the report counts every kind of traffic the recipe must
produce, the same all-to-all and reduce-scatter bytes for both (same routing, same
gradients). benchmarks/shampoo.py at its smoke size."""
import os
import re
import sys
from pathlib import Path

from dist_harness import run_job

ROOT = Path(__file__).resolve().parents[2]  # tests/<tier>/ is two folders down


def test_moe_ep_benchmark_smoke_run(tmp_path):
    out = tmp_path / "moe_ep.md"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = run_job([sys.executable, str(ROOT / "benchmarks" / "moe_ep.py"), "--smoke",
                    "--out", str(out)], timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = out.read_text()
    assert "**Smoke run**" in report
    rows = {}
    for label in ("vescale_engine fully_shard", "FSDP2+EP"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {label}"))
        cells = row.split("|")[2:-1]
        step, gathered, scattered, exchanged, reduced, other = (
            float(cells[0]), *map(float, cells[2:7]))
        assert step > 0, row
        assert gathered > 0 and scattered > 0 and exchanged > 0, row  # FSDP + EP dispatch
        assert reduced == 0 and other == 0, row  # no HSDP, nothing uncounted
        rows[label] = (scattered, exchanged)
    assert rows["vescale_engine fully_shard"] == rows["FSDP2+EP"], rows
    gap = float(re.search(r"agree to ([0-9.e+-]+) relative \(bound", report).group(1))
    assert gap <= 1e-5, report
    norms = float(re.search(r"Gradient norms .* agree to ([0-9.e+-]+) relative", report).group(1))
    assert norms <= 1e-5, report  # a wrong expert divisor shows here, not in AdamW's losses


def test_shampoo_benchmark_smoke_run(tmp_path):
    """benchmarks/shampoo.py at its smoke size (2 ranks, 20 steps): both optimizers train from
    the example's config, the same collectives per step, Shampoo's step adding none."""
    out = tmp_path / "shampoo.md"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = run_job([sys.executable, str(ROOT / "benchmarks" / "shampoo.py"), "--smoke",
                    "--out", str(out)], timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = out.read_text()
    rows = {}
    for name in ("AdamW", "Shampoo"):
        cells = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in cells.split("|")[2:-1]]
        assert float(cells[0]) > 0 and 0 < float(cells[-1]) < 5, cells  # step time, loss
        rows[name] = cells[3]  # collectives per step
    assert rows["AdamW"] == rows["Shampoo"], rows
    assert (tmp_path / "shampoo.png").exists()
