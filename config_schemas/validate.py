"""Validate a config against the JSON Schema, the single source of truth for accepted keys.

Configs as users have them: DeepSpeed's aliases (the schema's `x-aliases`) are read as their
canonical key; `"auto"` is accepted where Hugging Face Trainer/Accelerate fill it in before
`initialize` (the schema's `x-hf-auto`, which says who fills it from what) and, as in DeepSpeed,
means DeepSpeed's default in zero_optimization keys nobody fills in (`_resolve_autos`). Then the
schema, then the checks no schema can say (contradictory precision, batch sizes no world size
can satisfy). Every message names the JSON path, the bad value and what is allowed; a misspelt
key gets the nearest valid name. Keys the schema marks `x-not-acted-on` are accepted and
reported once, by name, with the reason.

Top-level keys the schema does not list are treated as DeepSpeed treats them (`_top_level`):
DeepSpeed reads its config by name and ignores any other top-level key, so such a key is
ignored with a warning (LLaMA-Factory's `comms_config`, TRL's dotted
`"zero_optimization.reduce_bucket_size"`), except where ignoring it would silently train
differently from what the config says: a near-miss of a key the engine acts on (DeepSpeed
would train with that key's default), a dotted key naming a key the engine acts on, and the
keys DeepSpeed reads that we do not support (the schema's `x-deepspeed-only`) are errors. No
torch import: `vescale validate` starts instantly.
"""
from __future__ import annotations

import copy
import difflib
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

SCHEMA_PATH = Path(__file__).with_name("vescale_config.schema.json")
AUTO = "auto"
AUTO_LIST = 'the keys listed under "auto" in docs/config_reference.md'


class ConfigError(ValueError):
    """A config that does not validate; `messages` holds every problem, the text the first."""

    def __init__(self, messages):
        super().__init__(messages[0] if len(messages) == 1 else
                         f"{messages[0]} (and {len(messages) - 1} more problem(s))")
        self.messages = messages

    def __reduce__(self):  # pickled whole (a rank's error crossing to another process)
        return type(self), (self.messages,)


@dataclass
class Report:
    errors: list = field(default_factory=list)
    not_acted_on: list = field(default_factory=list)  # "path (why)"
    auto: list = field(default_factory=list)  # "path (who fills it in from what)"
    aliases: list = field(default_factory=list)  # "written (= canonical; why)"
    ignored: list = field(default_factory=list)  # "key (why)": top-level keys DeepSpeed ignores
    config: dict | None = None  # the config under canonical names (what the engine reads)


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def aliases() -> dict:
    """{written dotted path: {"of": canonical dotted path, "why": ...}}"""
    return load_schema()["x-aliases"]


def hf_auto() -> dict:
    """{dotted path: {"by": who fills "auto" in from what, "value": what a script must give}}"""
    return load_schema()["x-hf-auto"]


def _resolve(node: dict) -> dict:
    ref = node.get("$ref")
    if ref and ref.startswith("#/$defs/"):
        return load_schema()["$defs"][ref[len("#/$defs/"):]]
    return node


def _dotted(parts) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _show(value) -> str:
    return json.dumps(value, default=repr) if not isinstance(value, str) else repr(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _value_word(schema: dict) -> str:
    """What a script must write instead of "auto" for a key with this schema."""
    kind = schema.get("type")
    kinds = set(kind if isinstance(kind, list) else [kind])
    if kinds & {"number", "integer"}:
        return "a number"
    if "boolean" in kinds:
        return "true or false"
    if "array" in kinds:
        return "a list"
    return "a value"


class _Names:
    """Paths as the user wrote them: a key read under its canonical name is shown as written."""

    def __init__(self, renamed: dict):
        self.renamed = renamed  # canonical dotted path -> written dotted path

    def path(self, parts) -> str:
        text = _dotted(parts)
        for canonical, written in self.renamed.items():
            if text == canonical or text.startswith(canonical + ".") or \
                    text.startswith(canonical + "["):
                return written + text[len(canonical):]
        return text or "(top level)"

    def entry(self, parts, note: str) -> str:
        """A report entry naming the canonical key, and the written one if it differs."""
        text = _dotted(parts)
        written = self.path(parts)
        return f"{written} (= {text}) ({note})" if written != text else f"{text} ({note})"


def _parent(config, dotted: str):
    """(the dict holding the last key of `dotted`, that key), or (None, key)."""
    *parents, key = dotted.split(".")
    node = config
    for name in parents:
        node = node.get(name) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), key


