"""Deferred (meta-device) initialization: give a model built under `torch.device("meta")` and
passed through `fully_shard` real storage and values, one module at a time, never whole.

    with torch.device("meta"):
        model = GPT()                      # no storage, no random numbers drawn
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)                     # planned from shapes; DBuffers on meta
    vescale_engine.materialize(model)      # real shards, initialized

`allocate_shards(module, device)` gives every meta unit real, uninitialized master storage (a
checkpoint loader fills it through each `ShardedParameter.sharded`, then hands what the
checkpoint lacks to `init_unloaded`). `materialize` allocates, then replays initialization
module by module, children first, as a one-process build does:

- `init_fn(module)` when given, once per module that owns (directly) a parameter or buffer
  that was on meta;
- else torch's contract, `reset_parameters()` (`_reset_parameters()` for
  nn.MultiheadAttention) on modules that define it, then, for a
  Hugging Face `PreTrainedModel` (a module with `_initialize_weights`), its own
  `_initialize_weights` over its subtree, children first, right after its subtree (what its
  `post_init` does at the end of its `__init__`; inner pretrained models run theirs first).

For each module: its own parameters are registered at full shape (NaN-filled views of one
scratch tensor; its descendants' as meta placeholders, see `_Initializer._init_module`), the
init runs, this rank's flat range is copied into the master shard. A tensor- or
expert-parallel (DTensor) parameter is initialized at its GLOBAL shape too, then this rank's
TP/EP piece is cut from it (`dtensor_params.local_of_global`) and its flat range kept: the
init draws what a one-process build draws, whatever the TP/EP layout. Every
rank runs every init in the same order from the same generator state, so the values are bitwise
those of a one-process build on the same device type with the same seed, at any world size.
A tied parameter takes its value from its first registration in that order; its other
registrations' inits run on scratch tensors (a one-process build also initializes the tensor it
later discards), so the generator advances exactly as there.

"Touched" is decided by value: a floating tensor an init left with any NaN was not (fully)
written; an integer or bool buffer by its version counter (no NaN to fill it with). A parameter
or buffer no init wrote is an error naming it and its module class.

Peak memory: the shards plus the largest single module's own parameters (full, global size)
plus that module's init temporaries (and, under TP/EP, one tensor's local piece when it is
not a view: `_StridedShard`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import types

import torch
from torch import nn

from ..shard.collectives import default_device
from .dtensor_params import global_shape, local_of_global
from .guards import held_as_pieces, require_materialized
from .lookup import sharded_parameters, units_under
from .param import sharding_of

LOG = logging.getLogger("vescale_engine")

__all__ = ["materialize", "allocate_shards", "init_unloaded", "rng_state", "set_rng_state",
           "use_init_fn", "init_fn_of", "install_full_shape_reset", "register_init_guard"]

_INIT_FN = "_vescale_init_fn"  # on a model's __dict__: the init_fn initialize materializes with
# Contexts a pretrained model's own init runs in (`register_init_guard`): transformers' guard
# of torch's init functions, which its `_init_weights` expects around it.
_INIT_GUARDS = []


def register_init_guard(factory) -> None:
    """`factory()` gives a context manager that a pretrained model's init (`post_init`'s walk)
    runs inside; registered once by an integration (transformers')."""
    if factory not in _INIT_GUARDS:
        _INIT_GUARDS.append(factory)


def _target_device(module: nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    units = units_under(module)
    group = units[0].buffers[0].shard_group if units else None
    return default_device(group)


def allocate_shards(module: nn.Module, device=None) -> None:
    """Real, UNINITIALIZED master storage on `device` for every still-meta unit under `module`
    (the padding between tensors zeroed), every ShardedParameter re-pointed at it (the same
    Parameter objects, now views of the shard), and every module buffer left on meta allocated
    empty on `device`. Values are for the caller to write (a loader through `p.sharded`, see
    `ShardedParameter.flat_range`; or `materialize`). `device=None`: the default group's device
    (`shard.collectives.default_device`). A meta parameter that no unit manages is an error."""
    device = _target_device(module, device)
    managed = {id(p.sharded) for _, p in sharded_parameters(module)}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.is_meta and id(param) not in managed:
            raise ValueError(f"allocate_shards: {name} is on the meta device but no fully_shard "
                             "unit manages it; call fully_shard on its module (or the root) first")
    for unit in units_under(module):
        if unit.is_meta:
            unit.group.allocate(device)
    made = {}  # one tensor per buffer object, so a buffer registered twice stays shared
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.is_meta:
                if id(buf) not in made:
                    made[id(buf)] = torch.empty_like(buf, device=device)
                sub._buffers[name] = made[id(buf)]


def materialize(module: nn.Module, device=None, init_fn=None) -> nn.Module:
    """Allocate (`allocate_shards`) and initialize every parameter and buffer under `module`
    that is on the meta device, one module's own tensors at a time; see the module docstring
    for the order, the tied-weight rule and what is bitwise. Returns `module`. Errors name the
    parameter or buffer (and its module class) that no init wrote, or that is still on meta."""
    pending_params = {id(p): p for _, p in sharded_parameters(module)
                      if p.buffer.is_meta and p.initial is None}  # initial: allocate writes it
    meta_buffers = [(sub, name) for sub in module.modules()
                    for name, b in sub._buffers.items() if b is not None and b.is_meta]
    if init_fn is None:
        _refuse_unreplayed_writes(module, pending_params)  # before anything is allocated
    allocate_shards(module, device)  # replaces those buffers' tensors
    if not pending_params and not meta_buffers:
        return module  # nothing was on meta (loaded already): no init runs, no draws
    pending_buffers = {id(sub._buffers[name]) for sub, name in meta_buffers}
    _Initializer(module, pending_params, pending_buffers, init_fn).run()
    require_materialized(module, "the end of materialize")
    return module


def use_init_fn(model: nn.Module, init_fn) -> nn.Module:
    """For `initialize`, which wraps and materializes a meta model itself: materialize `model`
    with `init_fn` (as `materialize(model, init_fn=...)`). Returns `model`."""
    if not callable(init_fn):
        raise TypeError(f"use_init_fn: init_fn must be callable, got {type(init_fn).__name__}")
    model.__dict__[_INIT_FN] = init_fn
    return model


def init_fn_of(model: nn.Module):
    """The init_fn `use_init_fn` gave `model`, or None."""
    return model.__dict__.get(_INIT_FN)


def init_unloaded(module: nn.Module, names, init_fn=None, ancestors=False) -> None:
    """For a loader after `allocate_shards`: initialize the parameters and buffers named in
    `names` (as `named_parameters` / `named_buffers` say them, non-persistent buffers
    included) that it did not write, as materialize would (the modules owning them run their
    init, children first; nothing else changes). Typically the non-persistent buffers a
    checkpoint does not hold (rotary `inv_freq`) and, with strict=False, its missing keys. Not
    bitwise with a whole build (the other modules' draws do not happen). With `init_fn` and
    `ancestors=True`, `init_fn` also runs on every ancestor of those modules (an init that
    writes a child's tensors, as Hugging Face's `_init_weights` may). An unknown name, or a
    name still on meta, is an error."""
    names = set(names)
    if not names:
        return
    params = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
    buffers = {name: b for name, b in module.named_buffers(remove_duplicate=False)}
    unknown = sorted(names - set(params) - set(buffers))
    if unknown:
        raise ValueError(f"init_unloaded: {unknown[0]} is not a parameter or buffer of "
                         f"{type(module).__name__}")
    pending, pending_buffers = {}, set()
    for name in sorted(names):
        tensor = params.get(name, buffers.get(name))
        if tensor.is_meta:
            raise ValueError(f"init_unloaded: {name} is still on the meta device; call "
                             "allocate_shards first")
        sp = sharding_of(tensor)
        if name in params and sp is None:
            raise ValueError(f"init_unloaded: {name} is not managed by fully_shard")
        if sp is not None:
            pending[id(sp)] = sp
        else:
            pending_buffers.add(id(tensor))
    for sub in module.modules():  # asked for again: Hugging Face's "done" mark must not skip it
        owns = any(id(sharding_of(p)) in pending for p in sub._parameters.values())
        if owns or any(id(b) in pending_buffers for b in sub._buffers.values()):
            sub.__dict__.pop("_is_hf_initialized", None)
    _Initializer(module, pending, pending_buffers, init_fn, ancestors).run()


# ---------------------------------------------------------------------------------------------
# reset_parameters() on a sharded module (FSDP2's meta init: to_empty, then reset_parameters()
# on every module).

def install_full_shape_reset(unit) -> None:
    """Each module holding a parameter of `unit` gets a `reset_parameters` that works between
    steps, when it holds flat pieces: its class's init runs on full-shape tensors (as
    materialize runs it, from the same generator on every rank) and this rank's range of what
    it wrote goes into the master shard. So `to_empty(device=...)` then `reset_parameters()`
    on every module (FSDP2's recipe) gives bitwise what the same calls give an unsharded model,
    and a reset later re-initializes the module. Held at full shape (inside forward or
    `gathered_parameters`), the class's own runs."""
    for module in {id(m): m for p in unit.params for m, _ in p.registrations}.values():
        if callable(getattr(type(module), "reset_parameters", None)) and \
                "reset_parameters" not in module.__dict__:
            module.reset_parameters = types.MethodType(_reset_at_full_shape, module)


def _reset_at_full_shape(self, *args, **kwargs):
    reset = type(self).reset_parameters
    if not held_as_pieces(self):
        return reset(self, *args, **kwargs)
    pending = {id(p._vescale): p._vescale for p in self.parameters()
               if sharding_of(p) is not None and p is p._vescale.sharded}
    if any(sp.buffer.is_meta for sp in pending.values()):
        raise RuntimeError(f"{type(self).__name__}.reset_parameters(): its shards are still on "
                           "the meta device; call model.to_empty(device=...) first (or "
                           "vescale_engine.materialize(model), which also initializes)")
    init = _Initializer(self, pending, set(), None)
    init._init_module(self, lambda mod: reset(mod, *args, **kwargs))
    return None


# ---------------------------------------------------------------------------------------------
# A constructor's writes that materialize cannot replay.

def _refuse_unreplayed_writes(root: nn.Module, pending: dict) -> None:
    """On meta a constructor's init writes nothing, but it still moves each parameter's version
    counter (fully_shard kept it: `build_writes`). Materialize replays only the modules'
    `reset_parameters` (and Hugging Face's `_initialize_weights`, for the parameters of a
    pretrained model's subtree). A parameter written more often than its modules'
    `reset_parameters` write it (nanoGPT's `self.apply(self._init_weights)` at the end of
    `__init__`, a scaled re-init, an in-place change) would silently get other values than a
    CPU build gives it: refuse, naming it."""
    replayed_by_hf = {id(p._vescale) for mod in root.modules() if _is_pretrained(mod)
                      for p in mod.parameters() if sharding_of(p) is not None}
    checked = {key: sp for key, sp in pending.items()
               if sp.build_writes and key not in replayed_by_hf}
    if not checked:
        return
    expected = _reset_writes(root, checked)
    names = {id(mod): name for name, mod in _post_order(root)}
    for key, sp in checked.items():
        if sp.build_writes > expected.get(key, 0):
            mod, attr = sp.registrations[0]
            prefix = names.get(id(mod), "")
            name = f"{prefix}.{attr}" if prefix else attr
            raise RuntimeError(
                f"{name} ({type(mod).__name__}) was written {sp.build_writes} time(s) while the "
                f"model was built on the meta device, but its reset_parameters writes it "
                f"{expected.get(key, 0)} time(s): an init in the constructor (e.g. "
                "self.apply(self._init_weights)) that never ran on meta and that materialize "
                "cannot replay, so it would train from other weights than a CPU build. Pass "
                "the per-module init: vescale_engine.materialize(model, init_fn=...) after "
                "fully_shard, or vescale_engine.materialize.use_init_fn(model, init_fn) before "
                "initialize (docs/big_models.md); or build the model on CPU")


def _reset_writes(root: nn.Module, checked: dict) -> dict:
    """{id(ShardedParameter): in-place writes its modules' reset_parameters make}, counted by
    running each reset on fresh meta tensors (no storage, no draws), as materialize would run
    it: on the modules owning a checked parameter, with their subtrees' parameters in place."""
    counts = {}
    for _, mod in _post_order(root):
        reset = _reset_of(mod)
        owns = any(id(sharding_of(p)) in checked for p in mod._parameters.values())
        if reset is None or not owns:
            continue
        fresh, saved = {}, []
        for sub in mod.modules():
            for name, param in list(sub._parameters.items()):
                sp = sharding_of(param)
                if sp is None or param is not sp.sharded:
                    continue
                if id(sp) not in fresh:
                    fresh[id(sp)] = nn.Parameter(torch.empty(global_shape(sp), device="meta",
                                                             dtype=param.dtype),
                                                 requires_grad=param.requires_grad)
                saved.append((sub, name, param))
                sub._parameters[name] = fresh[id(sp)]
        attributes = dict(mod.__dict__)
        try:
            with torch.no_grad():
                reset(mod)
        except Exception:  # noqa: BLE001 - cannot count: trust the build for these
            for key in fresh:
                counts[key] = float("inf")
            continue
        finally:
            for sub, name, param in saved:
                sub._parameters[name] = param
            mod.__dict__.clear()
            mod.__dict__.update(attributes)
        for key, tensor in fresh.items():
            counts[key] = counts.get(key, 0) + tensor._version
    return counts


# ---------------------------------------------------------------------------------------------

def _post_order(module: nn.Module) -> list:
    """(qualified name, module), children before their parent, each module once, in
    registration (= construction) order."""
    out, seen = [], set()

    def visit(name, mod):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for child_name, child in mod._modules.items():
            if child is not None:
                visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, mod))
    visit("", module)
    return out


