"""The package imports light (no torch for `vescale plan`) and exposes DESIGN.md's names."""
import subprocess
import sys


def test_import_is_light_and_names_resolve():
    code = ("import sys, vescale_engine as v; assert 'torch' not in sys.modules; "
            "import launcher.cli; assert 'torch' not in sys.modules; "
            "assert callable(v.fully_shard) and callable(v.clip_grad_norm_); "
            "assert v.optim.AdamW and v.MixedPrecisionPolicy and v.RaggedShard; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_console_script_version():
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "--version"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("vescale ")


def test_public_paths_survive_the_subpackages():
    """The names users import keep working from where docs name them (issue 22 moved the
    modules into subpackages; these paths are the documented ones)."""
    code = ("import vescale_engine as v, vescale_engine.fsdp as f, vescale_engine.materialize as m\n"
            "assert all(callable(getattr(f, n)) for n in ('full_state_dict', 'sharded_parameters',"
            " 'gathered_parameters', 'fully_shard', 'sharded_state_dict', 'no_sync'))\n"
            "assert callable(m) and m.allocate_shards is v.allocate_shards and m.init_unloaded\n"
            "from vescale_engine.engine import initialize, VeScaleEngine, patch_deepspeed\n"
            "from vescale_engine.checkpoint import consolidate, save_checkpoint, load_checkpoint\n"
            "assert initialize is v.initialize and patch_deepspeed is v.patch_deepspeed\n"
            "assert v.load_hf_checkpoint and v.save_hf_checkpoint and v.MixedPrecisionPolicy\n"
            "assert v.optim.AdamW8bit and v.optim.Muon and v.clip_grad_norm_ and v.add_config_arguments\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
