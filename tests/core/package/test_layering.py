"""The package's layers stay true: no import circle, and no import against the declared order.

The order is the table under "## Layers" in docs/architecture.md (its first fenced block): one
line per layer, lowest first, `layer: modules` (indented lines continue it), a module named by its dotted path under
`vescale_engine` (a package name covers everything inside it). A module may import from its own
layer and the layers below. Every import statement counts, at module level, inside functions
and under `if TYPE_CHECKING:` (a type-only back reference is a circle too). A module the table
does not place, or a name in the table that is no module, is an error too.

Other libraries are patched in vescale_engine/integrations/ only: no other module imports it
(the package root reaches it by name, for its lazy `patch_deepspeed` and `unpatch`), and no
other module sets or deletes an attribute of torch, DeepSpeed or the Hugging Face libraries.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tests/core/<package>/ is three folders down
PACKAGE = "vescale_engine"


def declared_layers(doc: pathlib.Path = ROOT / "docs" / "architecture.md") -> list:
    """[(layer, [module, ...])], lowest layer first, from the doc's table."""
    text = doc.read_text()
    section = text.split("\n## Layers", 1)
    assert len(section) == 2, f"{doc}: no '## Layers' section"
    block = re.search(r"```\n(.*?)```", section[1], re.S)
    assert block, f"{doc}: '## Layers' has no fenced table"
    layers = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if ":" in line:
            name, _, modules = line.partition(":")
            layers.append((name.strip(), modules.split()))
        elif line:  # a continuation of the layer above
            layers[-1][1].extend(line.split())
    return layers


