"""The test folders stay whole (tests/conftest.py's markers_of: the folder gives the markers):
every test file is in tests/core/<package>/, tests/engine/, tests/integration/ or tests/jobs/,
so a new file cannot fall out of `pytest -m core` and `pytest -m integration` in silence; its
basename is unique (test modules are imported by name, in pytest and in the rank pools); the
names conftest.py lists exist; the integration tier holds every file CI runs again at the
lowest versions (.ci/integration-tests.txt); the core tier imports no other library."""
from __future__ import annotations

import ast
import collections
import glob
import pathlib
import sys

import conftest

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FILES = sorted(TESTS.rglob("test_*.py"))
OTHER_LIBRARIES = {"deepspeed", "transformers", "peft", "trl", "accelerate", "datasets"}


def where(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_test_file_is_in_exactly_one_tier():
    problems = []
    for path in FILES:
        parts = path.relative_to(TESTS).parts
        placed = (parts[0] == "core" and len(parts) == 3) or \
            (parts[0] in {"engine", "integration", "jobs"} and len(parts) == 2)
        markers = conftest.markers_of(path)
        if not placed:
            problems.append(f"{where(path)}: put it in tests/core/<package>/ (torch only), "
                            f"tests/engine/, tests/integration/ (other libraries) or tests/jobs/ "
                            f"(its tests start jobs or launchers as processes)")
        elif [m for m in markers if m in conftest.TIERS] != markers[:1] or \
                ("jobs" in markers) != (parts[0] == "jobs"):
            problems.append(f"{where(path)}: markers {markers}, not one tier (and jobs in jobs/)")
    jobs = {path.name for path in FILES if path.parent == TESTS / "jobs"}
    problems += [f"tests/conftest.py's JOBS_INTEGRATION names {name}: no such file in tests/jobs/"
                 for name in sorted(conftest.JOBS_INTEGRATION - jobs)]
    assert not problems, "\n".join(problems)


def test_test_modules_are_importable_by_their_names():
    """pytest's default import mode and the rank pools (dist_harness: a test's function by its
    module's name, with the parent's sys.path) import a test module by its basename."""
    names = collections.Counter(path.name for path in FILES)
    problems = [f"{name}: {names[name]} test files of this name" for name in sorted(names)
                if names[name] > 1]
    problems += [f"{where(path)}: no __init__.py under tests/ (it would change the module names)"
                 for path in sorted(TESTS.rglob("__init__.py"))]
    on_path = {pathlib.Path(entry).resolve() for entry in sys.path if entry}
    problems += [f"{where(folder)} is not on sys.path: tests/conftest.py puts it there"
                 for folder in sorted({path.parent for path in FILES}) if folder not in on_path]
    assert not problems, "\n".join(problems)


def test_the_integration_tests_named_in_other_files_exist():
    problems = []
    paths = {path.name: path for path in FILES}
    for key in sorted(conftest.INTEGRATION_TESTS):
        name, _, function = key.partition("::")
        path = paths.get(name)
        defined = path is not None and any(
            isinstance(node, ast.FunctionDef) and node.name == function
            for node in ast.parse(path.read_text()).body)
        if not defined:
            problems.append(f"tests/conftest.py's INTEGRATION_TESTS names {key}: no such test")
        elif conftest.tier_of(path) != "engine":
            problems.append(f"{key}: its file is in the {conftest.tier_of(path)} tier, not engine")
    assert not problems, "\n".join(problems)


def test_the_integration_tier_holds_ci_s_integration_tests():
    problems = []
    for line in (ROOT / ".ci" / "integration-tests.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        matched = [pathlib.Path(path) for path in glob.glob(str(ROOT / line))]
        if not glob.has_magic(line) and not matched:
            problems.append(f".ci/integration-tests.txt lists {line}, which does not exist")
        problems += [f".ci/integration-tests.txt lists {where(path)}, not a test file of the "
                     f"integration tier (tests/integration/, or JOBS_INTEGRATION in tests/jobs/)"
                     for path in matched
                     if path not in FILES or conftest.tier_of(path) != "integration"]
    assert not problems, "\n".join(problems)


def test_the_core_tier_imports_no_other_library():
    problems = []
    for path in FILES:
        if conftest.tier_of(path) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            problems += [f"{where(path)}:{node.lineno} imports {n}: the core tier is torch only"
                         for n in names if n.split(".")[0] in OTHER_LIBRARIES]
    assert not problems, "\n".join(problems)


def test_the_tier_markers_are_registered(pytestconfig):
    """So that `pytest --strict-markers` accepts them."""
    registered = {line.split(":", 1)[0] for line in pytestconfig.getini("markers")}
    assert {*conftest.TIERS, "jobs"} <= registered, registered