def canonical_config(config: dict):
    """(copy of `config` under canonical names, {canonical: written path}, alias notes, errors).

    DeepSpeed accepts a setting under either name; giving both with different values is an
    error naming both."""
    config = copy.deepcopy(config)
    renamed, notes, errors = {}, [], []
    for written, alias in aliases().items():
        parent, key = _parent(config, written)
        if parent is None or key not in parent:
            continue
        canonical = alias["of"]
        canonical_key = canonical.rsplit(".", 1)[-1]
        value = parent.pop(key)
        if canonical_key in parent:
            if parent[canonical_key] != value:
                errors.append(f"{written} {_show(value)} and {canonical} "
                              f"{_show(parent[canonical_key])} are one setting (DeepSpeed reads "
                              f"{written} as {canonical}) with different values: keep one")
            notes.append(f"{written} (= {canonical}; {alias['why']})")
            continue
        parent[canonical_key] = value
        renamed[canonical] = written
        notes.append(f"{written} (= {canonical}; {alias['why']})")
    _booleans_from_integers(config, load_schema(), (), notes)
    opt = config.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("type"), str):
        node = load_schema()["properties"]["optimizer"]["properties"]["type"]
        names = {n.lower(): n for n in node.get("x-case-insensitive", [])}
        name = names.get(opt["type"].lower())
        if name and name != opt["type"]:
            notes.append(f"optimizer.type {_show(opt['type'])} (= {_show(name)}; DeepSpeed's "
                         "optimizer names are case-insensitive)")
            opt["type"] = name
    return config, renamed, notes, errors


def _booleans_from_integers(config: dict, schema: dict, parts: tuple, notes: list) -> None:
    """DeepSpeed reads its flags with Python's truth (or pydantic's, which takes 0 and 1):
    `"zero_allow_untested_optimizer": 1` is true there. 0 and 1 where the schema wants a
    boolean become false and true, each noted. Not in the "vescale" section, which DeepSpeed
    does not read: there a flag is a boolean."""
    properties = _resolve(schema).get("properties", {})
    for key, value in list(config.items()):
        node = properties.get(key)
        if node is None or (not parts and key == "vescale"):
            continue
        node = _resolve(node)
        if isinstance(value, dict):
            _booleans_from_integers(value, node, (*parts, key), notes)
        elif node.get("type") == "boolean" and type(value) is int and value in (0, 1):
            config[key] = bool(value)
            notes.append(f"{_dotted((*parts, key))} {value} (= {str(bool(value)).lower()}; "
                         "DeepSpeed reads 0 and 1 as booleans)")


