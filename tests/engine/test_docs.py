"""The docs match the code: the config reference is the schema's (regenerated, not edited), and
every config snippet, config key, Python name and file the migration guide and the benchmarks
page mention exists and validates."""
import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from config_schemas import make_reference
from config_schemas.validate import load_schema, validate_config
from dist_harness import free_port, run_job

ROOT = Path(__file__).resolve().parents[2]  # tests/<tier>/ is two folders down
MIGRATION = ROOT / "examples" / "migrate_from_deepspeed.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def _blocks(text, language):
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _schema_paths():
    """Every dotted key path the schema accepts."""
    schema = load_schema()
    paths = set()

    def walk(node, prefix):
        node = make_reference._resolve(node)
        for name, child in node.get("properties", {}).items():
            path = f"{prefix}.{name}" if prefix else name
            paths.add(path)
            walk(child, path)
        for _, branch in make_reference.branches(node, prefix):  # keys added conditionally
            walk(branch, prefix)

    walk(schema, "")
    return paths


def test_config_reference_is_generated_from_the_schema():
    committed = make_reference.REFERENCE_PATH.read_text()
    assert committed == make_reference.render(), (
        f"docs/config_reference.md is out of date with the schema: run "
        f"`{make_reference.COMMAND}` and commit the result")


def test_config_reference_lists_every_schema_key():
    text = make_reference.render()
    listed = set(re.findall(r"^\| `([^`]+)`", text, flags=re.M))
    missing = _schema_paths() - listed
    assert not missing, missing


def test_config_reference_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config_reference.md"
    stale.write_text("old\n")
    monkeypatch.setattr(make_reference, "REFERENCE_PATH", stale)
    assert make_reference.main(["--check"]) == 1
    assert make_reference.COMMAND in capsys.readouterr().err
    assert make_reference.main([]) == 0 and make_reference.main(["--check"]) == 0
    assert stale.read_text() == make_reference.render()


def test_migration_config_snippets_validate():
    snippets = _blocks(MIGRATION.read_text(), "json")
    assert snippets
    for snippet in snippets:
        config, report = validate_config(json.loads(snippet))
        assert "vescale" in config  # the section that routes deepspeed.initialize to us
        # The guide says overlap_comm and reduce_bucket_size are reported as not acted on.
        assert any(line.startswith("zero_optimization.overlap_comm") for line in
                   report.not_acted_on), report.not_acted_on


def test_migration_config_keys_exist_in_the_schema():
    keys = re.findall(r"^\| `([a-z0-9_.]+)` \|", MIGRATION.read_text(), flags=re.M)
    assert len(keys) >= 15
    unknown = sorted(set(keys) - _schema_paths())
    assert not unknown, unknown


def test_migration_python_snippets_parse():
    snippets = _blocks(MIGRATION.read_text(), "python")
    assert len(snippets) >= 3
    for snippet in snippets:
        ast.parse(snippet)


def _resolve_dotted(name):
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for part in parts[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def test_migration_python_names_exist():
    text = MIGRATION.read_text()
    names = set(re.findall(r"\b((?:vescale_engine|deepspeed)(?:\.[A-Za-z_]\w*)+)", text))
    assert {"vescale_engine.patch_deepspeed", "vescale_engine.initialize",
            "deepspeed.initialize", "deepspeed.init_distributed"} <= names
    for name in sorted(names):
        _resolve_dotted(name)  # raises if the guide names something that does not exist


def test_migration_engine_calls_exist():
    from vescale_engine.engine.engine import VeScaleEngine
    text = MIGRATION.read_text()
    called = set(re.findall(r"`engine\.(\w+)\(", text))
    attributes = set(re.findall(r"`engine\.(\w+)`", text))
    assert {"backward", "step", "no_sync", "train", "eval", "destroy"} <= called
    missing = sorted(n for n in called if not callable(getattr(VeScaleEngine, n, None)))
    assert not missing, missing
    init = inspect.getsource(VeScaleEngine.__init__)  # and the _init_* helpers it calls
    init += "".join(inspect.getsource(getattr(VeScaleEngine, name))
                    for name in re.findall(r"self\.(_init_\w+)\(", init))
    missing = sorted(n for n in attributes
                     if f"self.{n} =" not in init and not callable(getattr(VeScaleEngine, n, None)))
    assert not missing, missing


def test_migration_commands_name_existing_files():
    text = MIGRATION.read_text()
    paths = set(re.findall(r"\b((?:examples|tests|docs|config_schemas)/[\w./-]+\.(?:py|json|md))",
                           text))
    assert "examples/train_gpt.py" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing
    for link in re.findall(r"\]\(([^)]+)\)", text):
        assert (MIGRATION.parent / link).resolve().exists(), link


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").iterdir()
                                            if p.suffix in (".py", ".sh")))
def test_benchmarks_page_lists_every_script(script):
    assert f"benchmarks/{script}" in BENCHMARKS.read_text()


def test_benchmarks_page_links_exist_and_numbers_come_from_them():
    """Every linked results file exists, and every bold headline number in a section is
    found in the results file that section links."""
    text = BENCHMARKS.read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert sections
    checked = 0
    for section in sections:
        links = re.findall(r"\]\((\.\./benchmarks/results/[^)]+\.md)\)", section)
        for link in links:
            assert (BENCHMARKS.parent / link).resolve().exists(), link
        sources = "".join((BENCHMARKS.parent / link).resolve().read_text() for link in links)
        for number in re.findall(r"\*\*(-?[0-9][0-9.,]*)[x%]?\*\*", section):
            assert number in sources, (section.splitlines()[0], number)
            checked += 1
    assert checked >= 10, checked


