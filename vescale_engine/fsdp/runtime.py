"""`fully_shard`: the zero-copy FSDP runtime over DBuffers.

Call it on the units (each decoder block, say), then on the root, as with PyTorch FSDP2. Between
steps `model.parameters()` yields plain 1-D parameters over each rank's flat piece of the fp32
master shard (FSDP1's use_orig_params style; docs/architecture.md says why), so element-wise
torch optimizers work unchanged. During forward and backward the module holds full-shape
parameters that are views of the unit's all-gathered buffer.

Hooks, per unit: pre-forward unshards (and prefetches the next unit's all-gather), post-forward
reshards and hooks the outputs, the first output gradient unshards again for backward (and
prefetches the unit backward runs next), and once the unit's inputs have their gradients, all of
its parameter gradients are in the full gradient buffer and are reduce-scattered. A callback at
the end of backward finishes units that no input gradient reached (the root, units fed only by
tensors without gradients), in the same order on every rank, so no rank can hang on another.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import itertools
import types
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..plan.granularity import parse_granularity
from ..plan.planner import DEFAULT_ALIGN_BYTES, DEFAULT_MAX_BUFFERS, TensorSpec, plan_unit
from ..shard import collectives
from ..shard.dbuffer import STATS, DBuffer, release_free_host_memory
from ..shard.ragged import RaggedShard

__all__ = ["fully_shard", "MixedPrecisionPolicy", "no_sync", "gathered_parameters",
           "full_state_dict", "sharded_state_dict", "sharded_parameters", "unit_of",
           # public within the package (fsdp/__init__ exports the names above to users)
           "units_under", "meta_leftovers", "gather_full", "gathered_buffers", "GatheredBuffer",
           "all_gather_master", "named_entries", "gather_to_rank0", "apply_caller"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """param_dtype: compute and all-gather dtype; reduce_dtype: gradient reduction dtype. The
    master shard keeps the parameters' own dtype (fp32)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class ShardedParameter:
    """One managed parameter: where the module holds it, and its two faces.

    Users and libraries set `requires_grad` on whichever face the module holds at that moment
    (PEFT's disable_adapter, `module.requires_grad_()`) or on one they kept a reference to.
    `requires_grad` reads the flag as last set on either face and puts it on both, so every
    swap (`register`) and every decision about gradients sees one flag."""

    def __init__(self, unit, fqn, registrations, buffer, index, requires_grad):
        self.unit = unit
        self.fqn = fqn
        self.registrations = registrations          # [(module, attribute name)], >1 when tied
        self.buffer = buffer
        self.index = index
        spec = buffer.layout.placements[index].spec
        self.shape = spec.shape
        self.block = spec.block
        self.sharded = nn.Parameter(buffer.master_view(index), requires_grad=requires_grad)
        self.sharded._vescale = self  # how optimizers and clipping find the flat buffer
        self._unsharded = None
        # The value a real parameter had when its unit was planned on meta (a tensor added to
        # a deferred build): kept until `FSDPUnit.allocate` writes it; loaders and inits skip it.
        self.initial = None
        self._requires_grad = requires_grad  # what both faces carried when last in agreement
        self._hooked = False
        self.graphed = False      # a forward with gradients used it with requires_grad set
        self.unreduced = False    # its gradient sits in a no_sync full buffer, not yet reduced
        self.backward_flag = None  # requires_grad when its unit's backward began

    @property
    def unsharded(self) -> nn.Parameter:
        """The full-shape parameter the module holds while unsharded (made at first unshard)."""
        if self._unsharded is None:
            with torch.inference_mode(False):  # made once, for training too
                self._unsharded = nn.Parameter(self.buffer.full_view(self.index),
                                               requires_grad=self.requires_grad)
            self._unsharded._vescale_full = self  # what it is a face of (deepspeed_params)
            self._hook_when_trainable()
        return self._unsharded

    @property
    def requires_grad(self) -> bool:
        """The flag as last set on either face; both faces carry it afterwards. (Both set
        since the last call: they were set the same way, a flag has only two values.)"""
        faces = [f for f in (self.sharded, self._unsharded) if f is not None]
        for face in faces:
            if face.requires_grad != self._requires_grad:
                self._requires_grad = face.requires_grad
                break
        for face in faces:
            if face.requires_grad != self._requires_grad:
                face.requires_grad_(self._requires_grad)
        self._hook_when_trainable()
        return self._requires_grad

    def _hook_when_trainable(self):
        """The gradient hook goes on the full-shape face once it requires grad (torch refuses a
        hook on a tensor that does not), whenever that happens first; it stays for life."""
        if not self._hooked and self._requires_grad and self._unsharded is not None:
            self._unsharded.register_hook(self._grad_arrived)
            self._hooked = True

    def _grad_arrived(self, grad):
        """Runs once all of this parameter's gradient is summed, just before autograd adds it
        into the preset `.grad` view."""
        self.buffer.grad_arrived(self.index, self._unsharded)
        return grad

    @property
    def flat_range(self) -> tuple[int, int]:
        """[begin, end) of this rank's piece in the full tensor flattened row-major: `sharded`
        holds exactly `full.reshape(-1)[begin:end]` (empty when begin == end)."""
        start, end = self.buffer.local_ranges[self.index]
        begin = self.buffer.rank * self.buffer.shard_size + start - \
            self.buffer.layout.placements[self.index].offset
        return (begin, begin + end - start) if end > start else (0, 0)

    def register(self, which: nn.Parameter):
        self.requires_grad  # the outgoing face's flag goes to the incoming one
        for module, name in self.registrations:
            module._parameters[name] = which

    def bind_storage(self) -> None:
        """After the buffer got real storage (`DBuffer.allocate`): `sharded` becomes the view of
        the new master shard. The same Parameter object (its contents are swapped), so every
        reference taken while it was on meta (`model.parameters()`, registrations) stays valid,
        with the attributes set on it."""
        attributes = dict(self.sharded.__dict__)
        fresh = nn.Parameter(self.buffer.master_view(self.index),
                             requires_grad=self.requires_grad)
        torch.utils.swap_tensors(self.sharded, fresh)  # swaps the __dict__s too
        self.sharded.__dict__.update(attributes)