def _distance(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions."""
    row = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, other in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1,
                                           previous + (char != other))
    return row[-1]


def _acted_on_top_level() -> dict:
    """{name a config may write at the top level: canonical key} for the top-level keys the
    engine acts on (schema properties without x-not-acted-on), their aliases included."""
    props = load_schema()["properties"]
    acted = {k: k for k, node in props.items()
             if not (node.get("x-not-acted-on") or _resolve(node).get("x-not-acted-on"))}
    acted.update({w: a["of"] for w, a in aliases().items()
                  if "." not in w and a["of"] in acted})
    return acted


def _near_miss(key: str):
    """The acted-on top-level key `key` misspells (one character away for names of up to five
    characters, two for longer ones), or None."""
    for name in _acted_on_top_level():
        if _distance(key.lower(), name.lower()) <= (1 if len(name) <= 5 else 2):
            return name
    return None


def _at(config, parts):
    """(True, value) at `parts` inside `config`, or (False, None)."""
    node = config
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _dotted_key(config, key: str, value):
    """("ignored", why) or ("error", message) for a top-level key with a dot, like TRL's
    "zero_optimization.reduce_bucket_size". DeepSpeed reads a section's keys only inside the
    section, so it ignores such a key; so do we, unless the key is one the engine acts on and
    the section does not already say the same (then the config does not mean what it says)."""
    alias = aliases().get(key)  # a dotted alias names its canonical key
    parts = (alias["of"] if alias else key).split(".")
    section = parts[0]
    node, why, _ = node_at(parts)
    found, inside = _at(config, parts)
    if node is None:
        return "ignored", f"top-level key with a dot: ignored, as in DeepSpeed; {section} " \
                          f"has no key {parts[-1]} either"
    if why:
        note = f"; {section} itself gives {_show(inside)}" if found and inside != value else ""
        return "ignored", f"top-level key with a dot: ignored, as in DeepSpeed, which reads " \
                          f"{parts[-1]} only inside {section}; not acted on there either: " \
                          f"{why}{note}"
    if found and inside == value:
        return "ignored", f"top-level key with a dot: ignored, as in DeepSpeed, which reads " \
                          f"{parts[-1]} only inside {section}, where it has the same value"
    said = f"uses {section}'s own {_show(inside)}" if found else "trains with the default"
    return "error", (f"{key}: DeepSpeed ignores a top-level key with a dot (it reads "
                     f"{parts[-1]} only inside {section}, so it {said}); write {parts[-1]} "
                     f"inside {section}")


def _top_level(config: dict):
    """Split the top-level keys the schema does not list into (ignored entries, errors) and
    remove the ignored ones from `config` (canonical names, edited in place). Keys left in
    get the schema's "unknown key; did you mean" message."""
    schema = load_schema()
    known = set(schema["properties"])
    ignored, errors = [], []
    for key in [k for k in config if k not in known]:
        if key in schema["x-deepspeed-only"]:
            errors.append(f"{key}: not supported: {schema['x-deepspeed-only'][key]}; "
                          "remove it")
            config.pop(key)
        elif "." in key and key.split(".", 1)[0] in known:
            kind, text = _dotted_key(config, key, config[key])
            if kind == "error":
                errors.append(text)
            else:
                ignored.append(f"{key} ({text})")
            config.pop(key)
        elif _near_miss(key) is None:
            ignored.append(f"{key} (unknown top-level key: ignored, as DeepSpeed ignores "
                           "top-level keys it does not read)")
            config.pop(key)
    return ignored, errors


def _auto_paths(config, parts=()):
    """Every path whose value is the string "auto"."""
    if isinstance(config, dict):
        for key, value in config.items():
            yield from _auto_paths(value, (*parts, key))
    elif config == AUTO:
        yield parts


def _message(error, names: _Names, aliases_here) -> list:
    """One or more readable messages for one jsonschema error."""
    where = names.path(error.absolute_path)
    schema, value = error.schema, error.instance
    kind = error.validator
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        out = []
        for key in sorted(set(value) - set(allowed)):
            near = difflib.get_close_matches(key, allowed + aliases_here(error.absolute_path),
                                             n=1, cutoff=0.6)
            if not error.absolute_path and _near_miss(key):  # the misspelling _top_level kept
                near = [_near_miss(key)]
            hint = f"; did you mean {near[0]!r}?" if near else \
                f" (allowed here: {', '.join(allowed)})"
            out.append(f"{names.path([*error.absolute_path, key])}: unknown key{hint}")
        return out
    if value == AUTO and kind in ("type", "enum", "const", "pattern"):
        return [f'{where}: "auto" is not filled in here: Hugging Face Trainer and Accelerate '
                f"replace \"auto\" only in {AUTO_LIST}; give {_value_word(schema)}"]
    if kind == "enum":
        allowed = ", ".join(_show(v) for v in error.validator_value)
        why = f"; {schema['x-why']}" if "x-why" in schema else ""
        return [f"{where}: {_show(value)} is not allowed (allowed: {allowed}){why}"]
    if kind == "type":
        kinds = error.validator_value
        expected = " or ".join(kinds) if isinstance(kinds, list) else kinds
        hint = ""
        if isinstance(value, str) and {"number", "integer"} & set(
                kinds if isinstance(kinds, list) else [kinds]):
            try:
                float(value)
                hint = " (a string: write the number without quotes)"
            except ValueError:
                pass
        return [f"{where}: expected {expected}, got {_show(value)}{hint}"]
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        word = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=",
                "exclusiveMaximum": "<"}[kind]
        why = f"; {schema['x-why']}" if "x-why" in schema else ""
        return [f"{where}: {_show(value)} is out of range (must be {word} "
                f"{error.validator_value}){why}"]
    if kind in ("minItems", "maxItems"):
        low, high = schema.get("minItems"), schema.get("maxItems")
        want = f"exactly {low}" if low == high else \
            (f"at least {low}" if kind == "minItems" else f"at most {high}")
        return [f"{where}: expected {want} items, got {len(value)}: {_show(value)}"]
    if kind == "pattern":
        allowed = schema.get("x-expected", f"a match of {error.validator_value}")
        return [f"{where}: {_show(value)} is not valid (expected {allowed})"]
    if kind == "required":
        missing = [k for k in error.validator_value if k not in value]
        return [f"{where}: missing required key {_show(k)}" for k in missing]
    if kind == "uniqueItems":
        return [f"{where}: items must be unique, got {_show(value)}"]
    return [f"{where}: {error.message}"]


