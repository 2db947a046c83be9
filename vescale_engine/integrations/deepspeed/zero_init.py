"""`deepspeed.zero.Init` under a vescale config: the model is built on the meta device.

DeepSpeed's `zero.Init` partitions each parameter as its module is constructed. Transformers
enters it for every model it builds under a ZeRO-3 config (`from_pretrained`, `from_config`),
and plain scripts write `with deepspeed.zero.Init(config_dict_or_path=cfg): model = Net()`.
After `patch_deepspeed()` (integrations/deepspeed/__init__.py replaces `zero.Init` and
`GatheredParameters`, calling `zero_init_config`, `MetaInit` and `refuse_gathering` here), a
config with a "vescale" section makes it a context that builds on `meta` instead: shapes only,
no storage, no random numbers drawn. `initialize` wraps the model, then gives it values shard
by shard (engine/weights.py's prepare_weights, calling the record's own), so no rank ever holds the whole model. Without
a vescale section DeepSpeed's own Init runs, unchanged.

Every module that registers a tensor inside the context carries its `DeferredInit` record:
- the generator state at entry: `initialize` draws the init from it (and gives the caller's
  state back), so the values are those of a build at that point, as with DeepSpeed, which
  initializes inside the context, whatever the script drew in between;
- what transformers recorded about the build (integrations/transformers/pretrained.py: the checkpoint
  `from_pretrained` resolved, or that `from_config` wants its own init).
On those modules `.to(device)` / `.cuda()` wait for `initialize` (which places the model),
dtype casts apply (on meta), and `to_empty` is an error. `deepspeed.zero.GatheredParameters`
on their parameters once the build is over is an error naming the caller: there is nothing to
gather, and DeepSpeed's own would silently do nothing. (During the build it passes: a model
that gathers in `__init__` writes nothing that is kept.) On parameters vescale has sharded
(after initialize) it gathers them: params.py's GatheredShards; any others in
the same call go to DeepSpeed's own.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
from dataclasses import dataclass

import torch
from torch import nn

from ...fsdp.deferred import DeferredInit, deferred_of, mark_deferred
from ...fsdp.guards import apply_caller
from ...fsdp.materialize import rng_state

__all__ = ["MetaInit", "ZeroInitRecord", "config_dtype", "refuse_changed_meaning", "require_not_partitioned",
           "zero_init_config", "refuse_gathering"]


# -- the context --------------------------------------------------------------------------------

@dataclass(eq=False)
class ZeroInitRecord(DeferredInit):
    """The core's deferred-init record, plus what transformers recorded about the build
    (transformers/pretrained.py fills it; its prepare_weights loads or initializes)."""
    builder: str | None = None       # "from_pretrained" / "from_config": transformers built it
    root: nn.Module | None = None    # the model transformers built
    pretrained: object = None        # transformers/pretrained.py's PretrainedWeights
    init_like_transformers: bool = False  # from_config: initialize_weights' walk, deferred

    def prepare_weights(self, module: nn.Module, cfg, device) -> bool:
        if self.builder is None:
            return False
        from ..transformers.pretrained import prepare_transformers_weights
        prepare_transformers_weights(module, self, cfg, device)
        return True


class MetaInit:
    """What `deepspeed.zero.Init(...)` returns for a vescale config: a context that builds on
    the meta device and marks what it builds with its `DeferredInit` record."""

    active = 0  # contexts entered and not left: a build is running

    def __init__(self, config: dict, arguments: dict):
        refuse_changed_meaning(config, arguments)
        self.config = config
        self.enabled = arguments.get("enabled", True)
        self.record = None
        self._stack = None
        self._builder = _transformers_builder()

    def __enter__(self):
        if not self.enabled:  # DeepSpeed's enabled=False: an ordinary build
            return self
        self.record = ZeroInitRecord(self.config, rng_state(_generator_devices()),
                                     builder=self._builder)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta"))
        module = nn.modules.module
        for register in (module.register_module_parameter_registration_hook,
                         module.register_module_buffer_registration_hook):
            stack.callback(register(self._registered).remove)
        MetaInit.active += 1
        stack.callback(lambda: setattr(MetaInit, "active", MetaInit.active - 1))
        self._stack = stack
        return self

    def __exit__(self, *exc):
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        return False

    def _registered(self, module, name, tensor):
        if tensor is not None and tensor.is_meta:
            _mark(module, tensor, self.record)


def _mark(module: nn.Module, tensor, record: DeferredInit) -> None:
    if isinstance(tensor, nn.Parameter):
        mark_deferred(tensor, record)
    if deferred_of(module) is None:
        mark_deferred(module, record)
        module._apply = types.MethodType(_deferred_apply, module)  # parents' recursion too


def _generator_devices() -> set:
    """The generators a build here would draw from: the CPU's, and the current CUDA device's
    when CUDA is in use already (never initialized here: that would open a context on GPU 0)."""
    devices = {torch.device("cpu")}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.add(torch.device("cuda", torch.cuda.current_device()))
    return devices


def _transformers_builder() -> str | None:
    """"from_pretrained" / "from_config" when transformers is entering this Init for a model
    it builds (PreTrainedModel.from_pretrained and ._from_config are the two that do)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "transformers.modeling_utils" and \
                frame.f_code.co_name in ("from_pretrained", "_from_config"):
            return frame.f_code.co_name.lstrip("_")
        frame = frame.f_back
    return None