@functools.lru_cache(maxsize=256)
def _cached_plan(specs, world_size, align, max_buffers):
    """Identical units (the repeated decoder layers) are planned once."""
    return plan_unit(list(specs), world_size, align, max_buffers)


_UNIT_IDS = itertools.count()


class _Context:
    """State shared by the units of one root for one forward/backward."""

    def __init__(self):
        self.order = []        # units in first pre-forward order this iteration
        self.last_order = []   # last iteration's order: what forward prefetches from
        self.reuse_distance = {}  # unit -> elements gathered between its forward and backward
        self.callback_queued = False
        self.require_sync = True
        self.reducing = []     # units whose reduce-scatter is in flight
        self.all_reducing = []  # units whose replicas' all-reduce (HSDP) is in flight
        # One token per forward with gradients since the last backward finished, alive while
        # that forward's graph is (the graph's hooks and nodes hold it): a backward can still
        # come for it, so another forward must leave the units' state for that backward.
        self.live_forwards = weakref.WeakSet()
        self.token = None

    @property
    def backward_pending(self) -> bool:
        return len(self.live_forwards) > 0


class _ForwardToken:
    """Held by one forward's autograd graph (see _Context.live_forwards)."""


class FSDPUnit:
    def __init__(self, module, group, replicate_group, reshard_after_forward, mp_policy,
                 granularity, max_buffers, align_bytes, grads_in_place, max_reuse_distance,
                 native_collectives=False):
        self.module = module
        self.native_collectives = native_collectives
        self.grads_in_place = grads_in_place
        self.name = f"{type(module).__name__}#{next(_UNIT_IDS)}"  # unique, for logs and errors
        self.reshard_after_forward = reshard_after_forward
        self.max_reuse_distance = max_reuse_distance
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.params = []
        self.buffers = []
        self.ctx = None
        self.is_root = False
        self._pending_gather = []
        self._finishers = []
        self._unsharded = False
        self._storage_checked = False  # nothing left on meta: checked at the first forward
        self._reset_iteration()
        self._build(group, replicate_group, _granularity_of(granularity), max_buffers,
                    align_bytes)

    # -- wrap time -----------------------------------------------------------------------------

    def _build(self, group, replicate_group, granularity, max_buffers, align_bytes):
        managed = _managed_ids(self.module)
        found, order = {}, []
        for mod_name, mod in self.module.named_modules(remove_duplicate=False):
            for pname, param in list(mod._parameters.items()):
                if param is None or id(param) in managed:
                    continue
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if id(param) not in found:
                    found[id(param)] = (fqn, param, [])
                    order.append(id(param))
                if (mod, pname) not in found[id(param)][2]:
                    found[id(param)][2].append((mod, pname))
        if not order:
            raise ValueError(f"fully_shard({self.name}): the module has no parameters that "
                             "another unit does not already manage")
        devices = {found[i][1].device for i in order}
        on_meta = [i for i in order if found[i][1].is_meta]
        if on_meta and len(on_meta) < len(order):
            undeferred = [i for i in on_meta if not _deferred(*found[i][1:])]
            if undeferred:
                real = next(found[i] for i in order if not found[i][1].is_meta)
                raise ValueError(f"fully_shard({self.name}): {found[undeferred[0]][0]} is on the "
                                 f"meta device but {real[0]} is on {real[1].device}; build the "
                                 "whole unit on meta (then vescale_engine.materialize) or on a "
                                 "real device")
            # A deferred build (init/zero.py) plus tensors added after it with their values (PEFT
            # adapters, new heads): planned on meta, the real values kept for allocate.
            devices = {torch.device("meta")}
        if len(devices) > 1:
            raise ValueError(f"fully_shard({self.name}): parameters are on mixed devices "
                             f"{sorted(map(str, devices))}")
        self.device = devices.pop()
        world_size = dist.get_world_size(group)
        by_dtype = {}
        for i in order:
            by_dtype.setdefault(found[i][1].dtype, []).append(i)
        for dtype, ids in by_dtype.items():
            param_dtype = self.mp_policy.param_dtype or dtype
            itemsize = min(torch.empty(0, dtype=dtype).element_size(),
                           torch.empty(0, dtype=param_dtype).element_size())
            specs = tuple(TensorSpec(found[i][0], tuple(found[i][1].shape),
                                     granularity(found[i][0]).block_size(found[i][1].shape))
                          for i in ids)
            plan = _cached_plan(specs, world_size, max(1, align_bytes // itemsize), max_buffers)
            position = {found[i][0]: i for i in ids}
            for b, layout in enumerate(plan.buffers):
                buf = DBuffer(layout, dtype=dtype, device=self.device, shard_group=group,
                              replicate_group=replicate_group, param_dtype=param_dtype,
                              reduce_dtype=self.mp_policy.reduce_dtype,
                              name=f"{self.name}[{len(self.buffers)}]",
                              native_collectives=self.native_collectives)
                self.buffers.append(buf)
                for k, placement in enumerate(layout.placements):
                    fqn, param, registrations = found[position[placement.name]]
                    sp = ShardedParameter(self, fqn, registrations, buf, k, param.requires_grad)
                    if not param.is_meta:  # a meta model gets its values at materialize
                        if buf.is_meta:
                            sp.initial = param.detach()  # written at allocate
                        else:
                            buf.load_full_tensor(k, param)
                    sp.register(sp.sharded)
                    self.params.append(sp)

    # -- per-iteration state -------------------------------------------------------------------

    def _reset_iteration(self):
        self.forward_calls = 0
        self.calls_without_hook = 0
        self.pending_post_backward = 0
        self.in_backward = False
        self.reduced = False
        for p in self.params:
            p.graphed = False
            p.backward_flag = None

    @property
    def is_meta(self) -> bool:
        """Planned on the meta device and not yet given storage (vescale_engine.materialize)."""
        return any(buf.is_meta for buf in self.buffers)

    def allocate(self, device) -> None:
        """Real, uninitialized master storage on `device` for every buffer, and the managed
        parameters re-pointed at it (the reset_parameters guards stay); the parameters that had
        values at wrap time (`initial`) get them back."""
        for buf in self.buffers:
            buf.allocate(device)
        for p in self.params:
            p.bind_storage()
            if p.initial is not None:  # the value it had at wrap time (not on meta)
                with torch.no_grad():
                    p.buffer.load_full_tensor(p.index, p.initial.to(device))
                p.initial = None
        self.device = torch.device(device)

    @property
    def trainable(self):
        return [p for p in self.params if p.requires_grad]

    def _note_graphed(self):
        """A forward with gradients is about to run: the parameters requiring grad now are the
        ones autograd records (and will compute gradients for)."""
        if torch.is_grad_enabled():
            for p in self.params:
                if p.requires_grad:
                    p.graphed = True

    def _gradient_members(self):
        """The parameters whose gradient this backward delivers, as autograd does on an
        unsharded model: recorded by a forward with requires_grad set and still set now (or
        holding an unreduced no_sync gradient). A flag changed while the unit's backward ran
        cannot be honoured either way: an error naming it."""
        for p in self.params:
            if p.backward_flag is not None and p.requires_grad != p.backward_flag:
                raise RuntimeError(
                    f"{p.fqn}: requires_grad changed from {p.backward_flag} to "
                    f"{p.requires_grad} while the backward of its unit ({self.name}) ran; set "
                    "it before that backward starts or after it ends")
            if p.backward_flag is False and p._unsharded is not None and \
                    p._unsharded.grad is not None:
                raise RuntimeError(
                    f"{p.fqn}: got a gradient with requires_grad=False at the start of its "
                    f"unit's backward ({self.name}); set requires_grad before backward starts")
        return [p for p in self.params if (p.graphed and p.requires_grad) or p.unreduced]

    @property
    def numel(self) -> int:
        """Elements of this unit's full parameters (what its all-gathers bring in)."""
        return sum(p.buffer.layout.placements[p.index].numel for p in self.params)

    # -- unshard / reshard ---------------------------------------------------------------------

    def unshard(self, async_op: bool = True):
        """Issue this unit's all-gathers unless they are done or in flight."""
        if self._unsharded or self._pending_gather:
            return
        STATS.log("unshard_issue", self.name)
        self._pending_gather = [buf.all_gather(async_op=True) for buf in self.buffers]
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self):
        if self._unsharded:
            return
        if not self._pending_gather:
            self.unshard(async_op=True)
        for work in self._pending_gather:
            work.wait()
        STATS.log("unshard_wait", self.name)
        self._pending_gather = []
        for p in self.params:
            p.register(p.unsharded)
        self._unsharded = True

    def reshard(self):
        if self._pending_gather:  # a prefetch nobody used: finish it before freeing its target
            for work in self._pending_gather:
                work.wait()
            self._pending_gather = []
        if not self._unsharded and not any(b.is_unsharded for b in self.buffers):
            return
        for p in self.params:
            p.register(p.sharded)
            if p._unsharded is not None:
                p._unsharded.grad = None
        for buf in self.buffers:
            buf.free_full()
        self._unsharded = False
        STATS.log("reshard", self.name)

    # -- hooks ---------------------------------------------------------------------------------

    def pre_forward(self, module, args, kwargs):
        if _in_backward():  # activation-checkpoint recompute: parameters only
            self.wait_unshard()
            self._note_graphed()
            return args, kwargs
        if _ACTIVE.ctx is None:
            self._begin_root_forward()
        ctx = self.ctx = _ACTIVE.ctx
        if self not in ctx.order:
            ctx.order.append(self)
        # The next unit's all-gather goes out before we wait for ours (which nothing
        # prefetched if we run first): it moves while ours finishes instead of after.
        self.unshard(async_op=True)
        self._prefetch_forward()
        self.wait_unshard()
        self._note_graphed()
        STATS.log("forward", self.name)
        if torch.is_grad_enabled():
            args, kwargs, hooked = _register_post_backward(self, args, kwargs, ctx.token)
            if hooked:
                self.forward_calls += 1
                self.pending_post_backward += 1
            else:
                self.calls_without_hook += 1
        return args, kwargs

    def post_forward(self, module, args, output):
        if _in_backward():
            return output
        if torch.is_grad_enabled():
            hook = _OutputGradHook(self, self.ctx.token)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
        if self.is_root:
            _ACTIVE.ctx = None
            self.ctx.token = None  # from now on only the graph holds it
            if not torch.is_grad_enabled() and not self.ctx.backward_pending:
                # inference: nothing will come back for them
                for unit in self.ctx.order:
                    unit.reshard()
                    unit._reset_iteration()
        elif self.reshard_after_forward and not self._reused_soon():
            self.reshard()
        return output

    def _reused_soon(self) -> bool:
        """Will backward need these parameters again soon enough to keep them gathered? The
        unit backward starts with (the last of the previous forward) always: resharding it would
        only re-gather it moments later. Any other unit when fewer than `max_reuse_distance`
        elements are gathered in between, as DeepSpeed's stage3_max_reuse_distance counts."""
        if self.ctx is None or not (torch.is_grad_enabled() or self.ctx.backward_pending):
            return False  # (a forward without gradients keeps what a pending backward needs)
        distance = self.ctx.reuse_distance.get(self)
        return distance is not None and (distance == 0 or distance < self.max_reuse_distance)

    def _begin_root_forward(self):
        self.is_root = True
        if not self._storage_checked:  # the first forward: everything must have storage
            require_materialized(self.module, "forward")
            self._storage_checked = True
        if self.ctx is None:
            self.ctx = _Context()
        ctx = self.ctx
        ctx.token = None  # (left behind by a forward that raised)
        if not ctx.backward_pending:
            # Only a forward whose graph is gone left state behind: no backward comes for it.
            for unit in ctx.order:
                unit.reshard()
                unit._reset_iteration()
                unit.release_dropped_gradients()
            ctx.last_order, ctx.order = ctx.order, []
            ctx.reuse_distance = _reuse_distances(ctx.last_order)
            ctx.callback_queued = False
            ctx.reducing = []
            ctx.all_reducing = []
        # else: an extra forward (a reference pass under no_grad, an evaluation, a second
        # forward whose loss joins the first's) while the first one's backward is to come
        ctx.token = _ForwardToken() if torch.is_grad_enabled() else None
        if ctx.token is not None:
            ctx.live_forwards.add(ctx.token)
        _ACTIVE.ctx = ctx

    def _prefetch_forward(self):
        order = self.ctx.last_order
        if self in order:
            i = order.index(self)
            if i + 1 < len(order):
                nxt = order[i + 1]
                if nxt is not self and not nxt.is_root:
                    nxt.unshard(async_op=True)

    def _pre_backward(self, grad):
        if self.in_backward:
            return grad
        self.in_backward = True
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(functools.partial(_final_callback, ctx))
        self.wait_unshard()
        STATS.log("backward", self.name)
        for p in self.params:
            p.backward_flag = p.requires_grad
        trainable = [p for p in self.params if p.backward_flag]
        for buf in {id(p.buffer): p.buffer for p in trainable}.values():
            buf.begin_backward(grads_in_place=self.grads_in_place and ctx.require_sync)
        for p in trainable:
            p.unsharded.grad = p.buffer.backward_grad_view(p.index)
        order = ctx.order
        if self.is_root:  # backward reaches the last unit of the forward first
            if order and order[-1] is not self:
                order[-1].unshard(async_op=True)
        elif self in order:  # the unit backward reaches next is the one before us in forward
            i = order.index(self)
            if i > 0:  # a no-op when it stayed gathered since its forward
                order[i - 1].unshard(async_op=True)
        return grad

    def post_backward(self):
        """All of this unit's parameter gradients are in: reduce-scatter, then reshard."""
        if self.reduced:
            return
        self.reduced = True
        STATS.log("post_backward", self.name)
        ctx = self.ctx
        for unit in ctx.all_reducing:  # issued one unit ago: overlapped with that unit
            unit.finish_gradients()
        # One reduce-scatter in flight at a time frees each full gradient buffer as early as
        # FSDP2 does; the replicas' all-reduce it leads to runs during the next unit.
        ctx.all_reducing = [unit for unit in ctx.reducing if unit.advance_gradients()]
        ctx.reducing = [self]
        self._finishers = []
        gradients = self._gradient_members() if self.in_backward else []
        if gradients:
            if not self.ctx.require_sync:
                for buf in self.buffers:
                    buf.keep_grads_unreduced()
                for p in gradients:
                    p.unreduced = True
            else:
                for buf in self.buffers:
                    members = [p for p in gradients if p.buffer is buf]
                    if members:
                        self._finishers.append((buf, members, buf.reduce_scatter(
                            accumulate=_prepare_accumulation(
                                buf, [p for p in self.params if p.buffer is buf]))))
                for p in gradients:
                    p.unreduced = False
        self.reshard()

    def release_dropped_gradients(self):
        """Free a buffer's gradient shard once the user dropped every gradient in it
        (zero_grad's set_to_none), so it does not sit through forward and backward."""
        for buf in self.buffers:
            if buf.has_grad and all(p.sharded.grad is None for p in self.params
                                    if p.buffer is buf):
                buf.release_grad()

    def advance_gradients(self) -> bool:
        """Wait for this unit's reduce-scatters and start the replicas' all-reduces; finish at
        once where there is none. Whether all-reduces are now in flight."""
        for _, _, pending in self._finishers:
            pending.wait_reduce_scatter()
        if any(pending.all_reducing for _, _, pending in self._finishers):
            return True
        self.finish_gradients()
        return False

    def finish_gradients(self):
        for buf, members, pending in self._finishers:
            pending.finish()
            for p in members:
                p.sharded.grad = buf.grad_view(p.index)
        self._finishers = []


def _reuse_distances(order) -> dict:
    """For each non-root unit of a forward order: the elements gathered between its forward and
    its backward, i.e. every later unit's parameters twice (once in forward, once in backward).
    The root is left out: it stays gathered through forward and backward."""
    distances, later = {}, 0
    for unit in reversed([u for u in order if not u.is_root]):
        distances[unit] = 2 * later
        later += unit.numel
    return distances


def _prepare_accumulation(buf, params) -> bool:
    """Does the shard hold gradients to add to? Not if the user dropped all of the buffer's
    (zero_grad's set_to_none): then the reduce-scatter writes straight into the shard. Ranges
    of dropped ones are zeroed first: a tensor without `.grad` has zeros in the shard, which
    the norm and the optimizer rely on (this backward may bring it none, being frozen)."""
    dropped = [p for p in params if p.sharded.grad is None]
    if len(dropped) == len(params):
        return False
    for p in dropped:  # rare: some dropped, some kept
        buf.grad_view(p.index).zero_()
    return True


def _final_callback(ctx):
    for unit in reversed(ctx.order):
        if unit.in_backward or unit.forward_calls or unit.calls_without_hook:
            unit.post_backward()
    for unit in reversed(ctx.order):  # every all-reduce in flight before waiting for any
        unit.advance_gradients()
    for unit in reversed(ctx.order):
        unit.finish_gradients()
        unit.reshard()
        unit._reset_iteration()
    ctx.reducing = []
    ctx.all_reducing = []
    ctx.live_forwards = weakref.WeakSet()  # this backward took what they had pending
    if any(unit.device.type == "cpu" for unit in ctx.order):
        release_free_host_memory()  # the step's full buffers are all free now


class _Active:
    ctx = None


_ACTIVE = _Active()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward runs once the unit's own backward is done."""

    @staticmethod
    def forward(ctx, unit, token, *inputs):
        ctx.unit = unit
        ctx.token = token  # the graph holds its forward's token (see _Context.live_forwards)
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        ctx.token = None
        unit.pending_post_backward -= 1
        if unit.pending_post_backward == 0 and unit.calls_without_hook == 0:
            unit.post_backward()
        return (None, None, *grads)


class _OutputGradHook:
    """The hook on a unit's outputs: the unit's backward begins. It holds its forward's token
    for as long as the graph holds the hook."""

    def __init__(self, unit, token):
        self.unit = unit
        self.token = token

    def __call__(self, grad):
        return self.unit._pre_backward(grad)


def _register_post_backward(unit, args, kwargs, token):
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return args, kwargs, False
    out = _PostBackward.apply(unit, token, *[flat[i] for i in positions])
    out = out if isinstance(out, tuple) else (out,)
    for i, t in zip(positions, out):
        flat[i] = t
    args, kwargs = tree_unflatten(flat, spec)
    return args, kwargs, True


def _granularity_of(granularity):
    """fqn -> Granularity, from one policy ("rows:16") or {"default": ..., "overrides":
    {glob pattern: policy}} where the first matching pattern wins."""
    if not isinstance(granularity, dict):
        policy = parse_granularity(granularity)
        return lambda fqn: policy
    default = parse_granularity(granularity.get("default", "rows:1"))
    overrides = [(pattern, parse_granularity(g))
                 for pattern, g in granularity.get("overrides", {}).items()]

    def resolve(fqn):
        return next((g for pattern, g in overrides if fnmatch.fnmatchcase(fqn, pattern)),
                    default)
    return resolve


def _managed_ids(module):
    ids = set()
    for sub in module.modules():
        unit = getattr(sub, "_vescale_unit", None)
        if unit is not None:
            for p in unit.params:
                ids.add(id(p.sharded))
    return ids


def _resolve_mesh(mesh):
    """(shard group, replicate group or None) from a DeviceMesh, a process group, or None."""
    if mesh is None:
        return dist.group.WORLD, None
    if isinstance(mesh, dist.ProcessGroup):
        return mesh, None
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh)}")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"mesh has {mesh.size()} ranks but the process group has "
                         f"{dist.get_world_size()}")
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:  # (replicate, shard): HSDP
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D")


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None, granularity="rows:1",
                max_buffers: int = DEFAULT_MAX_BUFFERS,
                align_bytes: int = DEFAULT_ALIGN_BYTES, grads_in_place: bool = True,
                max_reuse_distance: int = 0, native_collectives: bool = False) -> nn.Module:
    """Shard `module`'s parameters (those no inner unit manages) into planner-laid DBuffers.

    `granularity` is one policy ("element", "rows:K", "tile:RxC", "tensor") or {"default":
    policy, "overrides": {parameter-name glob: policy}}; names are relative to `module`.
    `grads_in_place` lets backward write each gradient over its own full parameter once that
    parameter's gradient is complete (one full-size buffer per unit in backward instead of
    two); turn it off for a model whose backward still reads a parameter's value after the
    parameter's gradient is done (a detached use, say: autograd then raises "modified by an
    inplace operation" rather than computing with a wrong value).
    `max_reuse_distance` (DeepSpeed's stage3_max_reuse_distance, in elements): a unit stays
    gathered from its forward to its backward when fewer elements than this are gathered in
    between (every later unit's parameters, in forward and again in backward); 0 keeps only
    the last unit, which backward starts with. More speed (no re-gather), more memory.
    `native_collectives`: use the backend's own all-gather and reduce-scatter on gloo too
    (NCCL always gets them; on gloo the default is faster point-to-point exchanges), so that
    the path GPUs take runs on CPU.
    Errors (no parameters, mixed devices, a mesh that does not match the process group, a
    second call on the same module) are raised here, before any collective.
    """
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialized process group "
                           "(torch.distributed.init_process_group)")
    if getattr(module, "_vescale_unit", None) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    group, replicate_group = _resolve_mesh(mesh)
    if max_reuse_distance < 0:
        raise ValueError(f"max_reuse_distance must be >= 0, got {max_reuse_distance}")
    unit = FSDPUnit(module, group, replicate_group, reshard_after_forward, mp_policy,
                    granularity, max_buffers, align_bytes, grads_in_place, max_reuse_distance,
                    native_collectives)
    module._vescale_unit = unit
    _guard_apply(module)
    _guard_reset_parameters(unit)
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward)
    return module


