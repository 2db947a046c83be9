import glob
import importlib.util
import json
import os
import sys
import time

import pytest

# The helpers (dist_harness, fsdp_models, fsdp2_idioms) live here, the test files in folders
# below (docs/testing.md). This folder and every folder holding test files go on sys.path, so
# that a test module imports the helpers and another test module by its name (basenames are
# unique: tests/engine/test_tiers.py checks it), and so do the ranks of a pool, which get this
# sys.path as PYTHONPATH and import a test's function by its module's name.
TESTS = os.path.dirname(os.path.abspath(__file__))
TEST_DIRS = sorted({os.path.dirname(path) for path in
                    glob.glob(os.path.join(TESTS, "*", "**", "test_*.py"), recursive=True)})
sys.path[:0] = [path for path in [TESTS, *TEST_DIRS] if path not in sys.path]

# The suite trains CPU models on gloo, also on a GPU machine (where the engine would pick
# NCCL): the engine, `vescale run` and every rank or script started from a test (they inherit
# this environment) use gloo unless the caller says otherwise.
os.environ.setdefault("VESCALE_BACKEND", "gloo")


# -- what the suite says while it runs ----------------------------------------------------------
# pytest -q prints only dots: a line per test file (which, how far, how long so far), DeepSpeed's
# CPU Adam built once up front with its own time budget, and each file's duration at the end
# (also written as JSON to $VESCALE_TEST_DURATIONS when set, and then every file's is printed).

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
    for tier, what in TIER_HELP.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


# -- the ranks multi-process tests run on ---------------------------------------------------------
# One fixture, `pools(world, **env)`: a pool of gloo ranks (dist_harness.RankPool) per world
# size and environment, started on first use and closed when the test module ends (its ranks
# keep the module's imports and patches, so no two modules share one). `pool` is a module's
# usual one: POOL_WORLD ranks (a module global; default 2) with POOL_ENV (default none), or
# each size of POOL_WORLDS in turn where the module lists several.

@pytest.fixture(scope="module")
def pools():
    from dist_harness import rank_pools
    with rank_pools() as get:
        yield get


@pytest.fixture(scope="module")
def pool(pools, request):
    world = getattr(request, "param", None) or getattr(request.module, "POOL_WORLD", 2)
    return pools(world, **getattr(request.module, "POOL_ENV", {}))


def pytest_generate_tests(metafunc):
    worlds = getattr(metafunc.module, "POOL_WORLDS", None)
    if worlds and "pool" in metafunc.fixturenames:
        metafunc.parametrize("pool", worlds, indirect=True, scope="module")


# -- test tiers ---------------------------------------------------------------------------------
# A test's folder gives its markers (docs/testing.md). Every test has exactly one tier, core,
# engine or integration, and the tests of tests/jobs/ have the marker `jobs` as well:
# - tests/core/<package>/: `core`, the sharding core (plan, shard, fsdp, optim, checkpoint) with
#   no other library than torch (`pytest -m core tests`);
# - tests/engine/: `engine`, the engine, launch, config, docs, examples, benchmarks;
# - tests/integration/: `integration`, the tests of other libraries (DeepSpeed's engine,
#   transformers, PEFT, TRL, Accelerate; `pytest -m integration tests`);
# - tests/jobs/: `jobs`, the files whose tests start whole jobs or launchers as processes
#   (`pytest -m "not jobs" tests` leaves them out), each in the integration tier where it runs
#   another library's launcher or DeepSpeed (JOBS_INTEGRATION), else in the engine tier.
# The few tests of another launcher (mpirun, DeepSpeed's) in files of the engine tier are
# integration (INTEGRATION_TESTS). tests/engine/test_tiers.py checks that every test file is in
# one of these folders, that these names exist and that the integration tier holds
# .ci/integration-tests.txt.
TIER_HELP = {
    "core": "plan, shard, fsdp, optim and checkpoint tests, torch only (tests/core/; "
            "pytest -m core)",
    "integration": "tests of other libraries: DeepSpeed, transformers, PEFT, TRL, Accelerate, "
                   "mpirun (tests/integration/ and some of tests/jobs/; pytest -m integration)",
    "engine": "every other test: the engine, launch, config, docs, examples, benchmarks",
    "jobs": "tests that start whole jobs or launchers as processes (tests/jobs/; the everyday "
            "run leaves them out: pytest -m 'not jobs')",
}
TIERS = ("core", "engine", "integration")  # each a folder of tests/ too

# The files of tests/jobs/ in the integration tier: they run another library's launcher
# (deepspeed, mpirun) or DeepSpeed itself (beside ours, in a benchmark).
JOBS_INTEGRATION = {"test_launchers.py", "test_gpu_check.py", "test_offload_benchmark.py"}

# Tests of another launcher (mpirun, DeepSpeed's) in files of the engine tier: integration.
INTEGRATION_TESTS = {
    "test_vescale_run.py::test_a_failing_rank_fails_the_job_under_mpirun_and_deepspeed",
    "test_launcher_faults.py::"
    "test_sigterm_under_mpirun_or_deepspeed_reaches_the_ranks_with_the_grace",
    "test_launch_env.py::test_rank_zero_shares_its_address_over_mpi",
}


def markers_of(path) -> list:
    """The markers of a test file's tests, from its folder under tests/: [tier], or [tier, "jobs"]
    in tests/jobs/ ([]: outside these folders, which tests/engine/test_tiers.py reports)."""
    parts = os.path.relpath(os.path.abspath(path), TESTS).split(os.sep)
    if len(parts) < 2:
        return []
    if parts[0] in TIERS:
        return [parts[0]]
    if parts[0] == "jobs":
        return ["integration" if parts[-1] in JOBS_INTEGRATION else "engine", "jobs"]
    return []


def tier_of(path):
    """The tier of a test file (None: in no tier folder)."""
    markers = markers_of(path)
    return markers[0] if markers else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        markers = markers_of(item.path)
        key = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if markers and key in INTEGRATION_TESTS:
            markers[0] = "integration"
        for marker in markers:
            item.add_marker(getattr(pytest.mark, marker))


def pytest_terminal_summary(terminalreporter):
    files = _SUITE["files"]
    if not files:
        return
    slowest = sorted(files.items(), key=lambda kv: -kv[1])
    out = os.environ.get("VESCALE_TEST_DURATIONS")  # (CI sets it: its log lists every file)
    shown = len(slowest) if out else 15
    terminalreporter.write_sep("-", f"time per test file (setup + tests + teardown), "
                                    f"{sum(files.values()) / 60:.1f} min in all, slowest first")
    for path, seconds in slowest[:shown]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    if len(slowest) > shown:
        terminalreporter.write_line(f"  ... {len(slowest) - shown} more files")
    if out:
        with open(out, "w") as f:
            json.dump({path: round(seconds, 2) for path, seconds in slowest}, f, indent=1)