def package_modules(root: pathlib.Path = ROOT) -> dict:
    """{dotted module name: file} for every module of the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(modules: dict) -> list:
    """[(importer, imported, file, line)] for every import of a package module by another, at
    any depth of the file (functions and TYPE_CHECKING blocks included)."""
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found = [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                target, found = None, [alias.name for alias in node.names]
            else:
                continue
            for candidate in found:
                if candidate not in modules and target is not None:
                    candidate = target  # `from .x import name`: the module x
                while candidate not in modules and "." in candidate:
                    candidate = candidate.rsplit(".", 1)[0]
                if candidate in modules and candidate != name and \
                        candidate.split(".")[0] == PACKAGE:
                    edges.append((name, candidate, path, node.lineno))
    return edges


def layer_of(module: str, table: list):
    """(index, layer) of `module`: the entry naming it or the package holding it, longest
    match first; None when the table does not place it."""
    best = None
    for index, (layer, names) in enumerate(table):
        for entry in names:
            full = PACKAGE if entry == PACKAGE else f"{PACKAGE}.{entry}"
            inside = module.startswith(full + ".") and full != PACKAGE  # the root: itself only
            if module == full or inside:
                if best is None or len(full) > best[0]:
                    best = (len(full), index, layer)
    return None if best is None else best[1:]


def circles(edges: list) -> list:
    """Every strongly connected group of more than one module, each as a cycle of edges."""
    graph = {}
    for src, dst, path, line in edges:
        graph.setdefault(src, {}).setdefault(dst, (path, line))
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:  # one cycle through the group, for the message
        start = min(group)
        path, seen, v = [start], {start}, start
        while True:
            nxt = min(w for w in graph[v] if w in group)
            if nxt in seen:
                path = path[path.index(nxt):] + [nxt]
                break
            path.append(nxt)
            seen.add(nxt)
            v = nxt
        out.append([(a, b, *graph[a][b]) for a, b in zip(path, path[1:])])
    return out


def layering_problems(root: pathlib.Path = ROOT, table=None) -> list:
    """One line per problem: an unplaced module, a stale table entry, an import against the
    order, a circle."""
    modules = package_modules(root)
    table = declared_layers() if table is None else table
    problems = []
    for module in modules:
        if layer_of(module, table) is None:
            problems.append(f"{module} is in no layer of docs/architecture.md's '## Layers'")
    for layer, names in table:
        for entry in names:
            full = PACKAGE if entry == PACKAGE else f"{PACKAGE}.{entry}"
            if full not in modules:
                problems.append(f"layer {layer}: {entry} is no module of {PACKAGE}")
    edges = imports(modules)

    def where(path, line):
        return f"{path.relative_to(root)}:{line}"

    for src, dst, path, line in edges:
        a, b = layer_of(src, table), layer_of(dst, table)
        if a is not None and b is not None and b[0] > a[0]:
            problems.append(f"{where(path, line)}: {src} (layer {a[1]}) imports {dst} (layer "
                            f"{b[1]}, above it): a layer imports only from itself and below")
    for cycle in circles(edges):
        problems.append("import circle: " + " -> ".join(
            f"{src} ({where(path, line)})" for src, _, path, line in cycle)
            + f" -> {cycle[0][0]}")
    return problems


def test_no_circle_and_no_import_against_the_declared_order():
    problems = layering_problems()
    assert not problems, "\n".join(problems)


CONFIG_SCHEMAS_MAY_IMPORT = {"jsonschema", "config_schemas"}  # and the standard library


def test_config_schemas_is_below_every_layer():
    """config_schemas/ (outside the package; engine/, init/ and launcher/ import it at run time)
    is below every layer of the table: it imports only the standard library, jsonschema and
    itself, never vescale_engine or launcher (docs/architecture.md '## Layers')."""
    import sys
    problems = []
    for path in sorted((ROOT / "config_schemas").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in CONFIG_SCHEMAS_MAY_IMPORT:
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}: "
                                    "config_schemas/ imports only the standard library, "
                                    "jsonschema and itself")
    assert not problems, "\n".join(problems)
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "config_schemas/" in text.split("\n## Layers", 1)[0], \
        "docs/architecture.md's module map does not name config_schemas/"


def test_the_checker_sees_deferred_imports_circles_and_upward_imports(tmp_path):
    """The checker on a small package: a deferred upward import and a circle are reported, a
    TYPE_CHECKING back reference too."""
    pkg = tmp_path / PACKAGE
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from . import a\n")
    (pkg / "low" / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from ..high import c\n"
                                      "def f():\n    from .b import x\n")
    (pkg / "low" / "b.py").write_text("from . import a\n")
    (pkg / "high.py").write_text("def g():\n    from .low import a\n")
    (pkg / "upper.py").write_text("")
    table = [("low", ["low"]), ("high", ["high", "upper", PACKAGE])]
    assert layering_problems(tmp_path, table) == [
        f"{PACKAGE}/low/a.py:3: {PACKAGE}.low.a (layer low) imports {PACKAGE}.high "
        "(layer high, above it): a layer imports only from itself and below",
        f"import circle: {PACKAGE}.high ({PACKAGE}/high.py:2) -> {PACKAGE}.low.a "
        f"({PACKAGE}/low/a.py:3) -> {PACKAGE}.high"]  # (one cycle per group: a, b, high)
    (pkg / "low" / "a.py").write_text("def f():\n    from .b import x\n")
    assert layering_problems(tmp_path, table) == [
        f"import circle: {PACKAGE}.low.a ({PACKAGE}/low/a.py:2) -> {PACKAGE}.low.b "
        f"({PACKAGE}/low/b.py:1) -> {PACKAGE}.low.a"]
    (pkg / "low" / "b.py").write_text("def h():\n    from .. import upper\n")
    assert layering_problems(tmp_path, table) == [
        f"{PACKAGE}/low/b.py:2: {PACKAGE}.low.b (layer low) imports {PACKAGE}.upper "
        "(layer high, above it): a layer imports only from itself and below"]
    (pkg / "new.py").write_text("")
    assert layering_problems(tmp_path, table + [("top", ["gone"])]) == [
        f"{PACKAGE}.new is in no layer of docs/architecture.md's '## Layers'",
        f"layer top: gone is no module of {PACKAGE}",
        f"{PACKAGE}/low/b.py:2: {PACKAGE}.low.b (layer low) imports {PACKAGE}.upper "
        "(layer high, above it): a layer imports only from itself and below"]


def test_the_module_map_names_every_module():
    """docs/architecture.md's module map (the text before '## Layers') names every module file
    of the package, so a new module cannot go in without its line there."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("\n## Layers", 1)[0]
    missing = [str(path.relative_to(ROOT)) for path in package_modules().values()
               if path.name != "__init__.py" and path.name not in text]
    assert not missing, f"docs/architecture.md's module map does not name: {', '.join(missing)}"