# ---------------------------------------------------------------------------------------------
# What user code needs around sharded modules.

def unit_of(module: nn.Module) -> FSDPUnit | None:
    return getattr(module, "_vescale_unit", None)


def units_under(module):
    """Every FSDP unit under `module` (itself included), in module order."""
    return [u for u in (unit_of(m) for m in module.modules()) if u is not None]


def sharded_parameters(module: nn.Module):
    """(fqn, ShardedParameter) for every managed parameter under `module`."""
    for unit in units_under(module):
        for p in unit.params:
            yield p.fqn if unit.module is module else _qualify(module, unit.module, p.fqn), p


def _qualify(root, sub, fqn):
    for name, mod in root.named_modules():
        if mod is sub:
            return f"{name}.{fqn}" if name else fqn
    return fqn


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Backward passes inside accumulate full gradients locally, without communication; the
    first backward after it reduce-scatters everything accumulated."""
    ctxs = set()
    for unit in units_under(module):
        if unit.ctx is None:
            unit.ctx = _Context()
        ctxs.add(unit.ctx)
    for ctx in ctxs:
        ctx.require_sync = False
    try:
        yield
    finally:
        for ctx in ctxs:
            ctx.require_sync = True


@contextlib.contextmanager
def gathered_parameters(module: nn.Module, writeback: bool = False, *, rank0_only: bool = False,
                        cpu_offload: bool = False):
    """Full fp32 parameters in `module` for the duration (like DeepSpeed's GatheredParameters
    and FSDP1's summon_full_params). DBuffers are gathered one at a time: with `cpu_offload`
    each is copied to CPU (pinned memory when it is on CUDA) and freed before the next is
    gathered, so the device never holds more than one full buffer; without it the full
    parameters are views of the gathered buffers, on the device. `rank0_only`: only global
    rank 0 holds full parameters, the others keep their shards. With `writeback`, changes made
    inside are kept (every rank must make the same change)."""
    if writeback and rank0_only:
        raise ValueError("gathered_parameters: writeback=True needs the full parameters on every "
                         "rank; it cannot be combined with rank0_only=True")
    keep = not rank0_only or dist.get_rank() == 0
    full = gather_full(module, keep, "host" if cpu_offload else "view")
    faces = {p: nn.Parameter(value, requires_grad=p.requires_grad) for p, value in full.items()}
    for p, face in faces.items():
        p.register(face)
    try:
        yield module
    finally:
        for p, face in faces.items():
            if writeback:
                with torch.no_grad():
                    p.buffer.load_full_tensor(p.index, face)  # this rank's range of it
            if face.requires_grad != p.requires_grad:  # set inside: it stays set
                p.sharded.requires_grad_(face.requires_grad)
            p.register(p.sharded)


def full_state_dict(module: nn.Module, *, rank0_only: bool = False,
                    cpu_offload: bool = False) -> dict:
    """Every parameter's full value (fp32 master) plus the buffers, keyed as
    `module.state_dict()` (tied names share one tensor). DBuffers are gathered one at a time and
    their parameters copied out (to CPU with `cpu_offload`, pinned when the source is CUDA)
    before the next is gathered: the device holds the result plus at most one full buffer, or
    just one full buffer with `cpu_offload`. With `rank0_only` only global rank 0 gets the
    values; the other ranks take part in the gathers and get {}."""
    keep = not rank0_only or dist.get_rank() == 0
    full = gather_full(module, keep, "host" if cpu_offload else "clone")
    if not keep:
        return {}
    registered = {p: nn.Parameter(value, requires_grad=False) for p, value in full.items()}
    for p, value in registered.items():  # only so that state_dict names them as the module does
        p.register(value)
    ours = {id(value) for value in registered.values()}
    try:
        sd = module.state_dict(keep_vars=True)
    finally:
        for p in full:
            p.register(p.sharded)
    out = {}
    for key, value in sd.items():
        if id(value) in ours:
            out[key] = value.detach()
        else:  # a module buffer: a copy, as for the parameters
            out[key] = _copy_out(value.detach(), "host" if cpu_offload else "clone")
            _finish_host_copies(value.device, "host" if cpu_offload else "clone")
    return out


def gather_full(module, keep, mode) -> dict:
    """{ShardedParameter: full value} for every managed parameter under `module` (empty when
    not `keep`); `gather_selected` says how."""
    require_materialized(module, "gathering full parameters")
    return gather_selected([p for unit in units_under(module) for p in unit.params], keep, mode)


def gather_selected(params, keep=True, mode="view", compute_dtype=False) -> dict:
    """{ShardedParameter: full value} for `params` (empty when not `keep`). One DBuffer at a
    time, in the order `params` first name them: all-gather its master into a full buffer,
    copy the selected parameters out (`mode`: "view" keeps the buffer alive as their storage,
    "clone" copies on the device, "host" to CPU), and drop the buffer before gathering the
    next. `compute_dtype`: the values in the buffer's compute dtype (what forward computes
    with) instead of the master's."""
    out = {}
    for gathered in gathered_buffers(params):
        if keep:
            for p in gathered.members:  # no local keeps a view past the buffer's turn
                out[p] = _copy_out(gathered.value(p, compute_dtype), mode)
            _finish_host_copies(gathered.buffer.master.device, mode)
    return out