def _ancestor_names(names) -> set:
    """Every proper prefix of each dotted module name ("" is the root)."""
    out = set()
    for name in names:
        parts = name.split(".") if name else []
        out.update(".".join(parts[:k]) for k in range(len(parts)))
    return out


def _reset_of(mod: nn.Module):
    """The class's own init: `reset_parameters`, or `_reset_parameters` for the torch modules
    that call theirs that (nn.MultiheadAttention). The class's, not the instance attribute:
    fully_shard guards that one."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(type(mod), name, None)
        if callable(fn):
            return fn
    return None


def _is_pretrained(mod: nn.Module) -> bool:
    """A Hugging Face PreTrainedModel (duck-typed: no transformers import needed)."""
    return callable(getattr(type(mod), "_initialize_weights", None)) and hasattr(mod, "config")


class _Initializer:
    def __init__(self, root, pending_params, pending_buffers, init_fn, ancestors=False):
        self.root = root
        self.init_fn = init_fn
        self.ancestors = ancestors         # init_fn also runs on the owners' ancestors
        self.order = _post_order(root)
        self.names = {id(mod): name for name, mod in self.order}
        self.pending = pending_params      # id(ShardedParameter) -> it, until written
        self.pending_buffers = pending_buffers
        self.owner = {}                    # id(ShardedParameter) -> (module, name)
        for _, mod in self.order:
            for name, param in mod._parameters.items():
                sp = sharding_of(param)
                if sp is not None and id(sp) in self.pending:
                    self.owner.setdefault(id(sp), (mod, name))
        self.written = set()               # ids of the ShardedParameters written
        self.fill_only = False             # keep only what is not written yet (init_fn's gaps)
        for buf in root.buffers():  # NaN until an init writes it (see _buffer_written)
            if id(buf) in pending_buffers and (buf.is_floating_point() or buf.is_complex()):
                buf.fill_(float("nan"))
        self.buffer_versions = {id(b): b._version for b in root.buffers()
                                if id(b) in pending_buffers}
        self.scratch = self._make_scratch()

    def _make_scratch(self) -> dict:
        """One flat tensor per (device, dtype), as large as the largest module's own parameters:
        every module's full tensors are views of it. Allocating and freeing per module would
        leave the heap fragmented (glibc raises its mmap threshold after the first frees), so
        resident memory would climb past shard + largest module."""
        need = {}
        for _, mod in self.order:
            per = {}
            for param in mod._parameters.values():
                sp = sharding_of(param)
                if sp is not None and param is sp.sharded:
                    key = (sp.buffer.device, sp.buffer.master.dtype)
                    per[key] = per.get(key, 0) + math.prod(global_shape(sp))
            for key, n in per.items():
                need[key] = max(need.get(key, 0), n)
        return {key: torch.empty(n, dtype=key[1], device=key[0]) for key, n in need.items()}

    # -- the walk ------------------------------------------------------------------------------

    def run(self):
        work = [(name, mod) for name, mod in self.order if self._owns_pending(mod)]
        if self.init_fn is not None and self.ancestors:
            above = _ancestor_names(name for name, _ in work)
            work = [(name, mod) for name, mod in self.order
                    if self._owns_pending(mod) or name in above]
        every = max(1, math.ceil(len(work) / 10))  # a line per 10% (rank 0, >= 10 modules)
        started = time.perf_counter()
        if self.init_fn is not None:
            for k, (_, mod) in enumerate(work, 1):
                self._init_module(mod, self.init_fn)
                reset = _reset_of(mod)
                if reset is not None and self._unwritten_own(mod):
                    self.fill_only = True  # what init_fn left alone gets reset_parameters' value
                    try:
                        self._init_module(mod, reset)
                    finally:
                        self.fill_only = False
                self._progress(k, len(work), every, started)
        else:
            todo = {id(mod) for _, mod in work}
            done = 0
            for _, mod in self.order:
                reset = _reset_of(mod)
                if id(mod) in todo and reset is not None:
                    self._init_module(mod, reset)
                if _is_pretrained(mod):
                    self._hugging_face_init(mod)
                if id(mod) in todo:
                    done += 1
                    self._progress(done, len(work), every, started)
        self._check_all_written()

    def _progress(self, k, total, every, started):
        if (k % every == 0 or k == total) and _rank() == 0 and total >= 10:
            LOG.info("materialize: %d/%d modules initialized (%.1f s)", k, total,
                     time.perf_counter() - started)

    def _unwritten_own(self, mod) -> bool:
        """A pending parameter `mod` owns (its first registration) is not written yet."""
        return any(id(p._vescale) in self.pending and id(p._vescale) not in self.written
                   and self.owner.get(id(p._vescale), (None,))[0] is mod
                   for p in mod._parameters.values() if sharding_of(p) is not None)

    def _owns_pending(self, mod) -> bool:
        for param in mod._parameters.values():
            sp = sharding_of(param)
            if sp is not None and id(sp) in self.pending:
                return True
        return any(b is not None and id(b) in self.pending_buffers
                   for b in mod._buffers.values())

    def _hugging_face_init(self, model):
        """What `PreTrainedModel.post_init` does at the end of `model.__init__`: its
        `_initialize_weights` over its subtree, children first (an inner pretrained model with
        its own), skipping modules already initialized (`_is_hf_initialized`)."""
        def visit(mod, fn):
            for child in mod.children():
                visit(child, child._initialize_weights if _is_pretrained(child) else fn)
            if not getattr(mod, "_is_hf_initialized", False):
                self._init_module(mod, fn)  # also with nothing of its own: it may write a child's

        with torch.no_grad(), contextlib.ExitStack() as guards:
            for factory in _INIT_GUARDS:
                guards.enter_context(factory())
            visit(model, model._initialize_weights)

    # -- one module ----------------------------------------------------------------------------

    def _init_module(self, mod, fn):
        """Run `fn(mod)` with `mod`'s own parameters at full shape and keep what it wrote.

        Descendants' parameters are registered as meta placeholders meanwhile: an init should
        write only its own module's, but some write a child's (Hugging Face GPT-2 scales
        `c_proj.weight` from its parent). A write to a placeholder draws nothing and moves its
        version counter; then the generator is rewound and the init runs again with those
        parameters at full shape too, so the draws are the one-process build's."""
        state = rng_state({key[0] for key in self.scratch})
        attributes = dict(mod.__dict__)
        touched = self._run(mod, fn, extra={})
        if touched:  # rewind: the generator, and flags the init set (HF's _is_hf_initialized)
            set_rng_state(state)
            mod.__dict__.clear()
            mod.__dict__.update(attributes)
            self._run(mod, fn, extra=touched)

    def _run(self, mod, fn, extra) -> dict:
        """One try of `fn(mod)`: own parameters full (NaN), descendants' in `extra` full (NaN)
        too, other descendants' meta placeholders. Returns {id: (ShardedParameter, module,
        name)} of the placeholders the init wrote (empty: done)."""
        full, used, saved = [], {}, []   # full: (module, name, ShardedParameter, value)
        for name, param in list(mod._parameters.items()):
            sp = sharding_of(param)
            if sp is None or param is not sp.sharded:
                continue
            key = (sp.buffer.device, sp.buffer.master.dtype)
            shape = global_shape(sp)
            at, n = used.get(key, 0), math.prod(shape)
            used[key] = at + n
            value = self.scratch[key][at:at + n].view(shape).fill_(float("nan"))
            full.append((mod, name, sp, value))
            saved.append((mod, name, param))
            mod._parameters[name] = nn.Parameter(value, requires_grad=sp.requires_grad)
        own = {id(sp) for _, _, sp, _ in full}
        placeholders, extra_values = {}, {}
        for sub in mod.modules():
            if sub is mod:
                continue
            for name, param in list(sub._parameters.items()):
                sp = sharding_of(param)
                if sp is None or param is not sp.sharded or id(sp) in own:
                    continue
                saved.append((sub, name, param))
                if id(sp) in extra:
                    if id(sp) not in extra_values:
                        extra_values[id(sp)] = torch.full(
                            global_shape(sp), float("nan"), dtype=sp.buffer.master.dtype,
                            device=sp.buffer.device)
                    value = extra_values[id(sp)]
                    full.append((sub, name, sp, value))
                else:
                    if id(sp) not in placeholders:
                        placeholders[id(sp)] = (torch.empty(global_shape(sp), dtype=param.dtype,
                                                            device="meta"), sub, name, sp)
                    value = placeholders[id(sp)][0]
                sub._parameters[name] = nn.Parameter(value, requires_grad=param.requires_grad)
        versions = {key: ph[0]._version for key, ph in placeholders.items()}
        try:
            with torch.no_grad():
                fn(mod)
        finally:
            for sub, name, param in saved:
                sub._parameters[name] = param
        touched = {key: (sp, sub, name) for key, (ph, sub, name, sp) in placeholders.items()
                   if ph._version != versions[key]}
        if touched:
            return {**extra, **touched}
        for sub, name, sp, value in full:
            if sub is mod:
                self._keep_own(mod, name, sp, value)
            elif id(sp) in extra_values and id(sp) in self.pending:  # not a loaded one
                self._keep_written_part(sp, extra_values.pop(id(sp)))
        return {}

    def _keep_own(self, mod, name, sp, value):
        if id(sp) not in self.pending or self.owner.get(id(sp)) != (mod, name) or \
                (self.fill_only and id(sp) in self.written):
            return  # done already, or a tied registration's scratch init
        untouched = _nan_count(value)
        if untouched == value.numel():
            return  # this init left it alone; a later one (or none: an error) writes it
        if untouched:
            raise RuntimeError(f"{self._name(mod, name)} ({type(mod).__name__}): the init "
                               "wrote only part of it (NaN left in the full tensor)")
        sp.buffer.load_full_tensor(sp.index, local_of_global(value, sp.dtensor_spec))
        self.written.add(id(sp))

    @staticmethod
    def _keep_written_part(sp, value):
        """A parent's init wrote (some of) a descendant's parameter: those elements of this
        rank's piece change; the rest keep what the descendant's own init wrote."""
        begin, end = sp.flat_range
        piece = local_of_global(value, sp.dtensor_spec).reshape(-1)[begin:end]
        written = ~torch.isnan(piece)
        with torch.no_grad():
            sp.local()[written] = piece[written]

    def _name(self, mod, attr) -> str:
        prefix = self.names.get(id(mod), "")
        return f"{prefix}.{attr}" if prefix else attr

    def _check_all_written(self):
        for key, sp in self.pending.items():
            if key not in self.written:
                mod, name = self.owner.get(key, sp.registrations[0])
                raise RuntimeError(
                    f"{self._name(mod, name)} ({type(mod).__name__}) was not initialized: no "
                    "init wrote it (the module has no reset_parameters, or its init skips it); "
                    "pass materialize(..., init_fn=...) that sets it")
        for name, mod in self.order:
            for bname, buf in mod._buffers.items():
                if buf is not None and id(buf) in self.pending_buffers and \
                        not self._buffer_written(buf):
                    raise RuntimeError(
                        f"{self._name(mod, bname)} ({type(mod).__name__}) is a buffer that was "
                        "on the meta device and no init wrote it; pass materialize(..., "
                        "init_fn=...) that sets it (buffers computed in __init__ are lost on "
                        "meta)")

    def _buffer_written(self, buf) -> bool:
        """Floating: no NaN left (partly NaN is an error); others: the version counter moved
        since allocate_shards made it."""
        if buf.is_floating_point() or buf.is_complex():
            untouched = _nan_count(buf)
            if 0 < untouched < buf.numel():
                owner = next(f"{self._name(m, n)} ({type(m).__name__})" for _, m in self.order
                             for n, b in m._buffers.items() if b is buf)
                raise RuntimeError(f"{owner}: the init wrote only part of this buffer (NaN left)")
            return untouched == 0
        return buf._version != self.buffer_versions[id(buf)]


def rng_state(devices) -> tuple:
    """The generators an init on `devices` draws from: the CPU's, and each CUDA device's."""
    cuda = [d for d in devices if torch.device(d).type == "cuda"]
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda}


def set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, value in cuda.items():
        torch.cuda.set_rng_state(value, device)


def _nan_count(tensor, chunk=1 << 20) -> int:
    """NaN elements of `tensor`, counted a chunk at a time (no full-size mask)."""
    flat = tensor.detach().reshape(-1)
    return sum(int(torch.isnan(flat[i:i + chunk]).sum()) for i in range(0, flat.numel(), chunk))


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0