def test_migration_loop_runs_under_the_deepspeed_launcher(tmp_path):
    """The guide's ZeRO-3 loop and config, as written, under `deepspeed --num_gpus 2` on CPU:
    DeepSpeed's launcher and init_distributed, our engine through patch_deepspeed."""
    import os
    import sys
    text = MIGRATION.read_text()
    loop = next(s for s in _blocks(text, "python") if "deepspeed.initialize(" in s)
    config = json.loads(_blocks(text, "json")[0])
    prelude = ("import sys\n"
               f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
               "import fsdp_models\n"
               "GPT = fsdp_models.GPT\n"
               "micro = " + str(config["train_micro_batch_size_per_gpu"]) + "\n"
               "batches = [fsdp_models.batch('gpt', k, micro) for k in range(4)]\n")
    epilogue = ("from vescale_engine.engine.engine import VeScaleEngine\n"
                "assert isinstance(engine, VeScaleEngine), type(engine)\n"
                "open(f'done{engine.global_rank}', 'w').write("
                "f'{engine.world_size} {engine.global_steps} {engine.micro_steps}')\n")
    script = tmp_path / "zero3_script.py"
    script.write_text(prelude + loop + epilogue)
    (tmp_path / "config.json").write_text(json.dumps(config))
    launcher = Path(sys.executable).parent / "deepspeed"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    out = run_job([str(launcher), "--num_gpus", "2", "--master_port",
                  str(free_port()), str(script), "--deepspeed_config",
                  str(tmp_path / "config.json")], cwd=tmp_path, env=env,
                  timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    accum = config["gradient_accumulation_steps"]
    for rank in range(2):  # ranks write files: their printed lines interleave
        assert (tmp_path / f"done{rank}").read_text() == f"2 {4 // accum} 4"




def _is_main_guard(node):
    """`if __name__ == "__main__":`"""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and [type(op) for op in node.test.ops] == [ast.Eq]
            and isinstance(node.test.comparators[0], ast.Constant)
            and node.test.comparators[0].value == "__main__")


def test_migration_framework_scripts_run_under_a_main_guard():
    """The LLaMA-Factory and axolotl scripts call patch_deepspeed() at import and run the
    framework's entry point only under `if __name__ == "__main__":`. axolotl's dataset
    preprocessing starts child processes that import the script again; a top-level entry point
    call there starts training in the child, which then waits forever on the dataset lock its
    parent holds."""
    scripts = [s for s in _blocks(MIGRATION.read_text(), "python")
               if re.search(r"^from (llamafactory|axolotl)\b", s, flags=re.M)]
    assert {m for s in scripts for m in re.findall(r"^from (llamafactory|axolotl)\b", s,
                                                      flags=re.M)} == {"llamafactory", "axolotl"}
    for script in scripts:
        body = ast.parse(script).body
        guards = [node for node in body if _is_main_guard(node)]
        assert len(guards) == 1, script
        calls = [ast.unparse(node.value) for node in body
                 if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
        assert calls == ["vescale_engine.patch_deepspeed()"], (calls, script)
        guarded = [ast.unparse(node.value) for node in guards[0].body
                   if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
        assert guarded and guarded[-1] in ("run_exp()", "fire.Fire(do_cli)"), (guarded, script)


# ---- the README and every page's links ---------------------------------------------------------

README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "examples").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # (no headings in code)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    """A page moved or a heading renamed leaves no link pointing nowhere."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, broken


def test_readme_says_what_it_is_first_and_keeps_the_two_commands():
    text = README.read_text()
    assert "veScale Engine" in "\n".join(text.splitlines()[:10])
    commands = [line for line in _blocks(text, "bash")[0].splitlines()
                if line and not line.startswith("#")]
    assert commands == [
        "bash .ci/setup-venv .venv && .venv/bin/vescale run --nproc 2 examples/train_gpt.py "
        "--config examples/configs/vescale_default.json",
        "bash .ci/setup-venv .venv --test --torch newest && .venv/bin/python -m pytest -q tests"]
    assert not re.search(r"(?<![-\w])\d[\d,]+ tests\b", text), "test counts belong to CI's log"


README_RUN = '''
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()

torch.manual_seed(0)
batch = torch.randn(8, 16)
done = []
model = Model()
exec(BLOCKS[0])
loss = model(batch); loss.backward(); optimizer.step()
done.append(type(model.layers[0].weight).__name__)
model = Model()
exec(BLOCKS[1])
done.append(f"{type(engine).__name__} {engine.global_steps}")
import json
with open("ds_config.json", "w") as f:
    json.dump({"train_micro_batch_size_per_gpu": 8,
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
               "zero_optimization": {"stage": 3}, "vescale": {}}, f)
model = Model()
exec(BLOCKS[2])
loss = engine(batch); engine.backward(loss); engine.step()
done.append(f"{type(engine).__name__} {engine.global_steps}")
vescale_engine.unpatch()
open(f"done{dist.get_rank()}", "w").write(" | ".join(done))
'''


def test_readme_code_runs_as_written(tmp_path):
    """The README's three ways in, as written, on a small model over 2 gloo ranks: FSDP2's
    fully_shard with a torch optimizer, initialize with the minimal config, and the DeepSpeed
    line with a ZeRO-3 config file."""
    import os
    import sys
    blocks = _blocks(README.read_text(), "python")
    assert len(blocks) == 3, len(blocks)
    script = tmp_path / "readme_code.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nBLOCKS = {blocks!r}\n"
                      + README_RUN)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    out = run_job([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(free_port()), str(script)], cwd=tmp_path, env=env,
                  timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in range(2):
        assert (tmp_path / f"done{rank}").read_text() == \
            "RaggedDTensor | VeScaleEngine 1 | VeScaleEngine 1"
