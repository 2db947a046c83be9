"""`vescale run`: ranks get torchrun's environment, output is prefixed, a failing rank stops
the job with its status."""
import subprocess
import sys


def run(tmp_path, body, *args):
    script = tmp_path / "job.py"
    script.write_text(body)
    return subprocess.run([sys.executable, "-m", "launcher.cli", "run", *args, str(script)],
                          capture_output=True, text=True, timeout=120)


def test_ranks_get_environment_and_prefixes(tmp_path):
    out = run(tmp_path, "import os\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'], "
                        "os.environ['LOCAL_RANK'], os.environ['OMP_NUM_THREADS'])\n",
              "--nproc", "3", "--threads-per-rank", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0] 0 3 0 1", "[rank1] 1 3 1 1",
                                               "[rank2] 2 3 2 1"]


def test_one_rank_failing_stops_the_others(tmp_path):
    body = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1': sys.exit(7)\n"
            "time.sleep(60)\n")
    out = run(tmp_path, body, "--nproc", "3")
    assert out.returncode == 7
    assert "rank 1 exited with status 7; stopping the other ranks" in out.stdout


def test_training_with_the_engine_under_vescale_run(tmp_path):
    body = ("import sys; sys.path.insert(0, 'tests'); import torch, fsdp_models as fm\n"
            "import vescale_engine\n"
            "engine, *_ = vescale_engine.initialize(model=fm.make('gpt'), config={\n"
            "    'train_micro_batch_size_per_gpu': 2, 'vescale': {'wrap_policy': "
            "{'module_classes': ['Block']}}})\n"
            "for step in range(2):\n"
            "    idx, tgt = fm.batch('gpt', step, 2)\n"
            "    loss = engine(idx, tgt); engine.backward(loss); engine.step()\n"
            "print('done', engine.global_steps, engine.world_size)\n")
    out = run(tmp_path, body, "--nproc", "2", "--threads-per-rank", "1")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "[rank0] done 2 2" in out.stdout and "[rank1] done 2 2" in out.stdout
