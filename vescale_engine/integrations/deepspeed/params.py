"""DeepSpeed's per-parameter ZeRO-3 surface, as libraries read it, on vescale-sharded parameters.

Under a ZeRO-3 config (`is_deepspeed_zero3_enabled()`), TRL, PEFT, Accelerate and transformers
reach past the engine into the parameters. What they call in the versions we test (both ends
of the ranges in vescale_engine/versions.py: trl 0.24 and 1.16, peft 0.18.1 and 0.21,
accelerate 1.11 and 1.16, transformers 5.6 and 5.24), and what we give them:

- `p.ds_status` (trl.trainer.utils.maybe_gather_lm_head_ctx, before the fused LM head's
  loss): AVAILABLE while the object holds the full tensor (the full-shape parameter a unit
  registers while gathered, or a sharded one inside GatheredParameters), else NOT_AVAILABLE.
  The same on every rank, since it decides a collective.
- `p.ds_shape` (PEFT's tuners sizing adapters, PeftModel's word-embedding lookup): the full
  shape.
- `deepspeed.zero.GatheredParameters(params, modifier_rank=None)` (TRL's generation, its
  fused LM head, ref-model sync and vLLM weight sync; PEFT; transformers' embedding resize):
  `GatheredShards` below. The objects passed hold the full tensors for the duration (what
  DeepSpeed does: callers keep references, e.g. TRL's `weight = lm_head.weight`), gathered
  one DBuffer at a time; read-only they are in the compute dtype (what forward and DeepSpeed's
  bf16 parameters hold), with `modifier_rank=r` in the master dtype, and rank r's values are
  broadcast and written into every rank's master shard on exit. Without modifier_rank,
  changes are dropped on exit, as DeepSpeed drops them.
- A parameter read inside a forward while its unit is sharded (a parent computing with a
  child's weight after the child ran: `F.linear(x, self.child.weight)`): gathered and handed
  out full, as DeepSpeed's ZeROOrderedDict gathers its "external parameters"
  (fsdp/lending.py's `ReadGathers`, the engine's modules' `_parameters`); outside a forward the sharded piece,
  as DeepSpeed hands out its partition.
- TRL's `remove_hooks` / `add_hooks` (trl.models.utils, around generation inside
  GatheredParameters(model.parameters())): for our engine they suspend and restore the units'
  forward hooks (integrations/trl/hooks.py), so generation computes with the gathered
  parameters and re-gathers nothing.

Left out, because no library reads them on parameters: `ds_id` (DeepSpeed's own test for "a
ZeRO-3 parameter": giving it to ours would hand them to DeepSpeed's internals), `ds_tensor`,
`ds_active_sub_modules` (only TRL's remove_hooks, replaced for our engine). Left out on
purpose: `ds_numel`. PEFT reads it only where `p.numel() == 0` (ModulesToSaveWrapper.update
then enters GatheredParameters); our shards are empty on some ranks only, so those ranks
alone would enter a collective and hang.

The parameters themselves are DeepSpeed's view between steps: `ZeRO3Pieces`, the face
(fsdp/faces.py) the engine asks for in its ShardingPolicy, leaves each one this rank's plain 1-D
piece of the master shard, which GatheredParameters fills in place and whose `ds_shape` is the
full shape (FSDP2's RaggedDTensor of the global shape cannot be filled so). Which object holds
the full tensor now (a gathered unit's, or one lent here) is fsdp/lending.py's.

What gives the libraries these names (the ds_* descriptors on `torch.nn.Parameter`,
`deepspeed.zero.GatheredParameters`) is this package's __init__.py, TRL's two functions
integrations/trl/: this module answers DeepSpeed's.
"""
from __future__ import annotations

import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from ...fsdp.guards import require_materialized
from ...fsdp.lending import holds_full, lend_full, return_full
from ...fsdp.param import sharding_of
from ...fsdp.state_dict import gather_selected
from ...fsdp.unit import forward_in_progress, running_backward

__all__ = ["GatheredShards", "serve_optimizer", "local_piece", "full_value", "set_full_value"]


# -- GatheredParameters ------------------------------------------------------------------------

