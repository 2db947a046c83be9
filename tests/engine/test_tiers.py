"""The test tiers stay whole (tests/conftest.py's TIERS): every test file is in exactly one of
core, integration and engine, so a new file cannot fall out of `pytest -m core` and
`pytest -m integration` in silence; the integration tier holds every file CI runs again at the
lowest versions (.ci/integration-tests.txt); the core tier imports no other library."""
from __future__ import annotations

import ast
import glob
import pathlib

import conftest

TESTS = pathlib.Path(__file__).resolve().parents[1]
PATHS = {path.name: path for path in TESTS.rglob("test_*.py")}
ROOT = TESTS.parent
OTHER_LIBRARIES = {"deepspeed", "transformers", "peft", "trl", "accelerate", "datasets"}


def test_every_test_file_is_in_exactly_one_tier():
    files = set(PATHS)
    problems = []
    for name in sorted(files):
        tiers = [tier for tier, members in conftest.TIERS.items() if name in members]
        if len(tiers) != 1:
            problems.append(f"tests/{name} is in {len(tiers)} tiers ({', '.join(tiers) or 'none'})"
                            f": put it in exactly one of tests/conftest.py's TIERS "
                            f"({', '.join(conftest.TIERS)})")
    for tier, members in conftest.TIERS.items():
        problems += [f"tests/conftest.py's TIERS[{tier!r}] names {name}, which is no test file"
                     for name in sorted(members - files)]
    assert not problems, "\n".join(problems)


def test_the_integration_tests_named_in_other_files_exist():
    problems = []
    for key in sorted(conftest.INTEGRATION_TESTS):
        name, _, function = key.partition("::")
        path = PATHS.get(name)
        defined = path is not None and any(
            isinstance(node, ast.FunctionDef) and node.name == function
            for node in ast.parse(path.read_text()).body)
        if not defined:
            problems.append(f"tests/conftest.py's INTEGRATION_TESTS names {key}: no such test")
        elif name in conftest.TIERS["integration"]:
            problems.append(f"{key}: its file is in the integration tier already")
    assert not problems, "\n".join(problems)


def test_the_integration_tier_holds_ci_s_integration_tests():
    listed = set()
    for line in (ROOT / ".ci" / "integration-tests.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            listed |= {pathlib.Path(path).name for path in glob.glob(str(ROOT / line))}
    missing = sorted(listed - conftest.TIERS["integration"])
    assert not missing, f".ci/integration-tests.txt lists {missing}, not in the integration tier"


def test_the_core_tier_imports_no_other_library():
    problems = []
    for name in sorted(conftest.TIERS["core"]):
        path = PATHS[name]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            problems += [f"tests/{name}:{node.lineno} imports {n}: the core tier is torch only"
                         for n in names if n.split(".")[0] in OTHER_LIBRARIES]
    assert not problems, "\n".join(problems)


def test_the_tier_markers_are_registered(pytestconfig):
    """So that `pytest --strict-markers` accepts them."""
    registered = {line.split(":", 1)[0] for line in pytestconfig.getini("markers")}
    assert set(conftest.TIERS) <= registered, registered
