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
# `pytest -m core tests`: the sharding core (plan, shard, fsdp, optim, checkpoint) with no other
# library than torch, a few minutes on 2 cores; `pytest -m integration tests`: the tests of other
# libraries (DeepSpeed's engine and launcher, transformers, PEFT, TRL, Accelerate, mpirun).
# Every other test file is in the "engine" tier (the engine, launch, config, docs, examples,
# benchmarks), but for the few tests of other launchers named in INTEGRATION_TESTS, which are
# integration. Each test gets its file's marker (or that one); tests/test_tiers.py checks that
# every test file is in exactly one tier and that the integration tier holds
# .ci/integration-tests.txt.
TIER_HELP = {
    "core": "plan, shard, fsdp, optim and checkpoint tests, torch only (pytest -m core)",
    "integration": "tests of other libraries: DeepSpeed, transformers, PEFT, TRL, Accelerate, "
                   "mpirun (pytest -m integration)",
    "engine": "every other test: the engine, launch, config, docs, examples, benchmarks",
}
TIERS = {
    "core": {
        "test_planner.py", "test_plan_ep.py", "test_ragged.py", "test_ragged_dtensor.py",
        "test_fsdp.py", "test_fsdp2_torch_utils.py", "test_fsdp_module.py", "test_fsdp2_idioms.py",
        "test_shampoo.py", "test_checkpoint_faults.py", "test_wrap_policy.py", "test_layering.py",
        "test_parallel_layout.py", "test_fsdp2_checkpoint_interchange.py", "test_torch_compat.py",
        "test_fsdp2_peer_behaviours.py", "test_fsdp_gradients_outside_forward.py",
    },
    "integration": {
        # .ci/integration-tests.txt (CI runs them again at the lowest supported versions; the
        # GPU check's CPU dry run too, which runs DeepSpeed beside ours)
        "test_hf_trainer.py", "test_hf_trainer_reentrant.py", "test_hf_lora.py", "test_trl.py",
        "test_deepspeed_parity.py", "test_deepspeed_api.py", "test_deepspeed_params.py",
        "test_hf_checkpoint.py", "test_hf_zero_init.py", "test_versions.py",
        "test_autograd_features.py", "test_accelerate_fsdp2.py", "test_sequence_parallel.py",
        "test_engine_compile.py", "test_gpu_check.py",
        # and the other tests of other libraries
        "test_config_in_the_wild.py", "test_deepspeed_moe.py", "test_launchers.py",
        "test_integrations.py", "test_deepspeed_zero3_behaviours.py",
    },
    "engine": {
        "test_adamw8bit.py", "test_benchmark_ranks.py", "test_capacity.py", "test_checkpoint.py",
        "test_checkpoint_async.py",
        "test_colocation.py", "test_config_schema.py", "test_device.py",
        "test_device_hygiene.py", "test_docs.py", "test_engine.py", "test_engine_config.py",
        "test_engine_faults.py", "test_engine_tp_ep.py", "test_example.py", "test_fail_fast.py",
        "test_launch_env.py", "test_launcher_faults.py", "test_logging.py",
        "test_materialize.py", "test_moe_benchmark.py", "test_muon.py", "test_offload.py",
        "test_offload_benchmark.py", "test_package.py", "test_plan_cli.py",
        "test_quantized_comm.py", "test_requires_grad.py", "test_tiers.py", "test_tp_ep.py", "test_vescale_run.py",
        "test_training_state.py",
    },
}


# Tests of another launcher (mpirun, DeepSpeed's) in files of the engine tier: integration.
INTEGRATION_TESTS = {
    "test_vescale_run.py::test_a_failing_rank_fails_the_job_under_mpirun_and_deepspeed",
    "test_launcher_faults.py::"
    "test_sigterm_under_mpirun_or_deepspeed_reaches_the_ranks_with_the_grace",
    "test_launch_env.py::test_rank_zero_shares_its_address_over_mpi",
}


def tier_of(filename: str):
    """The tier a test file is in (None: in none, which tests/test_tiers.py reports)."""
    found = [tier for tier, files in TIERS.items() if filename in files]
    return found[0] if len(found) == 1 else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item.path.name)
        if f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in INTEGRATION_TESTS:
            tier = "integration"
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


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