class GatheredShards:
    """`deepspeed.zero.GatheredParameters` over vescale-sharded parameters (see the module
    docstring). Objects that hold the full tensor already (inside their unit's forward, or an
    enclosing context) are left as they are."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, others=None):
        self.modifier_rank = modifier_rank
        self.others = others  # DeepSpeed's context over the rest of a mixed list, or None
        self.requested = list({id(p): (p, sharding_of(p, full=True))
                               for p in params}.values())
        self.held = []  # (object, its own data, ShardedParameter), in gathering order
        if fwd_module is not None:
            raise NotImplementedError(
                "deepspeed.zero.GatheredParameters(fwd_module=...) on vescale-sharded "
                f"parameters ({_name(self.requested[0][1])}, ...): vescale has no external "
                "parameters; put the module that uses them in the same FSDP unit "
                "(vescale.wrap_policy)")

    def __enter__(self):
        todo = []
        for p, sp in self.requested:
            if holds_full(p, sp):
                if self.modifier_rank is not None:
                    raise RuntimeError(
                        f"deepspeed.zero.GatheredParameters(modifier_rank={self.modifier_rank}) "
                        f"on {_name(sp)} while it is gathered already (by its unit's forward or an "
                        "enclosing GatheredParameters): changes would not reach its shard; "
                        "write to it outside the forward, in one context")
                continue
            if isinstance(p, DTensor) and sp.dtensor_spec is None:
                raise RuntimeError(
                    f"deepspeed.zero.GatheredParameters on {_name(sp)}: fully_shard made it a "
                    "DTensor of its global shape (FSDP2's view), which cannot be filled in "
                    "place; shard with fully_shard(..., sharding=ShardingPolicy("
                    "face=ZeRO3Pieces())) "
                    "(DeepSpeed ZeRO-3's view, what the engine uses) or read it with "
                    "full_tensor()")
            if p is not sp.sharded:
                raise RuntimeError(
                    f"deepspeed.zero.GatheredParameters on the full-shape parameter of "
                    f"{_name(sp)} kept from an earlier forward (its unit is sharded now): pass the "
                    "parameter the module holds now")
            if self.modifier_rank is not None and sp.unit.is_unsharded:
                raise RuntimeError(
                    f"deepspeed.zero.GatheredParameters(modifier_rank={self.modifier_rank}) on "
                    f"{_name(sp)} inside its unit's forward: the unit computes with its own "
                    "gathered copy, so the change would not be seen; write outside the forward")
            todo.append((p, sp))
        in_step = forward_in_progress() or running_backward()
        if torch.is_grad_enabled() and in_step:
            trainable = [_name(sp) for p, sp in todo if p.requires_grad]
            if trainable:
                raise RuntimeError(
                    f"deepspeed.zero.GatheredParameters on {trainable[0]} (called from "
                    f"{_callers()}) inside a forward with gradients: its gradient would not "
                    "reach its unit's reduce-scatter; keep the module that owns it in the unit "
                    "that uses it (e.g. lm_head in the root unit, the default wrap policy)")
        full = {}
        if todo:
            require_materialized(todo[0][1].unit.module, "GatheredParameters")
            full = gather_selected([sp for _, sp in todo], mode="view",
                                        compute_dtype=self.modifier_rank is None)
        if self.others is not None:
            self.others.__enter__()
        for p, sp in todo:
            own = p.data
            p.data = full[sp]
            self.held.append((p, own, sp))
            lend_full(p)
            if p.requires_grad and torch.is_grad_enabled():
                _guard_gradient(p, sp)

    def __exit__(self, *exc):
        try:
            if self.modifier_rank is not None and self.held and exc[0] is None:
                self._write_back()
        finally:
            for p, own, _ in self.held:
                p.data = own
                return_full(p)
            self.held = []
            if self.others is not None:
                self.others.__exit__(*exc)
        return False

    def _write_back(self):
        """Rank `modifier_rank`'s values into every rank's master shard (and replica)."""
        values, wrong = [], None
        for p, _, sp in self.held:
            if tuple(p.shape) != tuple(sp.shape):
                wrong = wrong or f"{_name(sp)} has shape {list(p.shape)}, not {list(sp.shape)}"
            values.append(p.data)
        ok = torch.tensor([wrong is None], dtype=torch.int32, device=self.held[0][2].buffer.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank learns of a bad value, no hang
        if not ok.item():
            raise RuntimeError(f"deepspeed.zero.GatheredParameters(modifier_rank="
                               f"{self.modifier_rank}): {wrong or 'another rank changed a shape'}; "
                               "the shards keep their values")
        with torch.no_grad():
            for value, (_, _, sp) in zip(values, self.held):
                value = value.to(sp.buffer.master.dtype).contiguous()
                dist.broadcast(value, src=self.modifier_rank)
                sp.buffer.load_full_tensor(sp.index, value)


def _name(sp) -> str:
    """The parameter's name in its unit, and the unit's class (`weight of Linear`)."""
    return f"{sp.fqn} of {sp.unit.name.split('#')[0]}"


_GUARDED = WeakIdKeyDictionary()  # parameters whose hook `_guard_gradient` registered


def _guard_gradient(p, sp) -> None:
    """A gradient computed through the full tensor a context lent the shard object would be
    accumulated as if it were this rank's piece: stop it instead (registered once)."""
    if p in _GUARDED:
        return
    local = (sp.flat_range[1] - sp.flat_range[0],)

    def check(grad):
        if tuple(grad.shape) != local:
            raise RuntimeError(
                f"a gradient for {_name(sp)} was computed with its full value from "
                "deepspeed.zero.GatheredParameters: vescale reduces gradients only through the "
                "unit's forward; compute with the module inside its unit's forward instead")
        return grad
    p.register_hook(check)
    _GUARDED[p] = True