def _not_acted_on(config, schema, names: _Names, parts=()) -> list:
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
            found.append(names.entry((*parts, key), why))
        found += _not_acted_on(value, node, names, (*parts, key))
    return found


def _optimizer_errors(opt) -> list:
    """DeepSpeed's type "Adam" is AdamW (decoupled weight decay) unless adam_w_mode is false:
    torch.optim.Adam's own switches apply only then."""
    if not isinstance(opt, dict) or opt.get("type") != "Adam":
        return []
    params = opt.get("params") or {}
    if params.get("adam_w_mode", True) is False:
        return []
    own = load_schema()["properties"]["optimizer"]["allOf"]
    adamw = next(b["then"]["properties"]["params"]["properties"] for b in own
                 if b["if"]["properties"]["type"]["const"] == "AdamW")
    return [f"optimizer.params.{key}: type \"Adam\" runs AdamW here, as in DeepSpeed "
            "(adam_w_mode defaults to true), which does not take it; set adam_w_mode false for "
            "torch.optim.Adam" for key in params if key not in adamw]


def _batch_errors(config) -> list:
    """train_batch_size = micro-batch x accumulation x data-parallel ranks: the keys given must
    leave some number of ranks that makes it true."""
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    whole = [isinstance(v, int) and not isinstance(v, bool) for v in (total, micro, accum)]
    if not whole[0] or not (whole[1] or whole[2]):
        return []
    if whole[1] and whole[2]:
        per, text = micro * accum, (f"train_micro_batch_size_per_gpu {micro} x "
                                    f"gradient_accumulation_steps {accum} = {micro * accum}")
    elif whole[1]:
        per, text = micro, f"train_micro_batch_size_per_gpu {micro}"
    else:
        per, text = accum, f"gradient_accumulation_steps {accum}"
    if total % per == 0:
        return []
    return [f"train_batch_size {total} is not a multiple of {text}: no number of data-parallel "
            "ranks satisfies train_batch_size = micro-batch x accumulation x ranks"]