class GatheredBuffer:
    """One DBuffer's master all-gathered into a full tensor, valid while `gathered_buffers`
    yields it (afterwards only views taken from it keep that tensor alive)."""

    def __init__(self, buffer, members, full):
        self.buffer, self.members, self.full = buffer, members, full

    def value(self, p, compute_dtype=False):
        """Parameter `p`'s full-shape value: a view of the gathered tensor (a copy in the
        buffer's compute dtype with `compute_dtype`, when that differs)."""
        pl = self.buffer.layout.placements[p.index]
        value = self.full[pl.offset:pl.offset + pl.numel].view(p.shape)
        if compute_dtype and self.buffer.param_dtype != value.dtype:
            value = value.to(self.buffer.param_dtype)
        return value


def gathered_buffers(params):
    """Yield a GatheredBuffer per DBuffer of `params`, one at a time, in the order `params`
    first name them; each full tensor is dropped (unless a view of it was kept) before the
    next is made. Every rank must run it to the end (one collective per buffer)."""
    selected = {}
    for p in params:
        selected.setdefault(p.buffer, {})[p] = None
    for buf, members in selected.items():
        full = torch.empty(buf.world_size * buf.shard_size, dtype=buf.master.dtype,
                           device=buf.master.device)
        all_gather_master(full, buf)
        gathered = GatheredBuffer(buf, list(members), full)
        del full
        try:
            yield gathered
        finally:
            gathered.full = None  # the caller's reference no longer holds the storage