def _callers(limit: int = 3) -> str:
    names, frame = [], sys._getframe(1)
    while frame is not None and len(names) < limit:
        if not frame.f_globals.get("__name__", "").startswith("vescale_engine."):
            code = frame.f_code
            names.append(getattr(code, "co_qualname", code.co_name))
        frame = frame.f_back
    return " <- ".join(names)


# -- DeepSpeed's safe_* accessors: fp32 parameter, gradient, optimizer state ---------------------
# `deepspeed.utils.safe_get_full_fp32_param(p)` and its kin, as DeepSpeed defines them for ZeRO-3
# parameters: "full" is the whole tensor, gathered (every rank calls, a collective), "local" is
# this rank's piece (its flat range, 1-D). What they name: "param" the fp32 master, "grad" the
# reduced fp32 gradient (after backward, before zero_grad), or an optimizer state key (AdamW's
# exp_avg / exp_avg_sq), in the optimizer `serve_optimizer` was given (the engine's).

_OPTIMIZERS = weakref.WeakSet()


def serve_optimizer(optimizer) -> None:
    _OPTIMIZERS.add(optimizer)


def local_piece(sp, what: str):
    """This rank's piece of `what` for `sp`, a view that writes through; None where there is
    none (no gradient yet, a state the optimizer does not keep)."""
    buf, i = sp.buffer, sp.index
    if what == "param":
        return buf.master_view(i)
    if what == "grad":
        return None if sp.sharded.grad is None else buf.grad_view(i)
    for opt in list(_OPTIMIZERS):
        for key, start in ((sp.sharded, None), (buf.master, buf.local_ranges[i])):
            state = opt.state.get(key) if key in opt.state else None
            value = None if state is None else state.get(what)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                flat = value.reshape(-1)
                return flat if start is None else flat[start[0]:start[1]]
    return None


def full_value(sp, what: str):
    """The full-shape tensor of `what` (a collective over the shard group), or None on every
    rank when no rank has it."""
    piece = local_piece(sp, what)
    buf = sp.buffer
    have = torch.tensor([piece is not None], dtype=torch.int32, device=buf.device)
    dist.all_reduce(have, op=dist.ReduceOp.MAX, group=buf.shard_group)
    if not have.item():
        return None
    dtype = piece.dtype if piece is not None else buf.master.dtype
    shard = torch.zeros(buf.shard_size, dtype=dtype, device=buf.device)
    start, end = buf.local_ranges[sp.index]
    if piece is not None and end > start:
        shard[start:end] = piece
    full = torch.empty(buf.world_size * buf.shard_size, dtype=dtype, device=buf.device)
    dist.all_gather_into_tensor(full, shard, group=buf.shard_group)
    placement = buf.layout.placements[sp.index]
    return full[placement.offset:placement.offset + placement.numel].view(sp.shape)


def set_full_value(sp, what: str, value: torch.Tensor) -> None:
    """Write this rank's range of the full `value` into `what` (every rank passes the same
    value, as DeepSpeed requires; no collective). A parameter's next forward computes with it
    (DeepSpeed's only after its next step, which copies its fp32 partition into the module's)."""
    target = local_piece(sp, what)
    if target is None:
        raise RuntimeError(f"{what} of {_name(sp)}: none to set (no gradient since zero_grad, "
                           "or an optimizer state this optimizer does not keep)")
    if tuple(value.shape) != tuple(sp.shape):
        raise ValueError(f"{what} of {_name(sp)}: a value of shape {list(value.shape)} for a "
                         f"parameter of shape {list(sp.shape)}")
    begin, end = sp.flat_range
    with torch.no_grad():
        target.copy_(value.detach().reshape(-1)[begin:end])
    if what == "param":
        sp.unit.reshard()  # a gather made already (a prefetch) holds the old values