# -- DeepSpeed's arguments ---------------------------------------------------------------------

def config_dtype(config: dict):
    """The compute dtype DeepSpeed's Init would cast to for `config` (fp16 / bf16 / fp32);
    None while either section is still "auto" (Hugging Face fills it in)."""
    enabled = [(config.get(key) or {}).get("enabled", False) for key in ("fp16", "bf16")]
    if "auto" in enabled:
        return None
    return torch.float16 if enabled[0] is True else \
        torch.bfloat16 if enabled[1] is True else torch.float32


def refuse_changed_meaning(config: dict, arguments: dict) -> None:
    """DeepSpeed's Init arguments are accepted where building on meta keeps their meaning;
    the others are one error naming each and what to do instead."""
    a = arguments
    problems = []
    if a.get("module") is not None:
        problems.append("module= partitions a model that is already built: pass that model "
                        "to initialize as it is (initialize shards it), or build it inside "
                        "this context")
    offload = ((config.get("zero_optimization") or {}).get("offload_param") or {}).get("device")
    if str(offload).lower() == "cpu":  # initialize offloads the shards (optim/offload.py)
        offload = None
    for what, where in (("remote_device", a.get("remote_device")),
                        ("zero_optimization.offload_param.device", offload)):
        if where is not None and str(getattr(where, "value", where)).lower() != "none":
            problems.append(f"{what}={where!r} keeps parameters off the accelerator, which "
                            "vescale does not do (each rank holds its shard on its device): "
                            "remove it")
    if a.get("mpu") is not None:
        problems.append("mpu= (model parallelism) is not supported")
    for key in ("data_parallel_group", "sequence_data_parallel_group"):
        if a.get(key) is not None and not _whole_world(a[key]):
            problems.append(f"{key}= partitions over a subgroup; vescale shards over all ranks "
                            "(vescale.hsdp_replicate_size makes replicas)")
    if a.get("zero_param_parallel_group") is not None:
        problems.append("zero_param_parallel_group= (hpZ) is not supported")
    if a.get("zero_quantized_weights") or a.get("zero_quantized_nontrainable_weights"):
        problems.append("ZeRO++ quantized weights (zero_quantized_*) are not supported")
    if a.get("param_swapper") is not None:
        problems.append("param_swapper= (NVMe) is not supported")
    wanted, dtype = config_dtype(config), a.get("dtype")
    if dtype is not None and wanted is not None and dtype != wanted:
        problems.append(f"dtype={dtype} is not the config's precision ({wanted}): the model "
                        "keeps the dtype it is built in and the config's bf16/fp16 section sets "
                        "the compute dtype; drop dtype= or make the two agree")
    if problems:
        raise ValueError("deepspeed.zero.Init under a vescale config: " + "; ".join(problems))