def all_gather_master(full, buf):
    collectives.all_gather(full, buf.master, buf.shard_group, async_op=False,
                           native=buf.native)


def named_entries(module) -> list:
    """[(names, tensor)] for every parameter and persistent buffer of `module`, as
    `state_dict` names them: a tied parameter once, with all its names. Managed parameters
    appear as their 1-D sharded piece (`tensor._vescale` is the ShardedParameter)."""
    groups = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            groups.setdefault(id(value), ([], value))[0].append(name)
    return list(groups.values())


def gather_to_rank0(module, dtype=None):
    """Yield (names, source, value) for every parameter and persistent buffer of `module` on
    global rank 0: `names` as `state_dict` gives them (a tied parameter once, with all its
    names), `source` the module's tensor (a managed parameter's sharded piece), `value` its full
    tensor as a host copy, floating values cast to `dtype` (None keeps theirs). One DBuffer is
    all-gathered at a time and dropped before the next. The other ranks yield nothing, but every
    rank must run the generator to its end (one collective per DBuffer)."""
    rank0 = dist.get_rank() == 0

    def copied(value):
        value = value.detach()
        cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return value.to(device="cpu", dtype=cast, copy=True)

    entries = named_entries(module)
    names_of = {id(t): names for names, t in entries}
    params = [p for unit in units_under(module) for p in unit.params]
    for gathered in gathered_buffers(params):
        if rank0:
            for p in gathered.members:
                names = names_of.get(id(p.sharded))
                if names is not None:
                    yield names, p.sharded, copied(gathered.value(p))
    if rank0:
        for names, tensor in entries:
            if getattr(tensor, "_vescale", None) is None:
                yield names, tensor, copied(tensor)


