"""benchmarks/offload.py at its smoke size (a tiny Llama, one round, tiny kernel shard), so the
script cannot rot: both engines step with optimizer offload on 2 gloo ranks, the bytes our
offload copies equal `vescale plan --memory --offload-optimizer`'s estimate (the script fails
otherwise), the losses of the two engines agree, and the kernels-alone table is written."""
import os
import re
import sys
from pathlib import Path

from dist_harness import run_job

ROOT = Path(__file__).resolve().parents[2]  # tests/<tier>/ is two folders down


def test_offload_benchmark_smoke_run(tmp_path):
    out = tmp_path / "offload.md"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = run_job([sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--smoke",
                    "--out", str(out)], timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = out.read_text()
    assert "**Smoke run**" in report
    for label in ("| veScale Engine, offload_optimizer |",
                  "| DeepSpeed ZeRO-3, offload_optimizer (DeepSpeedCPUAdam) |"):
        row = next(line for line in report.splitlines() if line.startswith(label))
        times = [float(x) for x in row.split("|")[2:6]]
        assert all(t > 0 for t in times), row  # every column timed something
        kernel, optimizer_step, engine_step, whole = times
        assert kernel <= optimizer_step <= engine_step <= whole, row
    assert re.search(r"estimate .*: [0-9.]+ / [0-9.]+ MB: equal\.", report), report
    gap = float(re.search(r"largest relative difference ([0-9.e+-]+)\.", report).group(1))
    assert gap <= 1e-5, report  # same model, data and fp32 AdamW on both engines
    assert re.search(r"^\| 4,096 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9]+ \|$", report, re.M)