def _whole_world(group) -> bool:
    import torch.distributed as dist
    return dist.is_initialized() and dist.get_world_size(group) == dist.get_world_size()


def zero_init_config(arguments: dict) -> dict | None:
    """The config this Init is given (or the one Hugging Face holds, when none is given), if
    it has a "vescale" section."""
    source = arguments.get("config_dict_or_path")
    if source is None:
        source = arguments.get("config")  # DeepSpeed's deprecated spelling
    if source is None:
        hf = sys.modules.get("transformers.integrations.deepspeed")
        source = hf.deepspeed_config() if hf is not None else None
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        from config_schemas.validate import read_config
        source = read_config(source)
    return source if isinstance(source, dict) and "vescale" in source else None


# -- the model, later ---------------------------------------------------------------------------

def require_not_partitioned(model: nn.Module) -> None:
    """A model DeepSpeed's own zero.Init partitioned (its Init got no vescale config) cannot be
    trained by vescale: say so before wrapping fails on empty tensors."""
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):
            raise ValueError(
                f"{name} is a DeepSpeed ZeRO-3 partition (shape {list(param.shape)} of "
                f"{list(getattr(param, 'ds_shape', []))}): the model was built inside "
                "deepspeed.zero.Init without the vescale config, so DeepSpeed partitioned it; "
                "give zero.Init the config with its vescale section (config_dict_or_path=...; "
                "transformers does when TrainingArguments(deepspeed=...) or HfDeepSpeedConfig "
                "holds it) and it builds on the meta device instead")


def _deferred_apply(self, fn, recurse=True):
    """`_apply` (behind .to/.cuda/.half/...) of a module built under a vescale zero.Init:
    dtype casts apply to the meta tensors, moves wait for initialize (it places the model on
    the rank's device), `to_empty` (uninitialized storage that initialize would then train)
    is an error. Tensors that have values already go through `fn` as usual."""
    if getattr(fn, "_vescale_adapted", False):  # adapted by a parent's call
        return type(self)._apply(self, fn, recurse)
    call = apply_caller(fn)
    where = f"{type(self).__name__}.{call}(...) on a model built under deepspeed.zero.Init " \
            "with a vescale config"
    if call == "to_empty":
        raise RuntimeError(f"{where} would give it uninitialized storage: initialize gives it "
                           "its values (from_pretrained's checkpoint, or its init); drop the call")

    def adapted(tensor):
        if not tensor.is_meta:
            return fn(tensor)
        try:  # what the call does to a tensor of this dtype, learnt on an empty one
            probe = fn(torch.empty(0, dtype=tensor.dtype, device="cpu"))
        except Exception as err:
            raise RuntimeError(f"{where}: {err}") from err
        return tensor if probe.dtype == tensor.dtype else tensor.to(probe.dtype)
    adapted._vescale_adapted = True
    return type(self)._apply(self, adapted, recurse)


def refuse_gathering(params) -> None:
    for p in params:
        if not isinstance(p, torch.Tensor):
            continue
        # During the build (models that gather in __init__, as wav2vec2's weight norm does)
        # there is nothing to gather and nothing written on meta is kept: DeepSpeed's no-op.
        if p.is_meta and deferred_of(p) is not None and not MetaInit.active:
            raise RuntimeError(
                f"deepspeed.zero.GatheredParameters (called from {_callers()}) on a parameter "
                f"of shape {list(p.shape)} built under deepspeed.zero.Init with a vescale "
                "config: it has no values until initialize gives them (from_pretrained's "
                "checkpoint or the model's init). Read or change weights after initialize, "
                "inside `with deepspeed.zero.GatheredParameters(params, modifier_rank=0):`, "
                "or change the checkpoint before from_pretrained")


def _callers(limit: int = 3) -> str:
    names, frame = [], sys._getframe(1)
    while frame is not None and len(names) < limit:
        if frame.f_globals.get("__name__") != __name__:
            code = frame.f_code  # co_qualname: Python 3.11+
            names.append(getattr(code, "co_qualname", code.co_name))
        frame = frame.f_back
    return " <- ".join(names)