EXPORTING = ("plan", "launch", "shard", "fsdp", "checkpoint", "optim", "init", "engine")  # all


def _declared_all(path: pathlib.Path):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:  # computed (a lazy package's names): as the module says
                return _imported_all(path)
    return None


def _computed_all(path: pathlib.Path) -> bool:
    return any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                    for t in node.targets)
               and not isinstance(node.value, (ast.List, ast.Tuple))
               for node in ast.parse(path.read_text()).body)


def _imported_all(path: pathlib.Path):
    import importlib
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return list(importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__"
                                                 else parts)).__all__)


def test_every_module_declares_what_others_import_from_it():
    """Each module of every subpackage has an `__all__`; every name in it is bound in
    the module; every public name another file of the repository imports from it
    (`from module import name`) is in it."""
    modules = {name: path for name, path in package_modules().items()
               if name.split(".")[1:2] and name.split(".")[1] in EXPORTING}
    problems, exported = [], {}
    for name, path in modules.items():
        exported[name] = _declared_all(path)
        if exported[name] is None:
            problems.append(f"{path.relative_to(ROOT)}: no __all__")
            continue
        if _computed_all(path):  # a lazy package: its names resolve through __getattr__
            continue
        tree = ast.parse(path.read_text())
        bound = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 for t in ast.walk(target) if isinstance(t, ast.Name)}
        bound |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        bound |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                  for a in n.names}
        problems += [f"{path.relative_to(ROOT)}: __all__ names {n!r}, which it does not bind"
                     for n in exported[name] if n not in bound]
    for folder in (PACKAGE, "launcher", "benchmarks", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            here = parts[:-1]  # the package a relative import starts from
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                source = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]) \
                    .strip(".") if node.level else node.module
                for alias in node.names if exported.get(source) is not None else ():
                    if not alias.name.startswith("_") and f"{source}.{alias.name}" not in \
                            modules and alias.name not in exported[source]:
                        problems.append(f"{path.relative_to(ROOT)}:{node.lineno} imports "
                                        f"{alias.name} from {source}, whose __all__ lacks it")
    assert not problems, "\n".join(problems)


# -- other libraries are patched in vescale_engine/integrations/ only ----------------------------

INTEGRATIONS = f"{PACKAGE}.integrations"
# The entry points that may reach integrations: the package root, whose lazy names
# `patch_deepspeed` and `unpatch` point into it (by name, through importlib: no import statement).
MAY_IMPORT_INTEGRATIONS = (PACKAGE,)


def integrations_importers(root: pathlib.Path = ROOT) -> list:
    """'file:line: module imports vescale_engine.integrations...' for every core module that
    imports the integrations package, at any depth of the file."""
    modules = package_modules(root)
    out = []
    for src, dst, path, line in imports(modules):
        inside = src == INTEGRATIONS or src.startswith(INTEGRATIONS + ".")
        if (dst == INTEGRATIONS or dst.startswith(INTEGRATIONS + ".")) and not inside and \
                src not in MAY_IMPORT_INTEGRATIONS:
            out.append(f"{path.relative_to(root)}:{line}: {src} imports {dst}")
    for name, path in modules.items():  # importlib.import_module(".integrations", ...) too
        if name in MAY_IMPORT_INTEGRATIONS or name.startswith(INTEGRATIONS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") \
                    and any(isinstance(a, ast.Constant) and "integrations" in str(a.value)
                            for a in node.args):
                out.append(f"{path.relative_to(root)}:{node.lineno}: {name} imports "
                           f"{INTEGRATIONS} by name")
    return out


