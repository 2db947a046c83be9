"""Validate a config against the JSON Schema, the single source of truth for accepted keys.

Every message names the JSON path, the bad value and what is allowed; a misspelt key gets the
nearest valid name. Keys the schema marks `x-not-acted-on` are accepted and reported once, by
name, with the reason. No torch import: `vescale validate` starts instantly.
"""
from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

SCHEMA_PATH = Path(__file__).with_name("vescale_config.schema.json")


class ConfigError(ValueError):
    """A config that does not validate; `messages` holds every problem, the text the first."""

    def __init__(self, messages):
        super().__init__(messages[0] if len(messages) == 1 else
                         f"{messages[0]} (and {len(messages) - 1} more problem(s))")
        self.messages = messages


@dataclass
class Report:
    errors: list = field(default_factory=list)
    not_acted_on: list = field(default_factory=list)  # "path (why)"


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _resolve(node: dict) -> dict:
    ref = node.get("$ref")
    if ref and ref.startswith("#/$defs/"):
        return load_schema()["$defs"][ref[len("#/$defs/"):]]
    return node


def _path(parts) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def _message(error) -> list:
    """One or more readable messages for one jsonschema error."""
    where = _path(error.absolute_path)
    schema, value = error.schema, error.instance
    kind = error.validator
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        out = []
        for key in sorted(set(value) - set(allowed)):
            near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else \
                f" (allowed here: {', '.join(allowed)})"
            out.append(f"{_path([*error.absolute_path, key])}: unknown key{hint}")
        return out
    if kind == "enum":
        allowed = ", ".join(_show(v) for v in error.validator_value)
        why = f"; {schema['x-why']}" if "x-why" in schema else ""
        return [f"{where}: {_show(value)} is not allowed (allowed: {allowed}){why}"]
    if kind == "type":
        return [f"{where}: expected {error.validator_value}, got {_show(value)}"]
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        word = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=",
                "exclusiveMaximum": "<"}[kind]
        return [f"{where}: {_show(value)} is out of range (must be {word} "
                f"{error.validator_value})"]
    if kind == "pattern":
        allowed = schema.get("x-expected", f"a match of {error.validator_value}")
        return [f"{where}: {_show(value)} is not valid (expected {allowed})"]
    if kind == "required":
        missing = [k for k in error.validator_value if k not in value]
        return [f"{where}: missing required key {_show(k)}" for k in missing]
    if kind == "uniqueItems":
        return [f"{where}: items must be unique, got {_show(value)}"]
    return [f"{where}: {error.message}"]


def _not_acted_on(config, schema, parts=()) -> list:
    found = []
    if not isinstance(config, dict):
        return found
    props = schema.get("properties", {})
    for key, value in config.items():
        node = props.get(key)
        if node is None:
            continue
        why = node.get("x-not-acted-on")
        node = _resolve(node)
        why = why or node.get("x-not-acted-on")
        if why:
            found.append(f"{_path([*parts, key])} ({why})")
        found += _not_acted_on(value, node, (*parts, key))
    return found


def check_config(config) -> Report:
    """Every problem with `config` (a dict), and the keys accepted but not acted on."""
    schema = load_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config),
                    key=lambda e: (_path(e.absolute_path), e.validator))
    messages = []
    for error in errors:
        for message in _message(error):
            if message not in messages:
                messages.append(message)
    return Report(messages, _not_acted_on(config, schema) if not messages else [])


def read_config(source) -> dict:
    """A config dict from a path or a dict; a one-line ConfigError for unreadable JSON."""
    if isinstance(source, dict):
        return source
    try:
        with open(source) as f:
            return json.load(f)
    except OSError as err:
        raise ConfigError([f"{source}: cannot read: {err.strerror}"]) from None
    except json.JSONDecodeError as err:
        raise ConfigError([f"{source}: not valid JSON: {err.msg} at line {err.lineno} "
                           f"column {err.colno}"]) from None


def validate_config(source) -> tuple:
    """(config, Report) for a path or dict; raises ConfigError naming every problem."""
    config = read_config(source)
    report = check_config(config)
    if report.errors:
        prefix = f"{source}: " if not isinstance(source, dict) else ""
        raise ConfigError([prefix + m for m in report.errors])
    return config, report