def _pinned_staging(device) -> bool:
    """Host copies from CUDA go through pinned memory, asynchronously (one wait per buffer)."""
    return torch.device(device).type == "cuda"


def _copy_out(value, mode):
    if mode == "view":
        return value
    if mode == "clone":
        return value.clone()
    pinned = _pinned_staging(value.device)
    out = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pinned)
    out.copy_(value, non_blocking=pinned)
    return out


def _finish_host_copies(device, mode):
    if mode == "host" and _pinned_staging(device):
        torch.cuda.current_stream(device).synchronize()


def sharded_state_dict(module: nn.Module) -> dict:
    """{fqn: (local 1-D piece of the fp32 master, its RaggedShard)} for every managed parameter:
    what each rank checkpoints, with no communication."""
    out = {}
    for fqn, p in sharded_parameters(module):
        placement = p.buffer.layout.placements[p.index]
        spec = RaggedShard(p.shape, p.block, placement.local_units(p.buffer.world_size))
        out[fqn] = (p.sharded.detach(), spec)
    return out


def release(module: nn.Module) -> None:
    """Undo fully_shard's runtime on every unit under `module`: reshard, free gradient and full
    buffers, and remove the forward hooks, so nothing of the engine runs or stays allocated."""
    for sub in module.modules():
        unit = unit_of(sub)
        if unit is None:
            continue
        unit.reshard()
        for buf in unit.buffers:
            buf.release_grad()
            buf.drop_full_grad()
        for p in unit.params:
            p.sharded.grad = None
        for hooks, fn in ((sub._forward_pre_hooks, unit.pre_forward),
                          (sub._forward_hooks, unit.post_forward)):
            for handle_id, hook in list(hooks.items()):
                if hook == fn:
                    del hooks[handle_id]
                    sub._forward_pre_hooks_with_kwargs.pop(handle_id, None)
        sub.__dict__.pop("_apply", None)  # fully_shard's guards
        for mod, _ in {id(m): (m, n) for p in unit.params for m, n in p.registrations}.values():
            mod.__dict__.pop("reset_parameters", None)
        del sub._vescale_unit


