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