def _root_name(node):
    """The name an attribute chain (`a.b.c`, `a[0].b`) starts from, else None."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


# The libraries whose attributes only integrations/ may set: those the issue names and torch
# (the standard library's process state, sys.excepthook and the like, is not in scope).
OTHER_LIBRARIES = ("torch", "deepspeed", "transformers", "peft", "trl", "accelerate",
                   "safetensors", "datasets")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _imported_libraries(tree) -> set:
    """The names a file binds, anywhere, to OTHER_LIBRARIES' modules or objects by import."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] in OTHER_LIBRARIES)
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or "").split(".")[0] in OTHER_LIBRARIES:
            found.update(alias.asname or alias.name for alias in node.names)
    return found


def _scope_nodes(scope):
    """The nodes of one scope (a module or a function body), nested functions left out."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _FUNCTIONS):
            stack.extend(ast.iter_child_nodes(node))


def _aliases(nodes, foreign: set) -> set:
    """Names a scope binds to another library's objects: assigned (or looped) from an
    attribute chain of one (`zero = deepspeed.zero`), or looked up by module name
    (`importlib.import_module(...)`, `sys.modules.get(...)`, `sys.modules[...]`,
    `for m in list(sys.modules.values())`)."""
    foreign, nodes, changed = set(foreign), list(nodes), True
    while changed:
        changed = False
        for node in nodes:
            if not isinstance(node, (ast.Assign, ast.For)):
                continue
            value = node.value if isinstance(node, ast.Assign) else node.iter
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            text = ast.unparse(value)
            looked_up = text.startswith(("importlib.import_module(", "import_module(",
                                         "sys.modules.get(", "sys.modules[",
                                         "list(sys.modules.values())", "sys.modules.values()"))
            rooted = isinstance(value, (ast.Attribute, ast.Name, ast.Subscript)) and \
                _root_name(value) in foreign
            if looked_up or rooted:
                for target in targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for name in names:  # plain names only: `x.y = lib` binds no alias
                        if isinstance(name, ast.Name) and name.id not in foreign:
                            foreign.add(name.id)
                            changed = True
    return foreign


def _patches_in(tree) -> list:
    """[(line, text)] of every statement that sets or deletes another library's attribute."""
    imported, found = _imported_libraries(tree), []
    module_level = _aliases(_scope_nodes(tree), imported)
    scopes = [(tree, module_level)]
    for node in ast.walk(tree):
        if isinstance(node, _FUNCTIONS):
            args = node.args
            params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                      *filter(None, (args.vararg, args.kwarg)))}
            scopes.append((node, _aliases(_scope_nodes(node), module_level - params)))
    for scope, foreign in scopes:
        for node in _scope_nodes(scope):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and node.args:
                if _root_name(node.args[0]) in foreign:
                    found.append((node.lineno, ast.unparse(node)))
                continue
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for sub in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(sub, ast.Attribute) and _root_name(sub) in foreign:
                        found.append((node.lineno, f"del {ast.unparse(sub)}"
                                      if isinstance(node, ast.Delete) else
                                      f"{ast.unparse(sub)} = ..."))
    return sorted(found)


def patches_of_other_libraries(root: pathlib.Path = ROOT, skip=(INTEGRATIONS,)) -> list:
    """'file:line: code' for every statement outside `skip` that sets or deletes an attribute
    of another library's module or class (OTHER_LIBRARIES): `<library name>.<attr> = ...` (and
    `+=`, `del`), `setattr(<library name>..., ...)`, `delattr(...)`, the library name bound by
    an import or an alias of one in the same scope (so `torch.nn.Parameter.x = ...`,
    `nn.Parameter.x = ...` and `zero = deepspeed.zero; zero.Init = ...` all count)."""
    out = []
    for name, path in package_modules(root).items():
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        out += [f"{path.relative_to(root)}:{line}: {text}"
                for line, text in _patches_in(ast.parse(path.read_text()))]
    return out


