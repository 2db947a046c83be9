"""Hugging Face models that transformers builds for a ZeRO-3 config with a "vescale" section.

With a stage-3 config in play (TrainingArguments(deepspeed=...), HfDeepSpeedConfig,
Accelerate's DeepSpeed plugin) transformers builds every model inside `deepspeed.zero.Init`,
which a vescale section turns into a build on the meta device (../deepspeed/zero_init.py).
Where DeepSpeed would then gather each partition to write rank 0's values into it, these steps only record,
and `initialize` does the work after wrapping, each rank holding its shard plus one module:

- `from_pretrained` (PreTrainedModel._load_pretrained_model) reads no weights. It matches the
  checkpoint's keys to the model's from the safetensors headers alone (transformers' key
  renames and base-model prefix applied; a shape mismatch fails in its loading report, as
  always) and records the resolved files and the key map (`PretrainedWeights`). `initialize`
  loads each rank's own bytes (`checkpoint.hf.load_into`).
- What the checkpoint lacks (PreTrainedModel._initialize_missing_keys), and everything for
  `from_config` (integrations.deepspeed.initialize_weights_zero3), is initialized by
  `initialize` with the walk transformers' `initialize_weights` makes (each module's
  `_init_weights`, children first, loaded tensors skipped), one module at a time, from the
  generator state the build started from: the values a one-process `from_pretrained` gives,
  and DeepSpeed's `from_config` (no `reset_parameters` draws: transformers builds under
  `no_init_weights`).

Those three are transformers' private names: this package's __init__.py
replaces them (checking them, and the loading helpers used here, against the installed
version) and calls the functions here; nothing here imports transformers first.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from ...checkpoint.hf import checkpoint_files, load_into, read_stored
from ...fsdp.deferred import replayed_generator
from ...fsdp.materialize import allocate_shards, init_unloaded
from ...fsdp.param import sharding_of
from ...versions import supported_range

__all__ = ["SOURCE", "CheckpointRecord", "PretrainedWeights", "record_checkpoint",
           "prepare_transformers_weights", "init_like_transformers"]

SOURCE = "_vescale_checkpoint_keys"  # module attribute: its CheckpointRecord


class CheckpointRecord:
    """On each module from_pretrained built on meta: the checkpoint key of each of its own
    tensors (None: not in the checkpoint, transformers' init gives it). Kept on the module, not
    by name, so it holds wherever the module ends up (PEFT wraps a targeted Linear as
    `base_layer` under `base_model.model.`); a deepcopy of the module (PEFT's modules_to_save)
    carries it with `source` still the original, whose values the copy takes."""

    def __init__(self, source, keys):
        self.source, self.keys = source, keys

    def __deepcopy__(self, memo):
        return CheckpointRecord(self.source, dict(self.keys))


@dataclass(frozen=True)
class PretrainedWeights:
    """What `from_pretrained` resolved, for `initialize` to load."""
    source: str          # what from_pretrained was given (a directory or a hub name)
    files: tuple         # the local .safetensors files
    key_map: dict        # checkpoint key -> the model's name for it (state_dict names)
    dtype: torch.dtype   # the dtype the model was built in (from_pretrained's dtype=)


# -- from_pretrained ----------------------------------------------------------------------------

def record_checkpoint(model, record, state_dict, checkpoint_files, load_config):
    """In place of transformers' `_load_pretrained_model` for a model built on meta: check
    the checkpoint against the model from its headers, record it, and return the loading
    report transformers finishes with (missing keys are initialized at `initialize`)."""
    from transformers.utils.loading_report import LoadStateDictInfo

    where = f"from_pretrained({load_config.pretrained_model_name_or_path!r}) under a vescale " \
            "config"
    unsupported = [name for name, value in (
        ("state_dict=", state_dict), ("quantization", load_config.hf_quantizer),
        ("device_map=", load_config.device_map), ("tp_plan=", load_config.device_mesh))
        if value is not None]
    if unsupported:
        raise ValueError(f"{where}: {unsupported[0]} is not supported (initialize loads each "
                         "rank's shard from the checkpoint's safetensors files)")
    files = list(checkpoint_files or [])
    if not files:
        raise ValueError(f"{where}: found no weight files to load")
    other = [f for f in files if not f.endswith(".safetensors")]
    if other:
        raise ValueError(f"{where}: {os.path.basename(other[0])} is not a safetensors file, and "
                         "each rank reads its own bytes from safetensors only; convert the "
                         "checkpoint once: from_pretrained without the vescale section, then "
                         "save_pretrained(directory)")
    stored, _, _ = read_stored(files)  # headers only
    key_map, unexpected, mismatched = _match_keys(model, stored, load_config)
    kept_fp32 = _kept_in_fp32(load_config, key_map.values())
    if kept_fp32:
        raise ValueError(f"{where}: {kept_fp32} is kept in float32 (_keep_in_fp32_modules), "
                         "which this loader does not do; load with dtype=torch.float32")
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in key_map.values():  # as transformers marks what it loaded
        if name in params:
            params[name]._is_hf_initialized = True
    _record_on_modules(model, key_map)
    record.builder, record.root = "from_pretrained", model
    record.pretrained = PretrainedWeights(str(load_config.pretrained_model_name_or_path),
                                          tuple(files), key_map, _dtype_of(model))
    missing = set(model.state_dict()) - set(key_map.values()) - {k for k, *_ in mismatched}
    report = dict(missing_keys=missing, unexpected_keys=unexpected, mismatched_keys=mismatched,
                  error_msgs=[], conversion_errors={})
    # skipped_pp_keys (pipeline-parallel keys not loaded) came after 5.6: none are skipped here
    if "skipped_pp_keys" in {f.name for f in dataclasses.fields(LoadStateDictInfo)}:
        report["skipped_pp_keys"] = set()
    return LoadStateDictInfo(**report)


def _record_on_modules(model, key_map) -> None:
    """A CheckpointRecord on every module owning a meta tensor (see the class)."""
    key_of = {name: key for key, name in key_map.items()}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        keys = {attr: key_of.get(f"{prefix}.{attr}" if prefix else attr)
                for attr, t in (*mod._parameters.items(), *mod._buffers.items())
                if t is not None and t.is_meta}
        record = mod.__dict__.get(SOURCE)
        if record is not None:  # a module reached under two names: any name with a key
            keys = {a: keys.get(a) or record.keys.get(a) for a in {*keys, *record.keys}}
        if keys:
            mod.__dict__[SOURCE] = CheckpointRecord(mod, keys)


def _match_keys(model, stored, load_config) -> tuple[dict, set, set]:
    """({checkpoint key: model name}, unexpected names, {(name, file shape, model shape)}),
    renaming each key as transformers' loader does (its renames, then the base-model prefix
    added or dropped). A key that needs one of its conversions (merging or splitting tensors)
    is an error: those need the whole tensors."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    expected = model.state_dict()
    prefix = model.base_model_prefix
    key_map, unexpected, mismatched, source_of = {}, set(), set(), {}
    for key in sorted(stored):
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if name not in expected and key in expected:  # as transformers: the prefix only
            name, pattern = rename_source_key(key, [], [], prefix, expected)
        if name not in expected:
            unexpected.add(name)
            continue
        if pattern is not None:  # a converter's source pattern matched
            raise ValueError(f"from_pretrained under a vescale config: checkpoint key {key} "
                             f"({pattern!r}) needs one of transformers' weight conversions "
                             f"into {name}, which work on whole tensors; convert the "
                             "checkpoint once (from_pretrained without the vescale section, "
                             "then save_pretrained(directory, save_original_format=False))")
        if name in source_of:
            raise ValueError(f"from_pretrained under a vescale config: checkpoint keys "
                             f"{source_of[name]} and {key} both give {name}")
        source_of[name] = key
        file_shape, model_shape = tuple(stored[key].shape), tuple(expected[name].shape)
        if file_shape != model_shape:
            mismatched.add((name, torch.Size(file_shape), torch.Size(model_shape)))
            continue
        key_map[key] = name
    model._weight_conversions = [m for m in mapping if m.was_used()]  # for save_pretrained
    return key_map, unexpected, mismatched


def _kept_in_fp32(load_config, names) -> str | None:
    """A loaded name transformers would keep in float32 (its dtype_plan), if any."""
    plan = load_config.dtype_plan or {}
    if not plan:
        return None
    from transformers.core_model_loading import build_glob_alternation
    pattern = build_glob_alternation(list(plan))[0]
    return next((name for name in sorted(names) if pattern.search(name)), None)


def _dtype_of(model) -> torch.dtype:
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.get_default_dtype()


# -- initialize ---------------------------------------------------------------------------------

def prepare_transformers_weights(module: nn.Module, record, cfg, device) -> None:
    """`engine/weights.py`'s prepare_weights for a model transformers built under a vescale config:
    load the checkpoint from_pretrained recorded (what it lacks initialized as transformers
    would), or run from_config's init."""
    root = record.root
    if root is None:
        step = "_load_pretrained_model" if record.builder == "from_pretrained" else \
            "initialize_weights_zero3"
        raise RuntimeError(f"{record.builder} built {type(module).__name__} under a vescale "
                           f"config, but transformers did not call {step}, the step vescale "
                           f"takes over (supported: transformers"
                           f"{supported_range('transformers')}): its weights are unknown, so "
                           "initialize stops rather than train random ones")
    _prefix_of(root, module)  # the whole model, not a part of it
    init_missing = functools.partial(init_like_transformers, record=record, device=device)
    pretrained, given = record.pretrained, cfg.checkpointing.hf_checkpoint
    if pretrained is not None:
        if given and not _same_checkpoint(given, pretrained.files):
            raise ValueError(f"vescale.hf_checkpoint {given!r} and from_pretrained("
                             f"{pretrained.source!r}) name different weights for the model: "
                             "keep one")
        names, to_init = _sources(module)

        def init_recorded(mod, unloaded):  # the others are given (real at wrap) or loaded
            init_missing(mod, [n for n in unloaded if n in to_init])
        # checkpoint keys from_pretrained did not map (unexpected, mismatched) stay unloaded
        record.loaded = load_into(module, list(pretrained.files), strict=False,
                                  key_map=lambda key: names.get(key, f"{key} (not loaded)"),
                                  device=device, init_missing=init_recorded)
    elif given:
        record.loaded = load_into(module, given, device=device,
                                  init_missing=init_missing)
    else:  # from_config: everything, as DeepSpeed's initialize_weights_zero3 would
        names = [name for name, p in module.named_parameters(remove_duplicate=False)
                 if sharding_of(p) is None or p._vescale.initial is None] + \
            [name for name, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
        allocate_shards(module, device)
        init_missing(module, names)


def _pending_tensors(module) -> list:
    """[(names, [(module, attribute)])] of every tensor under `module` still waiting for a
    value: on meta, and not a parameter whose unit keeps the value it had at wrap time."""
    groups = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for attr, t in (*mod._parameters.items(), *mod._buffers.items()):
            if t is None or not t.is_meta or \
                    getattr(sharding_of(t), "initial", None) is not None:
                continue
            names, where = groups.setdefault(id(t), ([], []))
            names.append(f"{prefix}.{attr}" if prefix else attr)
            where.append((mod, attr))
    return list(groups.values())


def _sources(module) -> tuple[dict, set]:
    """({checkpoint key: model name(s)}, names transformers' init gives) for the tensors still
    on meta after wrapping, from the modules' CheckpointRecords: a copy's tensor loads its
    original's key. A tensor that no record covers (made on meta after from_pretrained), or a
    copy of one that transformers' init gives, is an error naming it."""
    loads, to_init = {}, set()
    for names, where in _pending_tensors(module):
        entries = [(mod, rec, rec.keys[attr]) for mod, attr in where
                   if (rec := mod.__dict__.get(SOURCE)) is not None and attr in rec.keys]
        keys = [key for _, _, key in entries if key is not None]
        if keys:
            loads.setdefault(keys[0], []).append(names[0])
        elif any(rec.source is mod for mod, rec, _ in entries):
            to_init.update(names)
        elif entries:
            raise ValueError(
                f"initialize: {names[0]} is a copy (made after from_pretrained, as PEFT's "
                "modules_to_save makes) of a tensor the checkpoint does not hold, which "
                "transformers' init gives at initialize: the copy cannot get the same values; "
                "put that module in the checkpoint (save_pretrained once) or leave it out of "
                "modules_to_save")
        else:
            owner = type(where[0][0]).__name__
            hint = " (PEFT adapters: import peft before from_pretrained, so that vescale "                 "keeps them real)" if "lora_" in names[0] else ""
            raise ValueError(
                f"initialize: {names[0]} ({owner}) is on the meta device with no known value: "
                "it was made on meta after from_pretrained, so its values never existed; "
                f"create it on a real device (its values are kept){hint}")
    return {key: tuple(names) for key, names in loads.items()}, to_init


def init_like_transformers(module: nn.Module, names, *, record, device) -> None:
    """Initialize the parameters and buffers `names` (after `allocate_shards`) as transformers'
    `initialize_weights` would with every other tensor loaded: each module's `_init_weights`
    (dispatched as its `smart_apply` does: the nearest PreTrainedModel's), children first,
    on the modules owning those tensors and their ancestors, with the loaded tensors marked
    `_is_hf_initialized` so that transformers' guarded init functions skip them (drawing
    nothing), from the generator state the build started from (../deepspeed/zero_init.py)."""
    from transformers.initialization import guard_torch_init_functions
    from transformers.modeling_utils import PreTrainedModel

    pending = _registrations(module, names)
    owner_of, outer = {}, None

    def visit(mod, owner):
        nonlocal outer
        if isinstance(mod, PreTrainedModel):
            owner, outer = mod, outer or mod
        owner_of.setdefault(id(mod), owner)
        for child in mod.children():
            visit(child, owner)
    visit(module, None)
    custom = _custom_code(outer) if outer is not None else False

    def init_fn(mod):
        for sub in mod.modules():
            for attr, tensor in (*sub._parameters.items(), *sub._buffers.items()):
                if tensor is not None and (id(sub), attr) not in pending:
                    tensor._is_hf_initialized = True  # loaded (or another module's to write)
        owner = owner_of.get(id(mod))
        if owner is not None:
            owner._initialize_weights(mod, custom)

    with replayed_generator(record, device), guard_torch_init_functions():
        init_unloaded(module, names, init_fn=init_fn, ancestors=True)


def _custom_code(model) -> bool:
    """The flag transformers' own `initialize_weights` passes to `_initialize_weights`: newer
    releases pass `is_custom_code()` (hub code or a class defined outside transformers), 5.6
    passes `is_remote_code()` (hub code only) and has no `is_custom_code`."""
    test = getattr(model, "is_custom_code", None) or model.is_remote_code
    return test()


def _registrations(module, names) -> set:
    """{(id(module), attribute)} of every registration of the tensors `names` name (a tied
    parameter is registered under several modules)."""
    groups = {}
    for name, tensor in (*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(tensor), []).append(name)
    wanted, out = set(names), set()
    for group in groups.values():
        if wanted.intersection(group):
            for name in group:
                owner, _, attr = name.rpartition(".")
                out.add((id(module.get_submodule(owner)), attr))
    return out


def _prefix_of(root, module) -> str:
    """The name prefix of the model transformers built inside the module given to
    initialize ("" when it is that model)."""
    for name, sub in module.named_modules():
        if sub is root:
            return f"{name}." if name else ""
    raise ValueError(f"initialize got {type(module).__name__}, a part of the "
                     f"{type(root).__name__} that transformers built under a vescale config: "
                     "pass the whole model (its checkpoint and init cover all of it)")


def _same_checkpoint(path, files) -> bool:
    try:
        named = checkpoint_files(path)[0]
    except (OSError, ValueError):
        return False
    return sorted(map(os.path.realpath, named)) == sorted(map(os.path.realpath, files))
