"""`fully_shard`: the zero-copy FSDP runtime over DBuffers.

Call it on the units (each decoder block, say), then on the root, as with PyTorch FSDP2. Between
steps the module holds each parameter as FSDP2 does, a DTensor (our RaggedDTensor) over this
rank's range of the fp32 master shard (a TP/EP parameter's on the 2-D mesh of the shard group
and its TP/EP mesh, as FSDP2's): the unit's face (fsdp/faces.py); the engine asks for
DeepSpeed ZeRO-3's plain 1-D pieces instead (faces.ZeRO3Pieces). During forward
and backward the module holds full-shape parameters that are views of the unit's all-gathered buffer.

Hooks, per unit (the pre-forward hook registered first, as FSDP2's, so that a user's own
pre-hooks see the full parameters; every hook and collective in a profiler range named
`vescale::...`): pre-forward unshards (and prefetches the next unit's all-gather), post-forward
reshards and hooks the outputs, the first output gradient unshards again for backward (and
prefetches the unit backward runs next), and once the unit's inputs have their gradients, all of
its parameter gradients are in the full gradient buffer and are reduce-scattered. A callback at
the end of backward finishes units that no input gradient reached (the root, units fed only by
tensors without gradients), in the same order on every rank, so no rank can hang on another.
A reentrant activation checkpoint's recomputation in backward is hooked like a forward, since
its gradients come from a nested backward (docs/architecture.md, "Activation checkpointing").
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch.distributed.utils import _apply_to_tensors
from torch.profiler import record_function

from ..shard.stats import STATS
from .backward import UnitBackward, hook_outputs, register_post_backward
from .context import (ACTIVE, ForwardToken, UnitContext, check_same_units, compare_units,
                      final_callback, forward_in_progress, next_iteration, reset_iteration,
                      reuse_distances, running_backward)
from .guards import require_materialized
from .param_group import ParamGroup, ShardedState
from .policy import CommunicationPolicy, MemoryPolicy, ShardingPolicy, as_policy
from .unit_build import BuildOptions, build_unit

__all__ = ["FSDPUnit", "UnitContext", "Switches", "forward_in_progress",
           "running_backward", "reset_iteration", "serve_outside_read"]

_UNIT_IDS = itertools.count()


@dataclass
class Switches:
    """FSDP2's per-module settings (FSDPModule's setters, fsdp/module_class.py) and the unit's
    own scheduling options."""
    reshard_after_forward: bool = True
    auto_reshard_after_forward: bool = True  # the root keeps its parameters (FSDP2's default)
    max_reuse_distance: float = 0
    grads_in_place: bool = True
    requires_gradient_sync: bool = True  # False: gradients kept unreduced (as no_sync)
    requires_all_reduce: bool = True     # False (HSDP): reduce-scatter, no replica all-reduce
    reshard_after_backward: bool = True  # False: stays unsharded from backward to forward
    unshard_in_backward: bool = True     # False: backward does not all-gather (embeddings)
    forward_prefetch: list | None = None   # units to all-gather in forward (None: the next)
    backward_prefetch: list | None = None  # in backward (None: the one before in forward)
    post_optim_event: object = None      # waited for before the root's first all-gather
    is_last_backward: bool = True        # a hint only: every backward finishes reductions


def _not_traced(method):
    """torch.compile does not trace into the forward hooks (collectives, Python state): a
    compiled module's call runs them eagerly around its graph, as FSDP2's hooks are run. Each
    call is a profiler range, `vescale::pre_forward (unit)` say."""
    def ranged(self, *args, **kwargs):
        with record_function(f"vescale::{method.__name__} ({self.name})"):
            return method(self, *args, **kwargs)

    @functools.wraps(method)
    def hook(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return ranged(self, *args, **kwargs)
        # the range too runs eagerly: nothing of the hook enters the traced graph
        return torch._dynamo.disable(ranged, recursive=True)(self, *args, **kwargs)
    return hook


class FSDPUnit:
    """One fully_shard call's state: its modules' hooks, its place in the root's forward and
    backward (the context), and its ParamGroup (param_group.py), which it tells when to
    unshard, reshard and reduce."""

    def __init__(self, module, group, replicate_group, reshard_after_forward, mp_policy,
                 sharding=ShardingPolicy(), memory=MemoryPolicy(),
                 communication=CommunicationPolicy(), *, gradient_divide_factor=None,
                 ignored=(), placement=None, hpz_group=None, shard_mesh=None,
                 param_mesh=None):
        """`module`: one module, or several (FSDP2's `fully_shard([a, b])`: one unit, one
        all-gather, over all of them). `reshard_after_forward` None: True, but not for the
        root (FSDP2's default); an explicit True reshards the root too. `ignored`: ids of
        parameters left as they are (FSDP2's ignored_params). `placement(fqn, param, policy)`:
        the granularity a parameter gets instead of `policy` (FSDP2's shard_placement_fn).
        `sharding`, `memory`, `communication`: fsdp/policy.py's; `hpz_group`: the group hpZ's
        backward gathers run in (made by fully_shard from communication.hpz_partition_size);
        `shard_mesh`: fully_shard's DeviceMesh, if one (TP/EP parameters' faces join it);
        `param_mesh(param)`: (shard group, replicate group, shard mesh) of each parameter,
        where some have meshes of their own (FSDP2's ShardPlacementResult)."""
        self.modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
        self.module = self.modules[0]
        self.name = f"{'+'.join(type(m).__name__ for m in self.modules)}#{next(_UNIT_IDS)}"
        self.mp_policy = as_policy(mp_policy)
        self.sharding = sharding  # its layout and face (what the module holds between steps)
        self.fp8_linears = 0  # nn.Linears computing from FP8 tiles (fully_shard(fp8_matmul))
        self.switches = Switches(reshard_after_forward=reshard_after_forward in (None, True),
                                 auto_reshard_after_forward=reshard_after_forward is None,
                                 max_reuse_distance=memory.max_reuse_distance,
                                 grads_in_place=memory.grads_in_place)
        self.ctx = None
        self.is_root = False
        self.backward = UnitBackward(self)
        self._to_run = set()  # modules of a grouped unit yet to run this pass
        self._keep = False    # unsharded by an explicit unshard() or kept after backward
        self._storage_checked = False  # nothing left on meta: checked at the first forward
        self.group = ParamGroup(self.name, None, [], [], gradient_divide_factor)
        quantized = communication.quantized
        options = BuildOptions(
            granularity=sharding.resolve, max_buffers=sharding.max_buffers,
            align_bytes=sharding.align_bytes, mp_policy=self.mp_policy,
            ignored=frozenset(ignored), placement=placement,
            face=sharding.face, rank_local=sharding.rank_local,
            native_collectives=communication.native_collectives,
            quantize_group=communication.quantize_group if quantized else None,
            quantized=quantized, quantize_format=communication.quantization_format,
            hpz_group=hpz_group, divide_factor=gradient_divide_factor, shard_mesh=shard_mesh,
            param_mesh=param_mesh)
        self.group.device, self.group.buffers, self.group.params = \
            build_unit(self, group, replicate_group, options)

    # -- the parameter group's, read by the rest of the runtime --------------------------------

    @property
    def params(self):
        return self.group.params

    @property
    def buffers(self):
        return self.group.buffers

    @property
    def device(self):
        return self.group.device

    @property
    def offload(self):
        return self.group.offload

    @property
    def is_unsharded(self) -> bool:
        """The module holds full-shape parameters (between unshard and reshard)."""
        return self.group.state is ShardedState.UNSHARDED

    @property
    def is_meta(self) -> bool:
        return self.group.is_meta

    @property
    def numel(self) -> int:
        return self.group.numel

    def set_gradient_divide_factor(self, factor) -> None:
        """What the summed gradients are divided by from the next reduction on."""
        if factor is not None and not factor > 0:
            raise ValueError(f"gradient_divide_factor must be > 0, got {factor}")
        self.group.set_reduction(factor, self.group.force_sum)

    def set_force_sum(self, enable: bool) -> None:
        """SUM in every collective and one divide after (FSDP2's force-sum reduction)."""
        self.group.set_reduction(self.group.gradient_divide_factor, enable)

    # -- the backward's state ------------------------------------------------------------------

    def _reset_iteration(self):
        """A new forward: forget the last graph's calls."""
        self.backward.new_iteration()
        self._to_run = set()
        for p in self.params:
            p.graphed = False

    def keep_unsharded(self):
        """Stay unsharded until the next forward (set_reshard_after_backward(False))."""
        self._keep = True

    def _note_graphed(self):
        """A forward with gradients is about to run: the parameters requiring grad now are the
        ones autograd records (and will compute gradients for)."""
        if torch.is_grad_enabled():
            for p in self.params:
                if p.requires_grad:
                    p.graphed = True

    # -- unshard / reshard ---------------------------------------------------------------------

    def unshard(self, async_op: bool = True):
        """Issue this unit's all-gathers unless they are done or in flight (or the unit said
        its backward needs no parameters: set_unshard_in_backward(False))."""
        if self.group.state is not ShardedState.SHARDED:
            return
        if not self.switches.unshard_in_backward and running_backward():
            return
        backward = running_backward()
        # hpZ: a forward gather keeps secondary copies for the backward that gathers again
        regathers = self.switches.reshard_after_forward and not (
            self.is_root and self.switches.auto_reshard_after_forward)
        tag = self.ctx.iteration if self.ctx is not None and (backward or regathers) else None
        self.group.unshard(tag, backward)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self):
        if self.group.state is ShardedState.UNSHARDED:
            return
        if self.group.state is ShardedState.SHARDED:
            if not self.switches.unshard_in_backward and running_backward():
                self.group.unshard_without_gather()
                return
            self.unshard(async_op=True)
        self.group.wait_unshard()

    def reshard(self):
        self._keep = False
        self.group.reshard()

    # -- hooks ---------------------------------------------------------------------------------


    @_not_traced
    def pre_forward(self, module, args, kwargs):
        args, kwargs = cast_inputs(self.mp_policy, args, kwargs)
        calls = self.backward.calls
        if running_backward():  # an activation checkpoint's recomputation
            if torch.is_grad_enabled() and not (calls.recomputes_left or calls.forward_calls or
                                                calls.calls_without_hook):
                raise RuntimeError(
                    f"fully_shard: {self.name} runs with gradients inside a backward, but its "
                    "forward ran neither with gradients nor inside a root forward that had "
                    "them (the root itself under a reentrant checkpoint?): no gradient of it "
                    "could be reduced; checkpoint the units inside the root, or pass "
                    "use_reentrant=False")
            self.wait_unshard()
            self._note_graphed()
            if torch.is_grad_enabled() and calls.recomputes_left > 0:
                args, kwargs = self._hook_reentrant_recompute(args, kwargs)
            return args, kwargs
        if ACTIVE.ctx is None:
            if len(self.modules) > 1 and self.ctx is None:
                raise RuntimeError(f"fully_shard: {self.name} groups {len(self.modules)} "
                                   "modules and runs first, as the root; a root must be one "
                                   "module (call fully_shard on the model around them)")
            self._begin_root_forward(module)
        elif self.is_root and ACTIVE.ctx is not self.ctx:
            self.is_root = False  # ran alone before (an evaluation, a registered method)
        ctx = self.ctx = ACTIVE.ctx
        if self not in ctx.order:
            ctx.order.append(self)
        if len(self.modules) > 1 and not self._to_run and ACTIVE.opener is not module:
            # a group's pass begins (a module of it called on its own is a pass of its own)
            self._to_run = {id(m) for m in self.modules}
        # The next unit's all-gather goes out before we wait for ours (which nothing
        # prefetched if we run first): it moves while ours finishes instead of after.
        self.unshard(async_op=True)
        self._prefetch_forward()
        self.wait_unshard()
        self._note_graphed()
        STATS.log("forward", self.name)
        if torch.is_grad_enabled():
            args, kwargs, hooked = register_post_backward(self.backward, args, kwargs, ctx.token)
            if hooked:
                calls.forward_calls += 1
                calls.pending_post_backward += 1
            else:
                calls.calls_without_hook += 1
        elif ctx.token is not None:
            # No gradients inside a forward that records them: a reentrant checkpoint's first
            # pass (torch's use_reentrant=True, DeepSpeed's), whose recomputation in backward
            # is hooked then; or a call nothing differentiates, which the final callback ends.
            calls.reentrant_calls += 1
            calls.recomputes_left += 1
            calls.pending_post_backward += 1
        return args, kwargs

    def _hook_reentrant_recompute(self, args, kwargs):
        """A reentrant checkpoint recomputes one of this unit's gradient-free calls, then runs
        a nested backward over what it recorded: hook it as a forward is hooked (its outputs
        begin the unit's backward, its inputs end it), so that nested backward's gradients
        are reduced. A non-reentrant recomputation never gets here: its call recorded a
        graph in forward, and only that graph's backward brings gradients."""
        calls = self.backward.calls
        calls.recomputes_left -= 1
        args, kwargs, hooked = register_post_backward(self.backward, args, kwargs, None)
        if not hooked:  # nothing to end the unit's backward: the final callback does
            calls.pending_post_backward -= 1
            calls.calls_without_hook += 1
        calls.hook_recompute = True
        return args, kwargs

    @_not_traced
    def post_forward(self, module, args, output):
        if running_backward():
            if self.backward.calls.hook_recompute:
                self.backward.calls.hook_recompute = False
                hook_outputs(self.backward, output, None)
            return cast_output(self.mp_policy, output)
        if torch.is_grad_enabled():
            hook_outputs(self.backward, output, self.ctx.token)
        if self.is_root or ACTIVE.opener is module:  # this call began the forward
            self._end_forward()
        elif returns_own_parameter(self, output):
            serve_outside_read(self, None)  # the caller computes with it
        elif len(self.modules) > 1:  # a group reshards once all its modules ran (FSDP2)
            self._to_run.discard(id(module))
            if not self._to_run:
                self._reshard_after_forward()
        else:
            self._reshard_after_forward()
        return cast_output(self.mp_policy, output)

    def _end_forward(self):
        """The root's forward, or the call of a unit run on its own, ends."""
        ctx = self.ctx
        ACTIVE.ctx = ACTIVE.opener = None
        compare_units(ctx)
        ctx.token = None  # from now on only the graph holds it
        for unit in ctx.order:  # groups not all of whose modules ran (a chunked loss's head
            if unit._to_run:    # runs after the model's forward): their pass ends here
                unit._to_run = set()
                if unit is not self:
                    unit._reshard_after_forward()
        if not torch.is_grad_enabled() and not ctx.backward_pending:
            # inference: nothing will come back for them
            for unit in ctx.order:
                unit.reshard()
                unit._reset_iteration()
        elif not self.is_root:
            self._reshard_after_forward()
        elif self.switches.reshard_after_forward and not self.switches.auto_reshard_after_forward:
            self.reshard()  # asked for explicitly: backward gathers the root again

    def _reshard_after_forward(self):
        """A unit but the root, once its forward call (a group: its modules) ran."""
        if self.switches.reshard_after_forward and not self._reused_soon() and \
                not self.backward.calls.outside_reads:
            self.reshard()

    def _reused_soon(self) -> bool:
        """Will backward need these parameters again soon enough to keep them gathered? The
        unit backward starts with (the last of the previous forward) always: resharding it would
        only re-gather it moments later. Any other unit when fewer than `max_reuse_distance`
        elements are gathered in between, as DeepSpeed's stage3_max_reuse_distance counts."""
        if self.ctx is None or not (torch.is_grad_enabled() or self.ctx.backward_pending):
            return False  # (a forward without gradients keeps what a pending backward needs)
        distance = self.ctx.reuse_distance.get(self)
        return distance is not None and (distance == 0 or
                                         distance < self.switches.max_reuse_distance)

    def _begin_root_forward(self, module):
        """A forward begins at `module` (this unit's): the root's, or a unit's called on its
        own after a root's forward (an evaluation, a chunked loss's head), which joins that
        root's context as an extra forward (FSDP2's iteration forward root)."""
        if self.ctx is None:
            self.is_root = True
            self.ctx = UnitContext()
        elif self.ctx.callback_queued and not running_backward():
            # the last backward raised (its final callback never ran): end it now as it would
            # have ended, keeping the gradients it computed (as torch keeps them in .grad)
            final_callback(self.ctx)
        if self.ctx.root_module is None:  # (no_sync may have made the context)
            self.ctx.root_module = module
        if not self._storage_checked:  # the first forward: everything must have storage
            require_materialized(self.module, "forward")
            self._storage_checked = True
        ctx = self.ctx
        ctx.token = None  # (left behind by a forward that raised)
        event = self.switches.post_optim_event
        if event is not None:  # (FSDP2: a no-op on CPU, which has no streams)
            if self.device.type != "cpu":
                event.wait()  # all-gathers go out on this stream
            self.switches.post_optim_event = None
        if not ctx.backward_pending:
            check_same_units(ctx)  # a forward nothing differentiated (an evaluation)
            ctx.iteration = next_iteration()
            for unit in ctx.order:  # a new iteration: the optimizer may have stepped
                if unit.offload is not None:
                    unit.group.refresh_host_shards()
            # Only a forward whose graph is gone left state behind: no backward comes for it.
            for unit in ctx.order:
                if not unit._keep:  # (an explicit unshard, reshard_after_backward=False)
                    unit.reshard()
                unit._reset_iteration()
                unit.group.release_dropped_gradients()
            ctx.last_order, ctx.order = ctx.order, []
            ctx.reuse_distance = reuse_distances(ctx.last_order)
            ctx.callback_queued = False
            ctx.reducing = []
            ctx.all_reducing = []
        # else: an extra forward (a reference pass under no_grad, an evaluation, a second
        # forward whose loss joins the first's) while the first one's backward is to come
        ctx.token = ForwardToken() if torch.is_grad_enabled() else None
        if ctx.token is not None:
            ctx.live_forwards.add(ctx.token)
        ACTIVE.ctx, ACTIVE.opener = ctx, module

    def _prefetch_forward(self):
        if self.switches.forward_prefetch is not None:  # set_modules_to_forward_prefetch
            for unit in self.switches.forward_prefetch:
                if unit is not self:
                    unit.unshard(async_op=True)
            return
        order = self.ctx.last_order
        if self in order:
            i = order.index(self)
            if i + 1 < len(order):
                nxt = order[i + 1]
                if nxt is not self and not nxt.is_root:
                    nxt.unshard(async_op=True)

    def reduce_kept_gradients(self):
        """Start reducing, outside any backward, the full gradients no_sync kept: what the
        next backward that syncs would have reduced with its own (DeepSpeed's
        coalesce_grad_reduction reduces at its exit). advance/finish_gradients complete it."""
        self.group.reduce([p for p in self.params if p.unreduced],
                          self.switches.requires_all_reduce)

    def abandon_iteration(self):
        """This unit's part of `reset_iteration`."""
        self.group.abandon()
        self.reshard()  # (waits for an all-gather in flight)
        self._reset_iteration()



def cast_inputs(policy, args, kwargs):
    """FSDP2's cast_forward_inputs: floating tensors among the inputs to param_dtype."""
    dtype = policy.param_dtype
    if not (policy.cast_forward_inputs and dtype):
        return args, kwargs
    return _cast_floating((args, kwargs), dtype)


def cast_output(policy, output):
    """FSDP2's output_dtype: floating tensors among the outputs cast to it."""
    dtype = policy.output_dtype
    return output if dtype is None else _cast_floating(output, dtype)


def serve_outside_read(unit, param) -> None:
    """Code outside the unit computes with its full parameter `param` (None: one the unit
    returned) in a root's forward, DeepSpeed's "external parameters" (lending.py's
    ReadGathers). Gathered until the backward ends (the reader's backward may run before
    or after the unit's own), which reduces its gradients (UnitBackward.grad_arrives)."""
    ctx = ACTIVE.ctx
    if unit.ctx not in (None, ctx):
        raise RuntimeError(
            f"fully_shard: {param.fqn if param else unit.name} (unit {unit.name}) is read "
            "inside the forward of a model it is not part of; gather it outside that "
            "forward (deepspeed.zero.GatheredParameters) or shard both as one model")
    unit.ctx = ctx
    if unit not in ctx.order:  # (read before its own forward, or without one)
        ctx.order.append(unit)
    unit.wait_unshard()
    unit._note_graphed()  # as its forward would: a parameter without gradient gets zeros
    unit.backward.calls.outside_reads += 1


def returns_own_parameter(unit, output) -> bool:
    """A forward that returns one of `unit`'s full parameters (DeepSpeed's "external
    parameters": a module handing its bias to its caller) leaves the unit gathered until its
    backward reshards it, since the caller's forward and the caller's backward (which runs
    before this unit's) read it; resharding now would free what they read."""
    # (every forward of every unit passes here: a plain walk, nothing rebuilt)
    if isinstance(output, torch.Tensor):
        full = getattr(output, "_vescale_full", None)
        return full is not None and full.unit is unit
    if isinstance(output, (list, tuple)):
        return any(returns_own_parameter(unit, x) for x in output)
    if isinstance(output, dict):  # (transformers' ModelOutput too)
        return any(returns_own_parameter(unit, x) for x in output.values())
    return False


def _cast_floating(tree, dtype):
    """Floating tensors anywhere in `tree` (containers, dataclasses, model outputs) cast to
    `dtype`, as FSDP2 casts them (torch.distributed.utils' walk)."""
    def cast(t):
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t
    return _apply_to_tensors(cast, tree)
