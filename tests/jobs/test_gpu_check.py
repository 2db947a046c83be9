"""The GPU check's CPU dry run: `DEVICE=cpu bash benchmarks/gpu_check.sh` runs every part of
the script the first GPU will run (main job fp32 and bf16, gpu_validate's checks, the fake
process group memory comparison, the step-time comparison with FSDP2 and its prediction by
`vescale plan --time`, the offload comparison,
the MoE memory, checkpoint stall and compile comparisons, quantized communication on one rank
and as rank 0 of a fake process group, the FP8 matmuls) on gloo, small sizes."""
import json
import os
import subprocess
import sys

# the repository: tests/<tier>/ is two folders down
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, DEVICE="cpu", OUT=str(tmp_path), PYTHON=sys.executable,
               OMP_NUM_THREADS="1", STEPS="3")
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=900)
    log = (tmp_path / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-6000:]
    import platform
    import torch
    assert f"python {platform.python_version()} | torch {torch.__version__} |" in log, log[:2000]
    for part in ("main_job_vescale_default", "main_job_vescale_bf16", "validate",
                 "fake_pg_memory", "step_time", "step_time_model", "offload", "moe_ep_memory", "checkpoint_io",
                 "compile_step", "quantized_comm", "quantized_comm_fake", "fp8_matmul"):
        assert f"{part}: 0" in log, part
    assert log.count("trained 3 steps on 1 rank(s)") == 2
    report = json.loads((tmp_path / "gpu_validate.json").read_text())
    statuses = {row["check"]: row["status"] for row in report["checks"]}
    assert statuses.pop("host_syncs") == "n/a"  # CUDA only
    assert set(statuses) == {"placement", "parity_fp32", "bf16_accumulation", "fp16_overflow",
                             "memory", "collectives", "checkpoints", "stage0", "big_models"}
    assert set(statuses.values()) == {"PASS"}, statuses
    checks = {row["check"]: row for row in report["checks"]}
    assert "Shampoo" in json.dumps(checks["checkpoints"]), checks["checkpoints"]
    table = (tmp_path / "gpu_step_time_cpu.md").read_text()
    assert "| veScale |" in table and "| FSDP2 |" in table
    model = (tmp_path / "step_time_model_cpu.md").read_text()   # plan --time on this GPT
    assert "| veScale |" in model and "shown and not compared" in model
    assert (tmp_path / "fake_pg_memory_cpu.md").exists()
    offload = json.loads((tmp_path / "gpu_offload_cpu.json").read_text())
    systems = offload["models"]["smoke"]["systems"]
    for name in ("vescale", "deepspeed", "deepspeed_param", "fsdp2"):
        assert systems[name]["step_s"] > 0 and systems[name]["peak_bytes"] > 0, name
    param = systems["vescale_param"]  # run, or skipped with the engine's one-line refusal
    assert param.get("step_s", 0) > 0 or "offload_param" in param["skipped"], param
    assert "| FSDP2, CPUOffloadPolicy |" in (tmp_path / "gpu_offload_cpu.md").read_text()
    assert "| vescale (background) |" in (tmp_path / "checkpoint_io_cpu.md").read_text()
    assert "| veScale Engine, engine.compile() |" in (tmp_path / "compile_step_cpu.md").read_text()
    assert "| zero_quantized_weights, fp8_e4m3, tile:128x128 |" in \
        (tmp_path / "quantized_comm_cpu.md").read_text()
    assert "as rank 0 of 64" in (tmp_path / "quantized_comm_fake_cpu.md").read_text()
    assert "| tile_matmul (row-scaled per 128 of K) |" in \
        (tmp_path / "fp8_matmul_cpu.md").read_text()
