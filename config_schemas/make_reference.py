"""Write docs/config_reference.md from the JSON Schema, so the reference cannot drift from the
keys the validator accepts. Every key gets its type, default, allowed values, description and
whether the engine acts on it (the schema's x-not-acted-on, inherited by nested keys); then
DeepSpeed's aliases (x-aliases) and the keys where Hugging Face fills in "auto" (x-hf-auto).

    python -m config_schemas.make_reference          # rewrite docs/config_reference.md
    python -m config_schemas.make_reference --check  # exit 1 if the committed file is stale
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .validate import SCHEMA_PATH, node_at, aliases, hf_auto, load_schema

REFERENCE_PATH = Path(__file__).resolve().parent.parent / "docs" / "config_reference.md"
COMMAND = "python -m config_schemas.make_reference"


def _resolve(node: dict) -> dict:
    """The node with a local $ref replaced by its definition; the node's own keywords (an
    x-not-acted-on or description next to the $ref) win over the definition's."""
    ref = node.get("$ref")
    if not ref:
        return node
    target = load_schema()["$defs"][ref.removeprefix("#/$defs/")]
    return {**target, **{k: v for k, v in node.items() if k != "$ref"}}


def _type(node: dict) -> str:
    if "enum" in node:
        kinds = sorted({type(v).__name__ for v in node["enum"]})
        return " or ".join({"str": "string", "int": "integer", "bool": "boolean",
                            "float": "number", "NoneType": "null"}.get(k, k)
                            for k in kinds)
    kind = node.get("type", "any")
    return " or ".join(kind) if isinstance(kind, list) else kind


def _allowed(node: dict) -> str:
    parts = []
    if "enum" in node:
        values = ", ".join(f"`{json.dumps(v)}`" for v in node["enum"])
        parts.append(values + (f" (only: {node['x-why']})" if "x-why" in node else ""))
    for word, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                       ("exclusiveMaximum", "<")):
        if word in node:
            parts.append(f"{sign} {node[word]}")
    if "pattern" in node:
        parts.append(node.get("x-expected", f"matches `{node['pattern']}`"))
    if node.get("type") == "array" and "items" in node:
        items = _resolve(node["items"])
        inner = _allowed(items)
        parts.append(f"list of {_type(items)}" + (f" ({inner})" if inner != "any" else "") +
                     (", unique" if node.get("uniqueItems") else ""))
    sizes = (node.get("minItems"), node.get("maxItems"))
    if sizes[0] is not None and sizes[0] == sizes[1]:
        parts.append(f"exactly {sizes[0]} items")
    elif any(n is not None for n in sizes):
        parts.append(" ".join(f"{w} {n} items" for w, n in zip(("at least", "at most"), sizes)
                              if n is not None))
    if "properties" in node:
        parts.append("the keys below")
    elif isinstance(node.get("additionalProperties"), dict):
        parts.append("names mapped to values as in the `<name>` row below")
    elif node.get("type") == "object" and "additionalProperties" not in node:
        parts.append("any keys")
    if "required" in node:
        parts.append("requires " + ", ".join(f"`{k}`" for k in node["required"]))
    return "; ".join(parts) or "any"


def _default(node: dict) -> str:
    return f"`{json.dumps(node['default'])}`" if "default" in node else "—"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _condition(branch: dict, path: str) -> str:
    """`if` of a conditional branch in words: "when `optimizer.type` is "Muon""."""
    words = []
    for key, test in branch.get("if", {}).get("properties", {}).items():
        values = [test["const"]] if "const" in test else test.get("enum", [])
        words.append(f"`{path}.{key}` is " + " or ".join(json.dumps(v) for v in values))
    return " and ".join(words)


def branches(node: dict, path: str):
    """(condition, schema) for each conditional part of `node` (allOf/anyOf/oneOf entries,
    with if/then/else): the keys they add apply only when the condition holds."""
    for keyword in ("allOf", "anyOf", "oneOf"):
        for branch in node.get(keyword, []):
            cond = _condition(branch, path)
            if "then" in branch:
                yield f"when {cond}", branch["then"]
            if "else" in branch:
                yield f"unless {cond}", branch["else"]
            if "if" not in branch:
                yield f"({keyword})", branch


def _rows(properties: dict, prefix: str, not_acted_on: str | None, condition: str = "") -> list:
    """One row per key, depth first, nested keys after their parent; keys that a condition
    adds (optimizer params per optimizer type, say) after the unconditional ones."""
    rows = []
    for name, raw in properties.items():
        node = _resolve(raw)
        path = f"{prefix}.{name}" if prefix else name
        why = node.get("x-not-acted-on") or not_acted_on
        rows.append((path, node, why, condition))
        rows += _rows(node.get("properties", {}), path, why, condition)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):  # a map from free-form names (e.g. glob patterns)
            rows.append((f"{path}.<name>", _resolve(extra), why, condition))
        for cond, branch in branches(node, path):
            both = f"{condition}, {cond}" if condition else cond
            rows += _rows(branch.get("properties", {}), path, why, both)
    return rows


