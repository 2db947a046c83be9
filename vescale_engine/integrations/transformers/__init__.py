"""transformers' private steps of `from_pretrained` / `from_config`, taken over for a model a
vescale `deepspeed.zero.Init` built on meta (pretrained.py does the work; every other
model goes through transformers' own). Supported: transformers versions.SUPPORTED
["transformers"]; `install` checks every name below, and the loading helpers
pretrained.py uses, and names the installed version if one is missing.

- `PreTrainedModel._load_pretrained_model`: records the checkpoint (hf_pretrained's
  record_checkpoint) instead of loading it.
- `PreTrainedModel._initialize_missing_keys`: nothing (initialize initializes them, after
  loading).
- `transformers.integrations.deepspeed.initialize_weights_zero3` (from_config): records that
  initialize runs transformers' init.

transformers 5.25 kernelizes every model at the end of `from_pretrained` (the `kernels`
library, for the device of the model's parameters), which refuses a model on meta. A deferred
model is told the device it will compute on instead (`_kernels_device`, which transformers
reads for offloaded models; DeepSpeed's zero.Init has its partitions there already), so its
layers get the kernels DeepSpeed's model gets.

Installed by `patch_deepspeed()` when transformers.modeling_utils is imported, or right after
it is first imported.
"""
from __future__ import annotations

import functools
import importlib
import inspect

from ...fsdp.deferred import deferred_record
from ...versions import supported_range
from ..registry import replace
from .pretrained import record_checkpoint

__all__ = ["check_transformers", "install"]

_NEEDED = (("transformers.modeling_utils", "PreTrainedModel._load_pretrained_model"),
           ("transformers.modeling_utils", "PreTrainedModel._initialize_missing_keys"),
           ("transformers.modeling_utils", "PreTrainedModel._initialize_weights"),
           ("transformers.integrations.deepspeed", "initialize_weights_zero3"),
           ("transformers.core_model_loading", "rename_source_key"),
           ("transformers.core_model_loading", "WeightConverter"),
           ("transformers.core_model_loading", "WeightRenaming"),
           ("transformers.utils.loading_report", "LoadStateDictInfo"),
           ("transformers.initialization", "guard_torch_init_functions"))


def _lookup(module_name, dotted):
    value = importlib.import_module(module_name)
    for part in dotted.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def check_transformers(needed=_NEEDED) -> None:
    """An ImportError naming every name in `needed` (module, dotted attribute) the installed
    transformers lacks, and its version; `_load_pretrained_model`'s signature is checked too."""
    import transformers
    absent = [f"{m}.{n}" for m, n in needed if _lookup(m, n) is None]
    load = importlib.import_module("transformers.modeling_utils").PreTrainedModel.__dict__.get(
        "_load_pretrained_model")
    if not isinstance(load, staticmethod) or list(inspect.signature(
            load.__func__).parameters)[:4] != ["model", "state_dict", "checkpoint_files",
                                               "load_config"]:
        absent.append("PreTrainedModel._load_pretrained_model(model, state_dict, "
                      "checkpoint_files, load_config, ...)")
    if absent:
        raise ImportError(f"vescale's deferred from_pretrained/from_config needs "
                          f"{', '.join(absent)}, which transformers {transformers.__version__} "
                          f"does not have (supported: {supported_range('transformers')})")


def _compute_device():
    """The device a deferred model's parameters go to at initialize: the process group's
    (shard.collectives.default_device), the current accelerator's before one exists."""
    import torch
    import torch.distributed as dist
    from ...shard.collectives import default_device
    if dist.is_available() and dist.is_initialized():
        return default_device()
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def install() -> None:
    """The three patches of the module docstring (idempotent)."""
    modeling = importlib.import_module("transformers.modeling_utils")
    integration = importlib.import_module("transformers.integrations.deepspeed")
    pretrained = modeling.PreTrainedModel
    if hasattr(pretrained._initialize_missing_keys, "__vescale_original__"):
        return
    check_transformers()
    original_load = pretrained.__dict__["_load_pretrained_model"].__func__

    @functools.wraps(original_load)
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args,
                               **kwargs):
        record = deferred_record(model)
        if record is None:
            return original_load(model, state_dict, checkpoint_files, load_config, *args,
                                 **kwargs)
        model._kernels_device = _compute_device()  # (what kernelize reads, see above)
        return record_checkpoint(model, record, state_dict, checkpoint_files, load_config), None

    original_missing = pretrained._initialize_missing_keys

    @functools.wraps(original_missing)
    def _initialize_missing_keys(self, *args, **kwargs):
        if deferred_record(self) is None:
            return original_missing(self, *args, **kwargs)
        return None  # initialize initializes them, after loading (init_like_transformers)

    original_zero3 = integration.initialize_weights_zero3

    @functools.wraps(original_zero3)
    def initialize_weights_zero3(model):
        record = deferred_record(model)
        if record is None:
            return original_zero3(model)
        record.builder, record.root, record.init_like_transformers = "from_config", model, True
        return None

    _load_pretrained_model.__vescale_original__ = original_load
    _initialize_missing_keys.__vescale_original__ = original_missing
    initialize_weights_zero3.__vescale_original__ = original_zero3
    replace("transformers", pretrained, "_load_pretrained_model",
            staticmethod(_load_pretrained_model))
    replace("transformers", integration, "initialize_weights_zero3", initialize_weights_zero3)
    replace("transformers", pretrained, "_initialize_missing_keys",
            _initialize_missing_keys)  # last: marks it installed
