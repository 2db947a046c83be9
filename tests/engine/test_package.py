"""The package imports light (no torch for `vescale plan`) and exposes the documented public
names (docs/architecture.md); the repository stands on its own (a LICENSE, no pointers to notes
outside it)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/<tier>/ is two folders down


def _prints_ok(code: str) -> None:
    """`code` in a fresh interpreter (nothing imported before it) runs to its print('ok')."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_import_is_light_and_names_resolve():
    code = ("import sys, vescale_engine as v; assert 'torch' not in sys.modules; "
            "import launcher.cli; assert 'torch' not in sys.modules; "
            "assert callable(v.fully_shard) and callable(v.clip_grad_norm_); "
            "assert v.optim.AdamW and v.MixedPrecisionPolicy and v.RaggedShard; print('ok')")
    _prints_ok(code)


def test_importing_defines_names_only():
    """No log handler, no exit hook, no patch of torch: importing the package (and a lazy
    name of it) sets nothing up in the process; initialize, fully_shard, materialize and the
    launcher do (logs.install, launch/settle.py's settle_at_exit)."""
    code = ("import atexit, logging, sys\n"
            "hooks = atexit._ncallbacks()\n"
            "import vescale_engine as v\n"
            "assert atexit._ncallbacks() == hooks, 'an exit hook'\n"
            "v.initialize, v.materialize, v.optim  # (torch's own imports register hooks)\n"
            "from vescale_engine.launch import settle\n"
            "assert settle._REGISTERED == [], 'the settle at exit'\n"
            "assert logging.getLogger('vescale_engine').handlers == [], 'a log handler'\n"
            "from vescale_engine.logs import install\n"
            "install()\n"
            "assert len(logging.getLogger('vescale_engine').handlers) == 1\n"
            "print('ok')")
    _prints_ok(code)


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
            "from vescale_engine.engine import initialize, VeScaleEngine\n"
            "from vescale_engine.integrations import patch_deepspeed, unpatch\n"
            "from vescale_engine.checkpoint import consolidate, save_checkpoint, load_checkpoint\n"
            "assert initialize is v.initialize and patch_deepspeed is v.patch_deepspeed\n"
            "assert unpatch is v.unpatch\n"
            "assert v.load_hf_checkpoint and v.save_hf_checkpoint and v.MixedPrecisionPolicy\n"
            "assert v.optim.AdamW8bit and v.optim.Muon and v.clip_grad_norm_ and v.add_config_arguments\n"
            "print('ok')")
    _prints_ok(code)


# Notes that lived beside the repository while it was written; users do not have them, so no
# tracked file may point at them (the patterns are split so this file does not match itself).
OUTSIDE_NOTES = ["PAPER" + ".md", "DESIGN" + ".md", "GPU" + "_REVIEW", "ARCHITECTURE" + "_NOTES",
                 "TP_EP" + "_DESIGN", "shared" + "/models", "/work" + "/shared"]


def _tracked_files(root):
    """Tracked and new not-ignored files (git ls-files), or, outside a git checkout, the tree
    without .git and virtual environments."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout:
        return [root / name for name in out.stdout.split("\0") if name]
    skip = {".git", ".venv", "venv", "__pycache__", "node_modules"}
    return [p for p in root.rglob("*") if p.is_file() and not skip & set(p.relative_to(root).parts)]


def test_no_file_points_outside_the_repository():
    root = ROOT
    hits = []
    for path in _tracked_files(root):
        if path.suffix not in (".md", ".py", ".sh", ".json", ".txt") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            hits += [f"{path.relative_to(root)}:{number}: {note}" for note in OUTSIDE_NOTES
                     if note in line]
    assert not hits, "\n".join(hits)


def test_license_is_apache_2():
    license_file = ROOT / "LICENSE"
    assert license_file.is_file()
    text = license_file.read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    setup = (ROOT / "setup.py").read_text()
    assert 'license="Apache-2.0"' in setup
