"""The package's layers stay true: no import circle, and no import against the declared order.

The order is the table under "## Layers" in docs/architecture.md (its first fenced block): one
line per layer, lowest first, `layer: modules` (indented lines continue it), a module named by its dotted path under
`vescale_engine` (a package name covers everything inside it). A module may import from its own
layer and the layers below. Every import statement counts, at module level and inside functions;
only those under `if TYPE_CHECKING:` are exempt (type-only back references). A module the table
does not place, or a name in the table that is no module, is an error too.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


def _type_checking_nodes(tree) -> set:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for sub in ast.walk(node))
    return skip


def imports(modules: dict) -> list:
    """[(importer, imported, file, line)] for every import of a package module by another, at
    any depth of the file (functions included), except under TYPE_CHECKING."""
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
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
    TYPE_CHECKING back reference is not."""
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
        f"import circle: {PACKAGE}.low.a ({PACKAGE}/low/a.py:5) -> {PACKAGE}.low.b "
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