def _semantic_errors(config) -> list:
    """What a schema cannot say: checked once the types are right."""
    errors = []
    steps = config.get("steps_per_print")
    if _is_number(steps) and steps != math.inf and not float(steps).is_integer():
        errors.append(f"steps_per_print: {_show(steps)} is not a whole number (Infinity: never "
                      "print)")
    fp16 = config.get("fp16", {}).get("enabled") is True
    if fp16 and config.get("bf16", {}).get("enabled") is True:
        errors.append("fp16.enabled and bf16.enabled are both true: choose one")
    dtype = config.get("vescale", {}).get("mixed_precision", {}).get("param_dtype")
    if fp16 and dtype not in (None, "fp16", "float16"):
        errors.append(f"fp16.enabled computes in float16, but vescale.mixed_precision."
                      f"param_dtype is {dtype!r}: drop one of them")
    errors += _batch_errors(config)
    errors += _optimizer_errors(config.get("optimizer"))
    if config.get("managed_gradient_accumulation") is False and \
            config.get("vescale", {}).get("local_grad_accumulation") is True:
        errors.append("vescale.local_grad_accumulation needs managed_gradient_accumulation "
                      "true: with false the caller's step() ends the accumulation, so no "
                      "backward knows it is the last one, which must reduce")
    return errors


def offload_param_below_stage_3(zero) -> str | None:
    """Why offload_param with device "cpu" is not acted on, when ZeRO's stage is below 3
    (DeepSpeed reads it at stage 3 only: public stage-2 configs set it); else None."""
    param = zero.get("offload_param") if isinstance(zero, dict) else None
    stage = zero.get("stage", 3) if isinstance(zero, dict) else 3
    if not isinstance(param, dict) or param.get("device") != "cpu" or stage == 3:
        return None
    return (f"zero_optimization.offload_param (read at ZeRO stage 3 only, as DeepSpeed does; "
            f"zero_optimization.stage is {_show(stage)}: parameters are not sharded)")


def offload_param_alone(zero) -> str | None:
    """What offload_param with device "cpu" at stage 3 does without offload_optimizer, when
    it moves nothing (initialize offloads the shards when there is no optimizer at all); else
    None."""
    param = zero.get("offload_param") if isinstance(zero, dict) else None
    if not isinstance(param, dict) or param.get("device") != "cpu" or \
            offload_param_below_stage_3(zero):
        return None
    optimizer = zero.get("offload_optimizer") or {}
    if isinstance(optimizer, dict) and optimizer.get("device") in ("cpu", "auto"):
        return None
    return ("zero_optimization.offload_param without offload_optimizer (DeepSpeed then moves "
            "only its 16-bit copy of the parameter shards to host memory, keeping the fp32 "
            "master, gradients and optimizer state on the device; the engine keeps no 16-bit "
            "copy, all-gather casts the fp32 master shard, so the device holds what "
            "DeepSpeed's does and nothing moves. Without any optimizer, where DeepSpeed's "
            "16-bit copy is all there is, initialize keeps the shards in host memory. Add "
            "offload_optimizer with device \"cpu\" to move the master and optimizer state)")


def node_at(parts):
    """(schema node, inherited x-not-acted-on reason, inside a section where DeepSpeed reads
    "auto" as its default) for a canonical key path; node None if the schema has no such key."""
    node, why, auto_default = load_schema(), None, False
    for part in parts:
        child = node.get("properties", {}).get(part) if isinstance(part, str) else None
        if child is None:
            return None, why, auto_default
        why = child.get("x-not-acted-on") or why
        node = _resolve(child)
        why = node.get("x-not-acted-on") or why
        auto_default = auto_default or node.get("x-auto-is-default", False)
    return node, why, auto_default


