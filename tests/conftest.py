import importlib.util
import json
import os
import sys
import time

# Make `dist_harness` importable by the test modules and by the spawned ranks.
sys.path.insert(0, os.path.dirname(__file__))

# The suite trains CPU models on gloo, also on a GPU machine (where the engine would pick
# NCCL): the engine, `vescale run` and every rank or script started from a test (they inherit
# this environment) use gloo unless the caller says otherwise.
os.environ.setdefault("VESCALE_BACKEND", "gloo")


# -- what the suite says while it runs ----------------------------------------------------------
# pytest -q prints only dots: a line per test file (which, how far, how long so far), DeepSpeed's
# CPU Adam built once up front with its own time budget, and each file's duration at the end
# (also written as JSON to $VESCALE_TEST_DURATIONS when set).

# DeepSpeed JIT-builds its CPU Adam (C++) the first time it runs an offloaded optimizer on a
# machine: minutes, which would otherwise count against the first such test's own timeout.
CPU_ADAM_FILES = {"test_hf_trainer.py", "test_gpu_check.py", "test_offload_benchmark.py",
                  "test_deepspeed_parity.py"}
_SUITE = {"files": {}, "order": [], "started": time.monotonic()}


def _reporter(config):
    return config.pluginmanager.get_plugin("terminalreporter")


def pytest_collection_finish(session):
    files = sorted({item.path.name for item in session.items})
    _SUITE["total"] = len(files)
    reporter = _reporter(session.config)
    if reporter is None or not CPU_ADAM_FILES & set(files) or \
            session.config.getoption("collectonly"):
        return
    if importlib.util.find_spec("deepspeed") is None:
        return
    from dist_harness import build_cpu_adam
    build_cpu_adam(lambda line: (reporter.ensure_newline(), reporter.write_line(line)))


def pytest_runtest_logstart(nodeid, location):
    path = nodeid.split("::", 1)[0]
    if path in _SUITE["files"]:
        return
    _SUITE["files"][path] = 0.0
    _SUITE["order"].append(path)
    reporter = _reporter(_config)
    if reporter is not None:
        minutes = (time.monotonic() - _SUITE["started"]) / 60
        if reporter._tw.width_of_current_line:  # after -q's dots
            reporter.write("\n")
        reporter.write_line(f"[{len(_SUITE['order'])}/{_SUITE.get('total', '?')} files, "
                            f"{minutes:.1f} min] {path}")


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _SUITE["files"][path] = _SUITE["files"].get(path, 0.0) + report.duration


def pytest_configure(config):
    global _config
    _config = config


def pytest_terminal_summary(terminalreporter):
    files = _SUITE["files"]
    if not files:
        return
    slowest = sorted(files.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("-", f"time per test file (setup + tests + teardown), "
                                    f"{sum(files.values()) / 60:.1f} min in all, slowest first")
    for path, seconds in slowest[:15]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    if len(slowest) > 15:
        terminalreporter.write_line(f"  ... {len(slowest) - 15} more files")
    out = os.environ.get("VESCALE_TEST_DURATIONS")
    if out:
        with open(out, "w") as f:
            json.dump({path: round(seconds, 2) for path, seconds in slowest}, f, indent=1)
