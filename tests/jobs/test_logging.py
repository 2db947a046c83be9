"""What a script prints without any logging setup (as DeepSpeed's logger prints on its own): the
progress line at steps_per_print and one line per checkpoint save and load, on rank 0, and not
DeepSpeed's start-up warnings that mean nothing for this engine; VESCALE_LOG_LEVEL and the
logger's level silence ours. Each run is a fresh 2-rank job (`vescale run`), as a user's."""
import os
import subprocess
import sys
import textwrap

import pytest

# the repository: tests/<tier>/ is two folders down
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import vescale_engine
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupDecayLR",
                            "params": {"warmup_num_steps": 2, "total_num_steps": 4}},
              "vescale": {}}
    engine, *_ = vescale_engine.initialize(model=model, config=config)
    print(engine.load_checkpoint(sys.argv[1]))      # nothing there yet
    for _ in range(4):
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(sys.argv[1])
    engine.load_checkpoint(sys.argv[1])
    engine.destroy()
""")


@pytest.fixture
def job(tmp_path):
    def _job(**extra):
        script = tmp_path / "job.py"
        script.write_text(SCRIPT)
        env = {k: v for k, v in os.environ.items()
               if k not in ("DS_ACCELERATOR", "VESCALE_LOG_LEVEL")}
        env.update(OMP_NUM_THREADS="1", **extra)
        ckpt = tmp_path / f"ckpt{len(extra)}"
        done = subprocess.run([sys.executable, "-m", "launcher.cli", "run", "--nproc", "2",
                               str(script), str(ckpt)], capture_output=True, text=True,
                              timeout=300, env=env,
                              cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr
    return _job


def test_progress_and_checkpoint_lines_print_without_logging_setup(job):
    out = job()
    lines = out.splitlines()
    steps = [line for line in lines if "[vescale] step " in line]
    assert [line.split(" | ")[0] for line in steps] == ["[rank0] [vescale] step 2",
                                                        "[rank0] [vescale] step 4"], out
    saves = [line for line in lines if "[vescale] save_checkpoint: " in line]
    loads = [line for line in lines if "[vescale] load_checkpoint: " in line]
    assert len(saves) == 1 and saves[0].startswith("[rank0] ") and "(step 4, " in saves[0], out
    assert len(loads) == 1 and loads[0].startswith("[rank0] ") and "(step 4)" in loads[0], out
    # the first load: DeepSpeed's warning and (None, None), on both ranks
    assert sum("latest not found, nothing to load" in line for line in lines) == 2, out
    assert "[rank0] (None, None)" in lines and "[rank1] (None, None)" in lines, out
    # DeepSpeed's start-up noise, from the engine's own start, is gone
    assert "Setting accelerator to CPU" not in out, out
    assert "before it has started" not in out, out


def test_the_log_level_silences_the_engine_lines(job):
    out = job(VESCALE_LOG_LEVEL="warning")
    assert "[vescale] step " not in out and "[vescale] save_checkpoint" not in out, out
    assert "latest not found, nothing to load" in out  # a warning still shows