# ---------------------------------------------------------------------------------------------
# Moves and casts of a sharded module.

def _guard_apply(module: nn.Module) -> None:
    """Route `module._apply` (behind .to/.cuda/.half/.float/.to_empty/...) through a check:
    torch would replace each parameter's data with a new tensor, silently cutting it off from
    its DBuffer. A call that leaves every managed parameter as it is (`.to` its own device and
    dtype, `.float()` on fp32) still runs; anything else raises before touching the module."""
    module._apply = types.MethodType(_guarded_apply, module)  # parents' recursion calls it too


def _guarded_apply(self, fn, recurse=True):
    _check_apply(self, fn)
    return type(self)._apply(self, fn, recurse)


def _check_apply(module, fn):
    call = apply_caller(fn)
    for _, p in sharded_parameters(module):
        before = p.sharded
        try:
            with torch.no_grad():
                after = fn(before)
        except Exception as err:  # e.g. .cuda() on a CPU-only build: still not a no-op
            kind = "to_empty" if before.is_meta else "move"
            raise RuntimeError(_apply_error(module, call, kind)) from err
        if after is before:
            continue
        kind = "to_empty" if call == "to_empty" or before.is_meta else \
            "cast" if after.dtype != before.dtype else "move"
        raise RuntimeError(_apply_error(module, call, kind))