def test_no_core_module_imports_integrations():
    problems = integrations_importers()
    assert not problems, "\n".join(problems)


# The libraries whose emulation belongs to integrations/: no other module imports them, by an
# import statement or by name (importlib.import_module, find_spec, sys.modules lookups).
EMULATED = ("deepspeed", "transformers", "peft", "trl")
# Core modules that still do, each to move its library's part into integrations/: the set
# only shrinks (a module that stops importing them must leave it).
STILL_IMPORTING = set()


def _emulated(name) -> bool:
    return isinstance(name, str) and name.split(".")[0] in EMULATED


def emulated_library_importers(root: pathlib.Path = ROOT) -> dict:
    """{module: ['line: what']} for every module outside integrations/ that imports or looks
    up DeepSpeed, transformers, PEFT or TRL."""
    out = {}
    for name, path in package_modules(root).items():
        if name == INTEGRATIONS or name.startswith(INTEGRATIONS + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found = None
            if isinstance(node, ast.Import):
                found = next((a.name for a in node.names if _emulated(a.name)), None)
            elif isinstance(node, ast.ImportFrom) and not node.level and _emulated(node.module):
                found = node.module
            elif isinstance(node, ast.Call) and node.args and \
                    isinstance(node.args[0], ast.Constant) and _emulated(node.args[0].value) \
                    and ast.unparse(node.func).split(".")[-1] in ("import_module", "find_spec",
                                                                  "get"):
                found = f"{ast.unparse(node.func)}({node.args[0].value!r})"
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules" \
                    and isinstance(node.slice, ast.Constant) and _emulated(node.slice.value):
                found = f"sys.modules[{node.slice.value!r}]"
            if found:
                out.setdefault(name, []).append(f"{node.lineno}: {found}")
    return out


def test_only_integrations_import_deepspeed_transformers_peft_and_trl():
    found = emulated_library_importers()
    new = {m: found[m] for m in sorted(set(found) - STILL_IMPORTING)}
    assert not new, f"import DeepSpeed, transformers, PEFT or TRL in integrations/ only: {new}"
    gone = sorted(STILL_IMPORTING - set(found))
    assert not gone, f"no longer importing them: leave STILL_IMPORTING: {gone}"


def test_only_integrations_patches_other_libraries():
    problems = patches_of_other_libraries()
    assert not problems, "only vescale_engine/integrations/ may patch another library:\n" + \
        "\n".join(problems)


def test_the_patch_checker_sees_each_way_of_patching(tmp_path):
    """The two checkers on a small package: every spelling of a patch outside integrations is
    reported, and the same code inside integrations, or on our own objects, is not."""
    pkg = tmp_path / PACKAGE
    (pkg / "core").mkdir(parents=True)
    (pkg / "integrations").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "integrations" / "__init__.py").write_text("")
    patching = ("import importlib, sys\nimport deepspeed\nimport torch\nfrom torch import nn\n"
                "from accelerate import Accelerator\n"
                "def f(new, model):\n"
                "    deepspeed.initialize = new\n"
                "    setattr(deepspeed.zero, 'Init', new)\n"
                "    torch.nn.Parameter.ds_status = new\n"
                "    nn.Parameter.ds_shape = new\n"
                "    Accelerator.get_state_dict = new\n"
                "    zero = deepspeed.zero\n"
                "    zero.GatheredParameters = new\n"
                "    peft = importlib.import_module('peft.tuners')\n"
                "    del peft.LoraModel\n"
                "    for module in list(sys.modules.values()):\n"
                "        module.extract_model_from_parallel = new\n"
                "    model.forward = new\n"            # our own objects: fine
                "    layer = nn.Linear(1, 1)\n"
                "    layer.weight = new\n")
    (pkg / "core" / "bad.py").write_text(patching)
    (pkg / "integrations" / "ok.py").write_text(patching)
    (pkg / "core" / "uses.py").write_text("def g():\n    from ..integrations import ok\n")
    found = patches_of_other_libraries(tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "deepspeed.initialize = ...", "setattr(deepspeed.zero, 'Init', new)",
        "torch.nn.Parameter.ds_status = ...", "nn.Parameter.ds_shape = ...",
        "Accelerator.get_state_dict = ...", "zero.GatheredParameters = ...",
        "del peft.LoraModel", "module.extract_model_from_parallel = ..."], found
    assert all(line.startswith(f"{PACKAGE}/core/bad.py:") for line in found)
    assert integrations_importers(tmp_path) == [
        f"{PACKAGE}/core/uses.py:2: {PACKAGE}.core.uses imports {PACKAGE}.integrations.ok"]