def _auto_note(path: str, node: dict, why) -> str:
    """Where "auto" is accepted too, and what it means there."""
    if path in hf_auto():
        return '; or "auto" (Hugging Face fills it in: see below)'
    in_section = node_at(path.split("."))[2]
    if in_section and "x-deepspeed-default" in node:
        return f'; or "auto" (DeepSpeed\'s default, {json.dumps(node["x-deepspeed-default"])})'
    if in_section and why:
        return '; or "auto" (DeepSpeed\'s default)'
    return ""


def render() -> str:
    schema = load_schema()
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `config_schemas/{SCHEMA_PATH.name}` by `{COMMAND}`; do not edit by "
        "hand (tests/engine/test_docs.py fails when this file and the schema disagree).",
        "",
        schema.get("description", ""),
        "",
        "Validate a config with `vescale validate CONFIG.json` (exit status 2 on error). Keys "
        "marked *no* under **Acted on** are accepted so that DeepSpeed configs load unchanged, "
        "and are listed once, by name, when a config uses them. Values outside **Allowed** are "
        "errors, never silently ignored. **Default** is the schema's `default` where it states "
        "one; — means the schema states none (a description may name it; DeepSpeed's keys "
        "default as in DeepSpeed).",
        "",
    ]
    top = schema["properties"]
    scalar = {k: v for k, v in top.items() if "properties" not in _resolve(v)}
    sections = [("Top-level keys", scalar, "")] + [
        (f"`{k}`", {k: v}, "") for k, v in top.items() if k not in scalar]
    for title, props, prefix in sections:
        lines += [f"## {title}", "",
                  "| Key | Type | Default | Allowed | Acted on | Description |",
                  "|---|---|---|---|---|---|"]
        for path, node, why, condition in _rows(props, prefix, None):
            acted = f"no: {why}" if why else "yes"
            allowed = _allowed(node) + _auto_note(path, node, why)
            lines.append("| " + " | ".join(_cell(c) for c in (
                f"`{path}`" + (f" ({condition})" if condition else ""), _type(node),
                _default(node), allowed, acted, node.get("description", ""))) + " |")
        lines.append("")
    lines += [
        "## Aliases", "",
        "Names DeepSpeed also accepts. The validator reads each as its canonical key (what the "
        "engine and this reference use) and `vescale validate` lists it as `written (= "
        "canonical)`; giving both names with different values is an error naming both.", "",
        "| Written | Read as | Why |", "|---|---|---|"]
    for written, alias in aliases().items():
        lines.append(f"| `{written}` | `{alias['of']}` | {_cell(alias['why'])} |")
    lines += [
        "", "## Top-level keys not listed here", "",
        "DeepSpeed reads its config by name and ignores any other top-level key; so does the "
        "validator, with a warning naming the key (`vescale validate` prints `warning: "
        "ignored: ...` and exits 0; `initialize` logs it once, on rank 0). Examples in the "
        "wild: LLaMA-Factory's `comms_config` and `monitor_config`. Except, where ignoring it "
        "would train differently from what the config says:", "",
        "- a key one character (names of up to five characters) or two characters away from a "
        "top-level key the engine acts on is a misspelling (`gradient_acumulation_steps`): an "
        "error with the nearest name, since DeepSpeed would silently use the default;",
        "- a top-level key with a dot, as TRL's `prepare_deepspeed` writes "
        "(`\"zero_optimization.reduce_bucket_size\"`), is ignored as DeepSpeed ignores it (it "
        "reads a section's keys only inside the section), with a warning that gives the "
        "section's own value where it differs; if it names a key the engine acts on "
        "(`\"zero_optimization.stage\"`) and the section does not give the same value, it is "
        "an error: write it inside the section;",
        "- the keys below, which DeepSpeed reads, are errors:", "",
        "| Key | Why |", "|---|---|"]
    for key, why in schema["x-deepspeed-only"].items():
        lines.append(f"| `{key}` | {_cell(why)} |")
    lines += [
        "", '## "auto" values', "",
        'Hugging Face Trainer (`TrainingArguments(deepspeed=...)`) and Accelerate replace `"auto"` '
        "in these keys before they call `initialize`; `vescale validate` accepts it here and "
        'says who fills it in. An `"auto"` that reaches `initialize` unresolved (a script '
        "calling it itself) is an error naming the key and who would have filled it in, unless "
        'the engine does not act on the key. In `zero_optimization` an `"auto"` nobody fills in '
        "means DeepSpeed's default, as in DeepSpeed: accepted where the engine does not act on "
        "the key or where the reference states DeepSpeed's default (the **Allowed** column says "
        'so). Anywhere else `"auto"` is an error.', "",
        "| Key | Filled in from | A script calling initialize itself gives |", "|---|---|---|"]
    for path, auto in hf_auto().items():
        lines.append(f"| `{path}` | {_cell(auto['by'])} | {_cell(auto['value'])} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the file differs from the schema's")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = REFERENCE_PATH.read_text() if REFERENCE_PATH.exists() else ""
        if current != text:
            print(f"{REFERENCE_PATH} is out of date with the schema; regenerate it with "
                  f"`{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    REFERENCE_PATH.write_text(text)
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
