"""The README's main job: examples/train_gpt.py trains under `vescale run` and torchrun, and
its loss falls; the bf16 config (the one for GPUs) trains too. The example as a template:
--steps sets the lr schedule's length (a config that fixes another length is refused), the CSV
has a row per step with the held-out loss at the evaluation steps, and --save-dir / --resume
continue a run exactly where it stopped."""
import csv
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
from dist_harness import free_port, run_job

ARGS = ["examples/train_gpt.py", "--steps", "12", "--layers", "2", "--dim", "64", "--seq", "64"]


def losses(output, steps=12):
    match = re.search(rf"trained {steps} steps on 2 rank\(s\) in [\d.]+ s: loss ([\d.]+) -> "
                      r"([\d.]+)", output)
    assert match, output[-3000:]
    return float(match.group(1)), float(match.group(2))


@pytest.mark.parametrize("launcher", ["vescale", "torchrun"])
def test_example_trains_and_loss_falls(launcher, tmp_path):
    if launcher == "vescale":
        cmd = [sys.executable, "-m", "launcher.cli", "run", "--nproc", "2",
               "--threads-per-rank", "1", *ARGS]
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(port), *ARGS]
    cmd += ["--log-csv", str(tmp_path / "metrics.csv")]  # not into the repository
    out = run_job(cmd, timeout=300,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    first, last = losses(out.stdout)
    assert last < first - 0.5


def test_example_trains_with_the_bf16_config(tmp_path):
    """A few steps of bf16 (bf16 parameters and gradient reduction, fp32 master) on CPU ranks."""
    args = ["examples/train_gpt.py", "--config", "examples/configs/vescale_bf16.json",
            "--steps", "4", "--layers", "1", "--dim", "32", "--seq", "32",
            "--log-csv", str(tmp_path / "metrics.csv")]
    out = run_job([sys.executable, "-m", "launcher.cli", "run", "--nproc", "2",
                   "--threads-per-rank", "1", *args],
                  timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    first, last = losses(out.stdout, steps=4)
    assert last < first


# --- the example as a template: schedule length, evaluation, CSV, checkpoints ----------------

ROOT = Path(__file__).resolve().parents[2]  # tests/<tier>/ is two folders down
SMALL = ["--layers", "1", "--dim", "32", "--seq", "32"]


def run_example(args, cwd):
    """examples/train_gpt.py under `vescale run` on 2 ranks, started in `cwd` (its default
    output lands there, not in the repository); the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return run_job([sys.executable, "-m", "launcher.cli", "run", "--nproc", "2",
                    "--threads-per-rank", "1", str(ROOT / "examples" / "train_gpt.py"), *args],
                   timeout=300, env=env, cwd=cwd)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def warmup_cosine_lr(step, total, warmup, lr, floor=1e-4):
    """The lr optimizer step `step` (from 1) trains with under DeepSpeed's WarmupCosineLR (log
    warmup, cos_min_ratio 1e-4): the scheduler has stepped step - 1 times, the first time from
    iteration -1 (lr 0); DeepSpeed warms up over at least 2 iterations."""
    iteration, warmup = step - 2, max(2, warmup)
    if iteration < 0:
        return 0.0
    if iteration < warmup:
        return lr * math.log(iteration + 1) / math.log(warmup)
    progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
    return lr * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)


def test_steps_sets_the_schedule_and_the_csv_has_a_row_per_step(tmp_path):
    """--steps 20 with the default config: 20 steps, the lr of every step (the last one too)
    is WarmupCosineLR's over total_num_steps 20 (warmup 2), the held-out loss is in the rows of
    the evaluation steps only; the CSV and the plot land in the working directory by default."""
    steps = 20
    out = run_example(["--steps", str(steps), *SMALL, "--eval-every", "5",
                       "--eval-batches", "2"], tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    first, last = losses(out.stdout, steps=steps)
    assert last < first
    rows = read_csv(tmp_path / "train_gpt_metrics.csv")
    assert rows[0] == ["step", "loss", "eval_loss", "lr", "tokens_per_s"]
    assert [int(r[0]) for r in rows[1:]] == list(range(1, steps + 1))
    config = json.loads((ROOT / "examples/configs/vescale_default.json").read_text())
    peak = config["optimizer"]["params"]["lr"]
    for step, loss, eval_loss, lr, rate in rows[1:]:
        assert float(lr) == pytest.approx(warmup_cosine_lr(int(step), steps, 2, peak),
                                          rel=1e-6, abs=1e-12), step
        assert 0 < float(loss) < 10 and float(rate) > 0
        assert bool(eval_loss) == (int(step) % 5 == 0), step
        assert not eval_loss or 0 < float(eval_loss) < 10
    assert float(rows[-1][3]) < peak / 100  # the decay ends with the run, not 280 steps later
    assert "lr schedule: WarmupCosineLR over 20 steps, 2 of warmup" in out.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped: matplotlib is not importable" in out.stdout
    else:
        assert (tmp_path / "train_gpt_metrics.png").stat().st_size > 0


def test_a_fixed_schedule_length_other_than_steps_is_refused(tmp_path):
    config = json.loads((ROOT / "examples/configs/vescale_default.json").read_text())
    config["scheduler"]["params"]["total_num_steps"] = 50
    (tmp_path / "fixed.json").write_text(json.dumps(config))
    out = run_example(["--config", "fixed.json", "--steps", "12", *SMALL], tmp_path)
    assert out.returncode != 0
    assert ("fixed.json: scheduler.params.total_num_steps is 50 but --steps is 12: set it to "
            '"auto" (then it follows --steps) or pass --steps 50') in out.stdout + out.stderr
    assert "trained" not in out.stdout and not (tmp_path / "train_gpt_metrics.csv").exists()


def test_resume_continues_the_run_exactly(tmp_path):
    """6 steps saving at 3 and 6 (`--resume` of an empty --save-dir starts from step 0); then
    from the step-3 checkpoint to 6 again, in the same directory: steps 4-6 have the same
    losses, held-out losses and lr as the uninterrupted run (same weights, optimizer state,
    schedule and data order), and the CSV keeps steps 1-3 and ends with the new 4-6."""
    common = ["--steps", "6", *SMALL, "--eval-every", "3", "--eval-batches", "2",
              "--save-dir", "run"]
    first = run_example([*common, "--save-every", "3", "--resume"], tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert "no checkpoint in run: starting from step 0" in first.stdout
    uninterrupted = read_csv(tmp_path / "run" / "metrics.csv")
    assert len(uninterrupted) == 7
    assert sorted(os.listdir(tmp_path / "run")) == ["global_step3", "global_step6", "latest",
                                                    "latest.crc32", "metrics.csv",
                                                    "metrics.png"]
    again = run_example([*common, "--resume", "run/global_step3"], tmp_path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resumed from run/global_step3 at step 3" in again.stdout
    assert re.search(r"trained 3 steps \(steps 4-6\) on 2 rank\(s\)", again.stdout), again.stdout
    resumed = read_csv(tmp_path / "run" / "metrics.csv")
    # step, loss, eval_loss, lr as written (9 significant digits: float32 exactly); not the rate
    assert [r[:4] for r in resumed] == [r[:4] for r in uninterrupted]