# -- the runtime core stays in pieces a reader can hold -------------------------------------------
# fsdp/ and shard/: no class over MAX_CLASS_LINES lines or MAX_ATTRIBUTES instance attributes
# (names assigned as `self.x = ...` anywhere in it), no function over MAX_FUNCTION_LINES lines
# of code (its docstring aside).
MAX_CLASS_LINES, MAX_ATTRIBUTES, MAX_FUNCTION_LINES = 350, 20, 60


def oversized(root: pathlib.Path = ROOT, packages=("fsdp", "shard")) -> list:
    """'file: what' for every class and function over the limits."""
    problems = []
    for package in packages:
        for path in sorted((root / PACKAGE / package).rglob("*.py")):
            where = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    lines = node.end_lineno - node.lineno + 1
                    attributes = {t.attr for t in ast.walk(node)
                                  if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                                  and isinstance(t.value, ast.Name) and t.value.id == "self"}
                    if lines > MAX_CLASS_LINES or len(attributes) > MAX_ATTRIBUTES:
                        problems.append(f"{where}: class {node.name}: {lines} lines, "
                                        f"{len(attributes)} attributes")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    doc = node.body[0]
                    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and \
                            isinstance(doc.value.value, str):
                        lines -= doc.end_lineno - doc.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        problems.append(f"{where}: {node.name}: {lines} lines of code")
    return problems


def test_no_class_or_function_of_the_runtime_core_outgrows_the_limits():
    assert not oversized(), oversized()


MAX_ENGINE_FUNCTION_LINES = 40  # initialize's stages and VeScaleEngine's methods: glue


def test_initialize_and_the_engine_methods_stay_short():
    engine = ROOT / PACKAGE / "engine" / "engine.py"
    long = []
    for node in ast.walk(ast.parse(engine.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0]
            start = doc.end_lineno + 1 if isinstance(doc, ast.Expr) and \
                isinstance(doc.value, ast.Constant) else doc.lineno
            if node.end_lineno - start + 1 > MAX_ENGINE_FUNCTION_LINES:
                long.append(f"{node.name}: {node.end_lineno - start + 1} lines of code")
    assert not long, long


def test_the_size_checker_counts_lines_attributes_and_code(tmp_path):
    pkg = tmp_path / PACKAGE / "fsdp"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "shard").mkdir()
    attributes = "".join(f"        self.a{i} = {i}\n" for i in range(MAX_ATTRIBUTES + 1))
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    doc = '    """' + "\n" * 30 + '    """\n'
    (pkg / "m.py").write_text("class Wide:\n    def __init__(self):\n" + attributes +
                              "def long():\n" + body + "def documented():\n" + doc +
                              body[:-len(f"    x{MAX_FUNCTION_LINES - 1} = "
                                         f"{MAX_FUNCTION_LINES - 1}\n")])
    assert oversized(tmp_path) == [
        f"{PACKAGE}/fsdp/m.py: class Wide: {MAX_ATTRIBUTES + 3} lines, "
        f"{MAX_ATTRIBUTES + 1} attributes",
        f"{PACKAGE}/fsdp/m.py: long: {MAX_FUNCTION_LINES + 1} lines of code"]
