"""The supported library versions are declared once and checked: setup.py's ranges, the lowest
versions CI's second pass installs (.ci/lowest-constraints.txt) and the ranges
`vescale_engine/versions.py` checks at `patch_deepspeed()` / `initialize` agree, and a library
below its range stops there with one line naming it, its version and the range."""
from __future__ import annotations

import json
import os
import pathlib
import runpy
import subprocess
import sys
import types

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import vescale_engine
from vescale_engine import versions

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _setup_arguments(monkeypatch) -> dict:
    """The keyword arguments setup.py gives setuptools.setup (captured, nothing installed)."""
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    monkeypatch.chdir(ROOT)  # setup.py reads README.md from where it runs
    runpy.run_path(str(ROOT / "setup.py"))
    return seen


def _declared(monkeypatch) -> dict:
    """{name: SpecifierSet} of what the second pass installs: the requirements and the [hf] and
    [test] extras (the [mpi] and [plot] extras are not part of it)."""
    arguments = _setup_arguments(monkeypatch)
    extras = arguments["extras_require"]
    out = {}
    for line in [*arguments["install_requires"], *extras["hf"], *extras["test"]]:
        requirement = Requirement(line)
        assert out.get(requirement.name, requirement.specifier) == requirement.specifier, \
            f"setup.py declares {requirement.name} twice, differently"
        out[requirement.name] = requirement.specifier
    return out


def _lowest() -> dict:
    """{name: version} pinned in .ci/lowest-constraints.txt."""
    out = {}
    for line in (ROOT / ".ci" / "lowest-constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"lowest-constraints.txt: {line!r} is not NAME==VERSION"
            out[name.strip()] = version.strip()
    return out


def test_setup_floors_are_the_lowest_constraints(monkeypatch):
    floors = {name: spec.version for name, specifier in _declared(monkeypatch).items()
              for spec in specifier if spec.operator == ">="}
    assert floors == _lowest()


def test_versions_module_lists_setup_ranges(monkeypatch):
    declared = _declared(monkeypatch)
    for name in versions.SUPPORTED:
        assert declared.get(name) == SpecifierSet(versions.supported_range(name)), name


@pytest.fixture
def unchecked(monkeypatch):
    """The guard as in a fresh process: no library checked yet."""
    monkeypatch.setattr(versions, "_checked", set())


def test_patch_deepspeed_names_a_library_below_its_range(monkeypatch, unchecked):
    import deepspeed
    monkeypatch.setattr(deepspeed, "__version__", "0.18.6")  # its ZeRO-3 fails PEFT's tests
    with pytest.raises(ImportError) as caught:
        vescale_engine.patch_deepspeed()
    message = str(caught.value)
    assert message == ("vescale_engine supports deepspeed>=0.19.3,<0.20, but deepspeed 0.18.6 "
                       "is installed: pip install 'deepspeed>=0.19.3,<0.20'")
    assert "\n" not in message


def test_initialize_names_a_library_below_its_range(monkeypatch, unchecked):
    fake = types.ModuleType("peft")
    fake.__version__ = "0.17.1"
    monkeypatch.setitem(__import__("sys").modules, "peft", fake)
    with pytest.raises(ImportError, match=r"^vescale_engine supports peft>=0\.18\.1,<0\.22, "
                                          r"but peft 0\.17\.1 is installed"):
        vescale_engine.initialize(model=None, config={})


def test_fully_shard_names_a_torch_below_its_range(monkeypatch, unchecked):
    """fully_shard alone (FSDP2 code, no engine) checks too, before it needs a process group."""
    import torch
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(ImportError, match=r"^vescale_engine supports torch>=2\.11\.0,<2\.16, "
                                          r"but torch 2\.10\.0\+cu128 is installed"):
        vescale_engine.fully_shard(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("version", ["0.19.3", "0.19.3+cpu", "0.19.3.dev0", "0.19.8", "0.20.1"])
def test_guard_accepts_the_floor_and_above(unchecked, version):
    """Local and development builds of the lowest release count as it; above the range the
    guard stays out of the way (setup.py caps what pip installs)."""
    versions.check_versions({"deepspeed": types.SimpleNamespace(__version__=version)})


# -- installing next to the user's torch ------------------------------------------------------

def _pip_env() -> dict:
    """pip as on a user's machine: no pip configuration (this machine's caps torch) and no
    extra wheel folders."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory):
    """veScale Engine built as the wheel pip installs (its metadata: the requirements pip
    resolves), once: setuptools comes from the package index, as for any user."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                           "-w", str(out), str(ROOT)], env=_pip_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("vescale_engine-*.whl")
    return wheel


def _pip_would_install(tmp_path, wheel, torch_version=None):
    """What `pip install 'vescale-engine[hf]'` would install or replace in this environment (a
    dry run of the wheel, with no index: everything else is installed), as {name: version}, or
    the line pip stops with. With `torch_version`, the environment holds that torch instead of
    its own (a dist-info ahead of site-packages, which is where pip looks)."""
    env = _pip_env()
    if torch_version is not None:
        fake = tmp_path / "fake" / f"torch-{torch_version}.dist-info"
        fake.mkdir(parents=True)
        (fake / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\n"
                                       f"Version: {torch_version}\n")
        (fake / "RECORD").write_text(f"torch-{torch_version}.dist-info/METADATA,,\n")
        env["PYTHONPATH"] = str(tmp_path / "fake")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                           "--quiet", "--report", str(report), f"{wheel}[hf]"], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if "torch" in line]
        return lines[0] if lines else proc.stderr.strip()[-500:]
    return {item["metadata"]["name"]: item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


@pytest.mark.parametrize("torch_version", [None, "2.11.0", "2.12.1", "2.13.0", "2.14.1",
                                           "2.15.0"])
def test_pip_install_keeps_the_torch_a_user_has(tmp_path, project_wheel, torch_version):
    """Installing us next to any supported torch (this environment's own, None, or each
    supported release) changes nothing but adds veScale Engine: pip never replaces a user's
    multi-GB CUDA torch."""
    assert _pip_would_install(tmp_path, project_wheel, torch_version) == \
        {"vescale-engine": "0.1.0"}


@pytest.mark.parametrize("torch_version", ["2.10.0", "2.16.0"])
def test_pip_install_would_replace_a_torch_outside_the_range(tmp_path, project_wheel,
                                                            torch_version):
    """The other side of the check above: outside the range pip must act on torch (here, with
    no index to fetch one from, it stops naming torch)."""
    outcome = _pip_would_install(tmp_path, project_wheel, torch_version)
    assert isinstance(outcome, str) and "torch" in outcome, outcome