def _resolve_autos(config, names: _Names, allow_auto):
    """Decide every "auto" in `config` (canonical names; may be edited in place). Returns
    (paths the schema must not judge, report lines, errors).

    Where Hugging Face fills "auto" in (under the canonical name only: it looks for that),
    `vescale validate` accepts it and says who; at initialize it is an error on a key we act on
    (a script calling initialize itself must give a value). Elsewhere in a section DeepSpeed
    reads through its own config models (zero_optimization), DeepSpeed reads "auto" as its
    default: accepted on a key we do not act on, replaced by DeepSpeed's default where the
    schema states it, an error otherwise. Anywhere else the schema decides."""
    skip, lines, errors = set(), [], []
    for parts in list(_auto_paths(config)):
        dotted = _dotted(parts)
        node, why, auto_default = node_at(parts)
        written_as_alias = names.path(parts) != dotted
        filled = None if written_as_alias else hf_auto().get(dotted)
        if filled and (allow_auto or why):
            skip.add(tuple(parts))
            lines.append(names.entry(parts, f"filled in by Hugging Face {filled['by']}"
                                     + ("; not acted on" if why else "")))
        elif filled:
            skip.add(tuple(parts))
            errors.append(f'{dotted}: "auto" is filled in by Hugging Face ({filled["by"]}) '
                          "before initialize; a script calling initialize itself must give "
                          f"{filled['value']}")
        elif node is not None and auto_default and "x-deepspeed-default" in node:
            parent, key = _parent(config, dotted)
            parent[key] = node["x-deepspeed-default"]
            lines.append(names.entry(parts, "DeepSpeed reads it as its default, "
                                            f"{_show(node['x-deepspeed-default'])}"))
        elif node is not None and auto_default and why:
            skip.add(tuple(parts))
            lines.append(names.entry(parts, "DeepSpeed reads it as its default; not acted on"))
    return skip, lines, errors


def check_config(config, allow_auto: bool = True) -> Report:
    """Every problem with `config` (a dict), the keys accepted but not acted on, the aliases
    read as canonical names and the "auto" values and what they mean. With `allow_auto=False`
    (initialize) an "auto" that Hugging Face fills in is an error on a key we act on."""
    schema = load_schema()
    if not isinstance(config, dict):
        return Report([f"(top level): expected object, got {_show(config)}"])
    canonical, renamed, notes, messages = canonical_config(config)
    ignored, top_errors = _top_level(canonical)
    messages += top_errors
    names = _Names(renamed)
    skip, auto, auto_errors = _resolve_autos(canonical, names, allow_auto)
    messages += auto_errors

    def aliases_here(parts):
        prefix = _dotted(parts)
        return [w.rsplit(".", 1)[-1] for w in aliases()
                if w.rsplit(".", 1)[0] == prefix or (not prefix and "." not in w)]

    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(canonical),
                    key=lambda e: (_dotted(e.absolute_path), e.validator))
    schema_messages = []
    for error in errors:
        if tuple(error.absolute_path) in skip and error.instance == AUTO:
            continue  # decided above
        for message in _message(error, names, aliases_here):
            if message not in schema_messages:
                schema_messages.append(message)
    messages += schema_messages
    if not messages:
        messages = _semantic_errors(canonical)
    if messages:
        return Report(messages, aliases=notes, ignored=ignored)
    not_acted_on = _not_acted_on(canonical, schema, names)
    for offload in (offload_param_below_stage_3, offload_param_alone):
        why = offload(canonical.get("zero_optimization"))
        if why:
            not_acted_on.append(why)
    return Report([], not_acted_on, auto, notes, ignored, canonical)


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


def validate_config(source, allow_auto: bool = True) -> tuple:
    """(config under canonical names, Report) for a path or dict; raises ConfigError naming
    every problem. initialize passes allow_auto=False: "auto" must be resolved by then."""
    config = read_config(source)
    report = check_config(config, allow_auto)
    if report.errors:
        prefix = f"{source}: " if not isinstance(source, dict) else ""
        raise ConfigError([prefix + m for m in report.errors])
    return report.config, report