def apply_caller(fn) -> str:
    """The nn.Module method that made `fn` ('to', 'cuda', 'half', ...), from its qualname."""
    parts = getattr(fn, "__qualname__", "").split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "Module" else "_apply"


def _apply_error(module, call, kind) -> str:
    what = {"move": "build or move the model before fully_shard/initialize (initialize puts it "
                    "on the rank's device)",
            "cast": "the fp32 master stays fp32; set the compute dtype with MixedPrecisionPolicy "
                    "(param_dtype) or the bf16/fp16 config",
            "to_empty": "for a model built on the meta device call "
                        "vescale_engine.materialize(model) (storage and init, shard by shard) or "
                        "vescale_engine.materialize.allocate_shards(model) (storage only, e.g. "
                        "before load_hf_checkpoint)"}[kind]
    return (f"{type(module).__name__}.{call}(...) on a module sharded by fully_shard would detach "
            f"its parameters from their sharded buffers: {what}")


# ---------------------------------------------------------------------------------------------
# Deferred (meta-device) initialization: what must hold before values are used.

_DEFERRED_MARK = "_vescale_deferred"  # init/record.py's MARK: set on what a deferred build made


def _deferred(param, registrations) -> bool:
    """A meta parameter that a vescale `deepspeed.zero.Init` build made (or a copy of one of
    its modules made, as PEFT's modules_to_save): its values come at initialize."""
    return getattr(param, _DEFERRED_MARK, None) is not None or \
        any(module.__dict__.get(_DEFERRED_MARK) is not None for module, _ in registrations)


def meta_leftovers(module: nn.Module) -> list:
    """Names (as `module.state_dict` would say them) of the managed parameters and the module
    buffers under `module` that are still on the meta device."""
    left = [fqn for fqn, p in sharded_parameters(module) if p.buffer.is_meta]
    managed = {id(p.sharded) for _, p in sharded_parameters(module)}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.is_meta and id(param) not in managed:
            left.append(name)
    left += [name for name, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
    return left


def require_materialized(module: nn.Module, when: str) -> None:
    left = meta_leftovers(module)
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise RuntimeError(f"{left[0]}{more} is still on the meta device at {when}: call "
                           "vescale_engine.materialize(model) (or load_hf_checkpoint) first")


def _guard_reset_parameters(unit) -> None:
    """Between steps a managed parameter is a flat 1-D piece of the shard, so a module's
    `reset_parameters()` would fail deep inside torch.nn.init (or init the pieces wrongly).
    Route it through a check that names what to call instead; it runs as usual while the module
    holds full-shape parameters (inside `gathered_parameters`, or materialize's own calls)."""
    for module in {id(m): m for p in unit.params for m, _ in p.registrations}.values():
        if callable(getattr(type(module), "reset_parameters", None)) and \
                "reset_parameters" not in module.__dict__:
            module.reset_parameters = types.MethodType(_guarded_reset_parameters, module)


def _guarded_reset_parameters(self, *args, **kwargs):
    flat = [name for name, param in self._parameters.items()
            if getattr(param, "_vescale", None) is not None and param is param._vescale.sharded
            and tuple(param.shape) != tuple(param._vescale.shape)]
    if flat:
        raise RuntimeError(
            f"{type(self).__name__}.reset_parameters(): {flat[0]} is a flat piece of the sharded "
            "master between steps, not a full tensor; initialize through "
            "vescale_engine.materialize(model) on a model built on the meta device, or inside "
            "`with gathered_parameters(model, writeback=True):`")
    return type(self).reset_parameters(self, *args, **kwargs)
