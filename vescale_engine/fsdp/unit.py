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
A reentrant activation checkpoint's recomputation in backward is hooked like a forward, since
its gradients come from a nested backward (docs/architecture.md, "Activation checkpointing").
"""
from __future__ import annotations

import functools
import itertools
import threading
import zlib
import weakref

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor
from torch.distributed.utils import _apply_to_tensors
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..launch.collective_timeout import explain_timeout
from ..plan.planner import TensorSpec, plan_unit
from ..plan.quantization import quantization_block
from ..shard.collectives import default_device
from ..shard.dbuffer import DBuffer
from ..shard.host_memory import release_free_host_memory
from ..shard.stats import STATS
from .guards import is_deferred, require_materialized
from .dtensor_params import dtensor_spec_of, layout_key, local_tensor, tp_block
from .param import ShardedParameter
from .policy import as_policy, granularity_of

__all__ = ["FSDPUnit", "UnitContext", "forward_in_progress", "running_backward", "reset_iteration"]


@functools.lru_cache(maxsize=256)
def _cached_plan(specs, world_size, align, max_buffers):
    """Identical units (the repeated decoder layers) are planned once."""
    return plan_unit(list(specs), world_size, align, max_buffers)


_UNIT_IDS = itertools.count()
_ITERATIONS = itertools.count()  # tags a root's forward/backward (hpZ's secondary copies)


class UnitContext:
    """State shared by the units of one root for one forward/backward."""

    def __init__(self):
        self.order = []        # units in first pre-forward order this iteration
        self.last_order = []   # last iteration's order: what forward prefetches from
        self.reuse_distance = {}  # unit -> elements gathered between its forward and backward
        self.callback_queued = False
        self.require_sync = True
        self.reducing = []     # units whose reduce-scatter is in flight
        self.backward_task = None  # autograd's id of the backward running (the outermost)
        self.all_reducing = []  # units whose replicas' all-reduce (HSDP) is in flight
        # One token per forward with gradients since the last backward finished, alive while
        # that forward's graph is (the graph's hooks and nodes hold it): a backward can still
        # come for it, so another forward must leave the units' state for that backward.
        self.live_forwards = weakref.WeakSet()
        # The tokens whose graph the running backward reached: the forwards it takes. One it
        # did not reach stays pending (a chunked loss backwards each chunk of the head on its
        # own, then the model's forward).
        self.reached = set()
        self.token = None
        self.iteration = None  # this iteration's tag: no optimizer step happens inside one
        self.root_module = None  # the root's module: units are named by their path in it
        self.unit_paths = None   # id(module) -> its path in root_module, made once
        # Per forward: the all-reduce comparing the units every rank ran (_check_same_units)
        self.unit_checks = []

    @property
    def backward_pending(self) -> bool:
        return len(self.live_forwards) > 0


def _not_traced(method):
    """torch.compile does not trace into the forward hooks (collectives, Python state): a
    compiled module's call runs them eagerly around its graph, as FSDP2's hooks are run."""
    @functools.wraps(method)
    def hook(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return method(*args, **kwargs)
        return torch._dynamo.disable(method, recursive=True)(*args, **kwargs)
    return hook


class _ForwardToken:
    """Held by one forward's autograd graph (see UnitContext.live_forwards)."""


class FSDPUnit:
    def __init__(self, module, group, replicate_group, reshard_after_forward, mp_policy,
                 granularity, max_buffers, align_bytes, grads_in_place, max_reuse_distance,
                 native_collectives=False, gradient_divide_factor=None, *, ignored=(),
                 placement=None, flat_parameters=False, quantize_group=None, quantized=(),
                 hpz_group=None, quantize_format="int8"):
        """`module`: one module, or several (FSDP2's `fully_shard([a, b])`: one unit, one
        all-gather, over all of them). `reshard_after_forward` None: True, but not for the
        root (FSDP2's default); an explicit True reshards the root too. `ignored`: ids of
        parameters left as they are (FSDP2's ignored_params). `placement(fqn, param, policy)`:
        the granularity a parameter gets instead of `policy` (FSDP2's shard_placement_fn)."""
        self.modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
        self.module = self.modules[0]
        self.flat_parameters = flat_parameters  # sharded faces: plain pieces, not RaggedDTensors
        self.gradient_divide_factor = gradient_divide_factor
        self.force_sum = False
        self.native_collectives = native_collectives
        # int8 weight all-gathers and/or gradient reduce-scatters (shard/quantize.py)
        self.quantize_group = quantize_group if quantized else None
        self.quantized = tuple(quantized)
        self.quantize_format = quantize_format
        self.fp8_linears = 0  # nn.Linears computing from FP8 tiles (fully_shard(fp8_matmul))
        self.hpz_group = hpz_group  # hpZ: backward re-gathers inside this group
        self.grads_in_place = grads_in_place
        self.name = f"{'+'.join(type(m).__name__ for m in self.modules)}#{next(_UNIT_IDS)}"
        self.auto_reshard_after_forward = reshard_after_forward is None
        self.reshard_after_forward = reshard_after_forward in (None, True)
        self.max_reuse_distance = max_reuse_distance
        self.mp_policy = as_policy(mp_policy)
        self._ignored = frozenset(ignored)
        self._placement = placement
        # FSDP2's per-module switches (FSDPModule's setters, fsdp/module_class.py)
        self.requires_gradient_sync = True  # False: gradients kept unreduced (as no_sync)
        self.requires_all_reduce = True     # False (HSDP): reduce-scatter, no replica all-reduce
        self.reshard_after_backward = True  # False: stays unsharded from backward to forward
        self.unshard_in_backward = True     # False: backward does not all-gather (embeddings)
        self.forward_prefetch = None        # units to all-gather in forward (None: the next)
        self.backward_prefetch = None       # in backward (None: the one before in forward)
        self.post_optim_event = None        # waited for before the root's first all-gather
        self.is_last_backward = True        # a hint only: every backward finishes reductions
        self._to_run = set()                # modules of a grouped unit yet to run this pass
        self._keep = False  # unsharded by an explicit unshard() or kept after backward
        self.offload = None  # CPUOffloadPolicy's pin_memory, once offloaded (None: not)
        self.params = []
        self.buffers = []
        self.ctx = None
        self.is_root = False
        self._pending_gather = []
        self._finishers = []
        self._unsharded = False
        self._storage_checked = False  # nothing left on meta: checked at the first forward
        self._reset_iteration()
        self._build(group, replicate_group, granularity_of(granularity), max_buffers,
                    align_bytes)

    # -- wrap time -----------------------------------------------------------------------------

    def _build(self, group, replicate_group, granularity, max_buffers, align_bytes):
        managed = set().union(*(_managed_ids(m) for m in self.modules)) | self._ignored
        found, order, home = {}, [], {}
        for k, root in enumerate(self.modules):
            for mod_name, mod in root.named_modules(remove_duplicate=False):
                for pname, param in list(mod._parameters.items()):
                    if param is None or id(param) in managed:
                        continue
                    fqn = f"{mod_name}.{pname}" if mod_name else pname
                    if id(param) not in found:
                        found[id(param)] = (fqn, param, [])
                        order.append(id(param))
                        home[id(param)] = (k, root)  # the module its fqn is relative to
                    if (mod, pname) not in found[id(param)][2]:
                        found[id(param)][2].append((mod, pname))
        # the planner's names: unique over the unit (a group's modules may share names)
        plan_name = {i: found[i][0] if len(self.modules) == 1 else f"{home[i][0]}/{found[i][0]}"
                     for i in order}
        for i in order:
            self._check_parameter(*found[i][:2])
        if not order:  # (as FSDP2: a root whose parameters the inner units all manage)
            self.device = default_device(group)
            return
        devices = {found[i][1].device for i in order}
        on_meta = [i for i in order if found[i][1].is_meta]
        if on_meta and len(on_meta) < len(order):
            undeferred = [i for i in on_meta if not is_deferred(*found[i][1:])]
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
        dtensor_specs = {i: dtensor_spec_of(found[i][0], found[i][1]) for i in order}
        local = {i: local_tensor(found[i][1]) for i in order}
        # One buffer never mixes tensors of different TP/EP layouts: the gradient norm and the
        # optimizers treat a buffer's gradient as a whole (what it is a piece of).
        by_kind = {}
        for i in order:
            key = (found[i][1].dtype, layout_key(dtensor_specs[i]))
            by_kind.setdefault(key, []).append(i)
        for (dtype, _), ids in by_kind.items():
            param_dtype = self.mp_policy.param_dtype or dtype
            reduce_dtype = self.mp_policy.reduce_dtype_for(dtype)
            # gradients accumulate in the reduce dtype when it is the wider one (as FSDP2's)
            grad_dtype = reduce_dtype if reduce_dtype.is_floating_point and \
                reduce_dtype.itemsize > param_dtype.itemsize else param_dtype
            itemsize = min(torch.empty(0, dtype=dtype).element_size(),
                           torch.empty(0, dtype=param_dtype).element_size())
            specs = tuple(TensorSpec(plan_name[i], tuple(local[i].shape),
                                     self._block(tp_block(
                                         self._granularity(granularity, found[i][0],
                                                           found[i][1], local[i].shape)
                                         .block_size(local[i].shape),
                                         local[i].shape, dtensor_specs[i]), local[i]))
                          for i in ids)
            plan = _cached_plan(specs, world_size, max(1, align_bytes // itemsize), max_buffers)
            position = {plan_name[i]: i for i in ids}
            for b, layout in enumerate(plan.buffers):
                buf = DBuffer(layout, dtype=dtype, device=self.device, shard_group=group,
                              replicate_group=replicate_group, param_dtype=param_dtype,
                              reduce_dtype=reduce_dtype, grad_dtype=grad_dtype,
                              name=f"{self.name}[{len(self.buffers)}]",
                              native_collectives=self.native_collectives,
                              divide_factor=self.gradient_divide_factor,
                              quantize_group=self.quantize_group, quantized=self.quantized,
                              hpz_group=self.hpz_group,
                              quantize_format=self.quantize_format)
                self.buffers.append(buf)
                for k, placement in enumerate(layout.placements):
                    fqn, param, registrations = found[position[placement.name]]
                    i = position[placement.name]
                    sp = ShardedParameter(self, fqn, registrations, buf, k, param.requires_grad,
                                          dtensor_specs[i])
                    sp.home = home[i][1]
                    if param.is_meta and dtensor_specs[i] is None:
                        sp.build_writes = param._version  # materialize compares (why: there)
                    if not param.is_meta:  # a meta model gets its values at materialize
                        if buf.is_meta:
                            sp.initial = local[i].detach()  # written at allocate
                        else:
                            buf.load_full_tensor(k, local[i])
                    sp.register(sp.sharded)
                    self.params.append(sp)
        for i in order:  # a module still holding one of them shares it with this unit
            found[i][1]._vescale_sharded_by = self.name

    def _check_parameter(self, fqn, param):
        """FSDP2's refusals of a parameter, with its error types, and tensor subclasses (FSDP2's
        all-gather extensions among them), which we do not shard. A tensor another unit shards
        already (a weight tied between separately wrapped modules; FSDP2 refuses it at the
        first forward): two copies would train apart. A scalar or a non-contiguous tensor:
        FSDP2 has no dim 0 to shard or no layout to keep; the engine's plain pieces (DeepSpeed's
        view) take them, as DeepSpeed does."""
        if getattr(param, "_vescale_sharded_by", None) is not None:
            raise ValueError(f"Parameter '{fqn}' is shared with a parameter already managed by "
                             f"another FSDP group ({param._vescale_sharded_by}). For "
                             "shared/tied parameters, use fully_shard([module_a, module_b]) to "
                             "place them in the same FSDP group.")
        local = param._local_tensor if isinstance(param, DTensor) else param
        if hasattr(local, "fsdp_pre_all_gather"):
            raise NotImplementedError(
                f"fully_shard: {fqn} is a {type(local).__name__} defining fsdp_pre_all_gather / "
                "fsdp_post_all_gather: FSDP2's all-gather extensions (torchao float8, NF4) are "
                "not supported by vescale_engine's fully_shard")
        if is_traceable_wrapper_subclass(local):  # its pieces would be copied as plain values
            raise NotImplementedError(
                f"fully_shard: {fqn} is a tensor subclass ({type(local).__name__}), which "
                "vescale_engine's fully_shard does not shard (plain tensors and DTensors only)")
        if self.flat_parameters:
            return
        if param.dim() == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {fqn} to a "
                             "1D tensor with numel equal to 1.")
        if not param.is_contiguous():
            raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: "
                                      f"{fqn} shape={tuple(param.shape)} "
                                      f"stride={param.stride()}")

    def _block(self, block, tensor):
        """The planner block: under quantized weights small blocks joined up to a group."""
        if self.quantize_group is None:
            return block
        return min(quantization_block(block, self.quantize_group), max(1, tensor.numel()))

    def _granularity(self, granularity, fqn, param, shape):
        policy = granularity(fqn)
        if self._placement is None:
            return policy
        return self._placement(fqn, param, policy, tuple(shape))

    # -- per-iteration state -------------------------------------------------------------------

    def _reset_iteration(self):
        """A new forward: forget the last graph's calls."""
        self.forward_calls = 0       # calls that recorded a graph, their inputs hooked
        self.calls_without_hook = 0  # calls that recorded a graph, no input requiring grad
        self.reentrant_calls = 0     # calls without gradients inside a forward that has them
        self._hook_recompute = False
        self._to_run = set()
        for p in self.params:
            p.graphed = False
        self._end_backward()

    def _end_backward(self):
        """A backward finished: what the next one through the same graph (retain_graph=True)
        starts from. Each hooked call and each reentrant checkpoint's recomputation (whose
        nested backward brings that call's gradients) is owed its post-backward again."""
        self.pending_post_backward = self.forward_calls + self.reentrant_calls
        self.recomputes_left = self.reentrant_calls
        self.in_backward = False
        self.reduced = False
        self.delivers_grads = False
        self.accumulated = False  # a parameter's .grad was added to (ShardedParameter)
        for p in self.params:
            p.backward_flag = None

    @property
    def is_unsharded(self) -> bool:
        """The module holds full-shape parameters (between unshard and reshard)."""
        return self._unsharded

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
        if self.offload is not None:
            self.offload_to_host(self.offload)

    def set_gradient_divide_factor(self, factor) -> None:
        """What the summed gradients are divided by from the next reduction on."""
        if factor is not None and not factor > 0:
            raise ValueError(f"gradient_divide_factor must be > 0, got {factor}")
        self.gradient_divide_factor = factor
        for buf in self.buffers:
            buf.set_reduction(factor, self.force_sum)

    def set_force_sum(self, enable: bool) -> None:
        """SUM in every collective and one divide after (FSDP2's force-sum reduction)."""
        self.force_sum = enable
        for buf in self.buffers:
            buf.set_reduction(self.gradient_divide_factor, enable)

    def offload_to_host(self, pin_memory: bool) -> None:
        """FSDP2's CPUOffloadPolicy: the master and gradient shards live in host memory (pinned
        on an accelerator when asked), the sharded parameters view them, so any optimizer over
        `model.parameters()` steps on the host; each all-gather copies this rank's shard in the
        compute dtype from the host (DBuffer.move_master_to_host, ZeRO-Offload's offload_param).
        A unit still on meta moves at allocate."""
        self.offload = pin_memory
        if self.is_meta:
            return
        for buf in self.buffers:
            if buf.compute is not None:
                continue
            pin = pin_memory and buf.device.type != "cpu"
            S = buf.shard_size
            master, grad = (torch.empty(S, dtype=buf.master.dtype, pin_memory=pin)
                            for _ in range(2))
            compute = torch.empty(S, dtype=buf.param_dtype, pin_memory=pin) \
                if buf.param_dtype != buf.master.dtype else None
            buf.move_master_to_host(master, grad, compute_on_host=True, host_compute=compute)
        for p in self.params:
            p.bind_storage()

    def refresh_host_shards(self) -> None:
        """Offloaded buffers: the compute-dtype shard cast again from the host master (a fused
        optimizer step writes it without moving its version counter)."""
        for buf in self.buffers:
            if buf.compute is not None:
                buf.compute.refresh(force=True)

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
            if p.backward_flag is False and p.full_face is not None and \
                    p.full_face.grad is not None:
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
        """Issue this unit's all-gathers unless they are done or in flight (or the unit said
        its backward needs no parameters: set_unshard_in_backward(False))."""
        if self._unsharded or self._pending_gather:
            return
        if not self.unshard_in_backward and running_backward():
            return
        STATS.log("unshard_issue", self.name)
        backward = running_backward()
        # hpZ: a forward gather keeps secondary copies for the backward that gathers again
        regathers = self.reshard_after_forward and not (self.is_root and
                                                        self.auto_reshard_after_forward)
        tag = self.ctx.iteration if self.ctx is not None and (backward or regathers) else None
        self._pending_gather = [buf.all_gather(async_op=True, hpz_tag=tag, backward=backward)
                                for buf in self.buffers]
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self):
        if self._unsharded:
            return
        if not self._pending_gather and not self.unshard_in_backward and running_backward():
            self._unshard_without_gather()
            return
        if not self._pending_gather:
            self.unshard(async_op=True)
        with explain_timeout(f"the all-gather of unit {self.name}'s parameters"):
            for work in self._pending_gather:
                work.wait()
        STATS.log("unshard_wait", self.name)
        self._pending_gather = []
        for p in self.params:
            p.register(p.unsharded)
        self._unsharded = True

    def _unshard_without_gather(self):
        """Full-shape parameters over zeroed full buffers, no all-gather: backward computes
        this unit's gradients without reading its parameters (set_unshard_in_backward(False),
        e.g. an embedding); the zeros keep the buffers' padding a zero gradient."""
        for buf in self.buffers:
            buf._allocate("full").zero_()
        for p in self.params:
            p.register(p.unsharded)
        self._unsharded = True

    def reshard(self):
        self._keep = False
        if self._pending_gather:  # a prefetch nobody used: finish it before freeing its target
            with explain_timeout(f"the all-gather of unit {self.name}'s parameters"):
                for work in self._pending_gather:
                    work.wait()
            self._pending_gather = []
        if not self._unsharded and not any(b.is_unsharded for b in self.buffers):
            return
        for p in self.params:
            p.register(p.sharded)
            p.drop_full_grads()
        for buf in self.buffers:
            buf.free_full()
        self._unsharded = False
        STATS.log("reshard", self.name)

    # -- hooks ---------------------------------------------------------------------------------

    @_not_traced
    def pre_forward(self, module, args, kwargs):
        args, kwargs = self._cast_inputs(args, kwargs)
        if running_backward():  # an activation checkpoint's recomputation
            if torch.is_grad_enabled() and not (self.recomputes_left or self.forward_calls or
                                                self.calls_without_hook):
                raise RuntimeError(
                    f"fully_shard: {self.name} runs with gradients inside a backward, but its "
                    "forward ran neither with gradients nor inside a root forward that had "
                    "them (the root itself under a reentrant checkpoint?): no gradient of it "
                    "could be reduced; checkpoint the units inside the root, or pass "
                    "use_reentrant=False")
            self.wait_unshard()
            self._note_graphed()
            if torch.is_grad_enabled() and self.recomputes_left > 0:
                args, kwargs = self._hook_reentrant_recompute(args, kwargs)
            return args, kwargs
        if _ACTIVE.ctx is None:
            if len(self.modules) > 1 and self.ctx is None:
                raise RuntimeError(f"fully_shard: {self.name} groups {len(self.modules)} "
                                   "modules and runs first, as the root; a root must be one "
                                   "module (call fully_shard on the model around them)")
            self._begin_root_forward(module)
        elif self.is_root and _ACTIVE.ctx is not self.ctx:
            self.is_root = False  # ran alone before (an evaluation, a registered method)
        ctx = self.ctx = _ACTIVE.ctx
        if self not in ctx.order:
            ctx.order.append(self)
        if len(self.modules) > 1 and not self._to_run and _ACTIVE.opener is not module:
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
            args, kwargs, hooked = _register_post_backward(self, args, kwargs, ctx.token)
            if hooked:
                self.forward_calls += 1
                self.pending_post_backward += 1
            else:
                self.calls_without_hook += 1
        elif ctx.token is not None:
            # No gradients inside a forward that records them: a reentrant checkpoint's first
            # pass (torch's use_reentrant=True, DeepSpeed's), whose recomputation in backward
            # is hooked then; or a call nothing differentiates, which the final callback ends.
            self.reentrant_calls += 1
            self.recomputes_left += 1
            self.pending_post_backward += 1
        return args, kwargs

    def _hook_reentrant_recompute(self, args, kwargs):
        """A reentrant checkpoint recomputes one of this unit's gradient-free calls, then runs
        a nested backward over what it recorded: hook it as a forward is hooked (its outputs
        begin the unit's backward, its inputs end it), so that nested backward's gradients
        are reduced. A non-reentrant recomputation never gets here: its call recorded a
        graph in forward, and only that graph's backward brings gradients."""
        self.recomputes_left -= 1
        args, kwargs, hooked = _register_post_backward(self, args, kwargs, None)
        if not hooked:  # nothing to end the unit's backward: the final callback does
            self.pending_post_backward -= 1
            self.calls_without_hook += 1
        self._hook_recompute = True
        return args, kwargs

    @_not_traced
    def post_forward(self, module, args, output):
        if running_backward():
            if self._hook_recompute:
                self._hook_recompute = False
                self._hook_outputs(output, None)
            return self._cast_output(output)
        if torch.is_grad_enabled():
            self._hook_outputs(output, self.ctx.token)
        if self.is_root or _ACTIVE.opener is module:  # this call began the forward
            self._end_forward()
        elif len(self.modules) > 1:  # a group reshards once all its modules ran (FSDP2)
            self._to_run.discard(id(module))
            if not self._to_run:
                self._reshard_after_forward()
        else:
            self._reshard_after_forward()
        return self._cast_output(output)

    def _end_forward(self):
        """The root's forward, or the call of a unit run on its own, ends."""
        ctx = self.ctx
        _ACTIVE.ctx = _ACTIVE.opener = None
        _compare_units(ctx)
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
        elif self.reshard_after_forward and not self.auto_reshard_after_forward:
            self.reshard()  # asked for explicitly: backward gathers the root again

    def _reshard_after_forward(self):
        """A unit but the root, once its forward call (a group: its modules) ran."""
        if self.reshard_after_forward and not self._reused_soon():
            self.reshard()

    def _cast_inputs(self, args, kwargs):
        """FSDP2's cast_forward_inputs: floating tensors among the inputs to param_dtype."""
        dtype = self.mp_policy.param_dtype
        if not (self.mp_policy.cast_forward_inputs and dtype):
            return args, kwargs
        return _cast_floating((args, kwargs), dtype)

    def _cast_output(self, output):
        """FSDP2's output_dtype: floating tensors among the outputs cast to it."""
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else _cast_floating(output, dtype)

    def _hook_outputs(self, output, token):
        hook = _OutputGradHook(self, token)
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    def _reused_soon(self) -> bool:
        """Will backward need these parameters again soon enough to keep them gathered? The
        unit backward starts with (the last of the previous forward) always: resharding it would
        only re-gather it moments later. Any other unit when fewer than `max_reuse_distance`
        elements are gathered in between, as DeepSpeed's stage3_max_reuse_distance counts."""
        if self.ctx is None or not (torch.is_grad_enabled() or self.ctx.backward_pending):
            return False  # (a forward without gradients keeps what a pending backward needs)
        distance = self.ctx.reuse_distance.get(self)
        return distance is not None and (distance == 0 or distance < self.max_reuse_distance)

    def _begin_root_forward(self, module):
        """A forward begins at `module` (this unit's): the root's, or a unit's called on its
        own after a root's forward (an evaluation, a chunked loss's head), which joins that
        root's context as an extra forward (FSDP2's iteration forward root)."""
        if self.ctx is None:
            self.is_root = True
            self.ctx = UnitContext()
        if self.ctx.root_module is None:  # (no_sync may have made the context)
            self.ctx.root_module = module
        if not self._storage_checked:  # the first forward: everything must have storage
            require_materialized(self.module, "forward")
            self._storage_checked = True
        ctx = self.ctx
        ctx.token = None  # (left behind by a forward that raised)
        if self.post_optim_event is not None:  # (FSDP2: a no-op on CPU, which has no streams)
            if self.device.type != "cpu":
                self.post_optim_event.wait()  # all-gathers go out on this stream
            self.post_optim_event = None
        if not ctx.backward_pending:
            _check_same_units(ctx)  # a forward nothing differentiated (an evaluation)
            ctx.iteration = next(_ITERATIONS)
            for unit in ctx.order:  # a new iteration: the optimizer may have stepped
                if unit.offload is not None:
                    unit.refresh_host_shards()
            # Only a forward whose graph is gone left state behind: no backward comes for it.
            for unit in ctx.order:
                if not unit._keep:  # (an explicit unshard, reshard_after_backward=False)
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
        _ACTIVE.ctx, _ACTIVE.opener = ctx, module

    def _prefetch_forward(self):
        if self.forward_prefetch is not None:  # set_modules_to_forward_prefetch
            for unit in self.forward_prefetch:
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

    def _pre_backward(self, grad):
        if self.in_backward:
            return grad
        self.in_backward = True
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            ctx.backward_task = torch._C._current_graph_task_id()
            Variable._execution_engine.queue_callback(functools.partial(_final_callback, ctx))
        self.wait_unshard()
        STATS.log("backward", self.name)
        for p in self.params:
            p.backward_flag = p.requires_grad
        trainable = [p for p in self.params if p.backward_flag]
        # Whether this backward adds into the parameters' .grad: not torch.autograd.grad
        # (input gradients). Parameters that only a reentrant checkpoint inside the unit
        # uses are not in this graph but in its nested backward's: `accumulated` tells.
        self.delivers_grads = any(_accumulates(p) for p in trainable)
        # A gradient may be written over its parameter once complete, unless something reads
        # the value after that: a retained graph's next backward, the next recomputation of a
        # reentrant checkpoint (each has a nested backward of its own), or the next forward
        # (the unit stays unsharded after backward: set_reshard_after_backward(False)).
        in_place = self.grads_in_place and self.syncs_gradients and \
            not self.reentrant_calls and not _keeps_graph() and self.reshard_after_backward
        for buf in {id(p.buffer): p.buffer for p in trainable}.values():
            buf.begin_backward(grads_in_place=in_place)
        for p in trainable:
            p.preset_grad()
        order = ctx.order
        if self.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            for unit in self.backward_prefetch:
                if unit is not self:
                    unit.unshard(async_op=True)
        elif self.is_root:  # backward reaches the last unit of the forward first
            if order and order[-1] is not self:
                order[-1].unshard(async_op=True)
        elif self in order:  # the unit backward reaches next is the one before us in forward
            i = order.index(self)
            if i > 0:  # a no-op when it stayed gathered since its forward
                order[i - 1].unshard(async_op=True)
        return grad

    def in_nested_backward(self) -> bool:
        """Autograd runs a backward inside the one that began this backward: a reentrant
        checkpoint's, over its recomputation (another recomputation may follow it)."""
        return torch._C._current_graph_task_id() != self.ctx.backward_task

    def post_backward(self):
        """All of this unit's parameter gradients are in: reduce-scatter, then reshard."""
        if self.reduced:
            return
        self.reduced = True
        for buf in self.buffers:
            buf.flush_deferred_grads()
        STATS.log("post_backward", self.name)
        ctx = self.ctx
        for unit in ctx.all_reducing:  # issued one unit ago: overlapped with that unit
            unit.finish_gradients()
        # One reduce-scatter in flight at a time frees each full gradient buffer as early as
        # FSDP2 does; the replicas' all-reduce it leads to runs during the next unit.
        ctx.all_reducing = [unit for unit in ctx.reducing if unit.advance_gradients()]
        ctx.reducing = [self]
        self._finishers = []
        delivered = self.in_backward and (self.delivers_grads or self.accumulated)
        gradients = self._gradient_members() if delivered else []
        if gradients:
            if not self.syncs_gradients:
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
                                buf, [p for p in self.params if p.buffer is buf]),
                            all_reduce=self.requires_all_reduce)))
                for p in gradients:
                    p.unreduced = False
        self.reshard_after_its_backward()

    def reduce_kept_gradients(self):
        """Start reducing, outside any backward, the full gradients no_sync kept: what the
        next backward that syncs would have reduced with its own (DeepSpeed's
        coalesce_grad_reduction reduces at its exit). advance/finish_gradients complete it."""
        kept = [p for p in self.params if p.unreduced]
        for buf in {id(p.buffer): p.buffer for p in kept}.values():
            self._finishers.append((buf, [p for p in kept if p.buffer is buf], buf.reduce_scatter(
                accumulate=_prepare_accumulation(buf, [p for p in self.params if p.buffer is buf]),
                all_reduce=self.requires_all_reduce)))
        for p in kept:
            p.unreduced = False

    @property
    def syncs_gradients(self) -> bool:
        """Backward reduces gradients (neither no_sync nor set_requires_gradient_sync(False))."""
        return self.ctx.require_sync and self.requires_gradient_sync

    def reshard_after_its_backward(self):
        """Reshard, unless set_reshard_after_backward(False) keeps the unit unsharded for the
        next forward (its `.grad` views of the full gradient buffers are dropped)."""
        if self.reshard_after_backward or not self._unsharded:
            self.reshard()
            return
        for p in self.params:
            p.drop_full_grads()
        self._keep = True

    def abandon_iteration(self):
        """This unit's part of `reset_iteration`."""
        for _, _, pending in self._finishers:
            pending.discard()
        self._finishers = []
        for buf in self.buffers:
            buf.discard_unreduced()
        for p in self.params:
            p.unreduced = False
        self.reshard()  # (waits for an all-gather in flight)
        self._reset_iteration()

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
        with explain_timeout(f"the reduce-scatter of unit {self.name}'s gradients"):
            for _, _, pending in self._finishers:
                pending.wait_reduce_scatter()
        if any(pending.all_reducing for _, _, pending in self._finishers):
            return True
        self.finish_gradients()
        return False

    def fold_outside_grads(self):
        """Sharded parameters that got a gradient from outside their unit's forward and none
        reduced for them in this backward (no_sync, or no use inside): it goes into the
        gradient shard too, which the flat optimizers and the norm read."""
        for p in self.params:
            if p.foreign_grad() is not None:
                p.buffer.zero_grad_if_released()
                p.set_sharded_grad()

    def finish_gradients(self):
        for buf, members, pending in self._finishers:
            with explain_timeout(f"the replicas' all-reduce of unit {self.name}'s gradients"):
                pending.finish()
            if pending.deferred:  # HSDP, no all-reduce yet: the shard's gradient is not due
                continue
            for p in members:
                p.set_sharded_grad()
        self._finishers = []


def reset_iteration(units) -> None:
    """FSDP2's reset_iter_state over `units` (the root's and everything under it) after a
    forward or backward that raised: what is in flight is waited for, this iteration's
    gradients that have not reached a gradient shard are discarded (reduce-scatters in
    flight, HSDP partial sums, no_sync accumulation), every unit is resharded and forgets the
    iteration, and their context starts clean."""
    ctxs = {id(u.ctx): u.ctx for u in units if u.ctx is not None}
    for unit in units:
        unit.abandon_iteration()
    for ctx in ctxs.values():
        if _ACTIVE.ctx is ctx:
            _ACTIVE.ctx = _ACTIVE.opener = None
        ctx.order, ctx.last_order, ctx.reuse_distance = [], [], {}
        ctx.callback_queued = False
        ctx.reducing, ctx.all_reducing = [], []
        ctx.backward_task = None
        ctx.live_forwards = weakref.WeakSet()
        ctx.reached = set()
        ctx.token = None


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
    # (a gradient autograd put on the sharded parameter is added after: set_sharded_grad)
    dropped = [p for p in params if p.sharded.grad is None or p.foreign_grad() is not None]
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
        unit.reshard_after_its_backward()
        unit._end_backward()
        unit.fold_outside_grads()
    for unit in ctx.order:  # host gradient shards (offload) copied during backward: arrived
        for buf in unit.buffers:
            buf.wait_grad_copies()
    ctx.reducing = []
    ctx.all_reducing = []
    ctx.callback_queued = False  # a retained graph's next backward queues its own
    ctx.live_forwards -= ctx.reached  # this backward took what they had pending
    ctx.reached = set()
    if any(unit.device.type == "cpu" for unit in ctx.order):
        release_free_host_memory()  # the step's full buffers are all free now
    _check_same_units(ctx)  # before the optimizer steps with these gradients


# -- every rank ran the same units ----------------------------------------------------------------
# Ranks whose forwards run different units (MoE routing, a module some ranks skip) pair their
# all-gathers wrongly: of units of one size, silently (each computes with another's
# parameters); of different sizes or counts, they wait forever (launch/stall.py names them).
# So each forward ends with one small asynchronous all-reduce of a digest of the units it ran,
# over the root's shard group, and the end of backward (or the next forward, for a forward
# nothing differentiated) checks it: a difference is one line naming the first unit that
# differs, before the optimizer steps.

def _compare_units(ctx):
    holder = next((u for u in ctx.order if u.buffers), None)
    if holder is None:
        return
    group = holder.buffers[0].shard_group
    if dist.get_world_size(group) == 1:
        return
    if ctx.unit_paths is None:  # paths, not unit names: those count wraps in this process
        ctx.unit_paths = {id(m): name or "(the root)"
                          for name, m in ctx.root_module.named_modules()}
    names = [ctx.unit_paths.get(id(u.module), u.name.split("#")[0]) for u in ctx.order]
    digest = zlib.crc32("\n".join(names).encode())
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=holder.buffers[0].device)
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)
    ctx.unit_checks.append((work, both, names, group))


def _check_same_units(ctx):
    checks, ctx.unit_checks = ctx.unit_checks, []
    for work, both, names, group in checks:
        with explain_timeout("the comparison of the units every rank ran"):
            work.wait()
        if both[0].item() != -both[1].item():  # the largest digest is not the smallest
            raise RuntimeError(_different_units(names, group))


def _different_units(names, group) -> str:
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, names, group=group)
    for i in range(max(len(n) for n in every)):
        at = [n[i] if i < len(n) else "nothing" for n in every]
        if len(set(at)) > 1:
            break
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(every))
    shown = "; ".join(f"rank {r} ran {u}" for r, u in list(zip(ranks, at))[:4])
    return (f"fully_shard: the ranks' forwards ran different units, so their all-gathers "
            f"exchanged different units' parameters: at unit {i + 1} of the forward, {shown}. "
            "A forward whose modules differ by rank (MoE routing, a module some ranks skip) "
            "must run the same units on every rank: flag the module as a ZeRO-3 leaf "
            "(deepspeed.utils.set_z3_leaf_modules) or make it one FSDP unit with what "
            "chooses between them")


class _Active(threading.local):
    """The context of the root forward now running in this thread (between its pre and post
    hooks): per thread, as autograd's grad mode is, so that ranks run as threads of one
    process (torch's MultiThreadedTestCase) each run their own forward."""
    ctx = None
    opener = None  # the module whose call began it


_ACTIVE = _Active()


def forward_in_progress() -> bool:
    """A sharded root's forward is running (its units gather and reshard as it goes)."""
    return _ACTIVE.ctx is not None


def running_backward() -> bool:
    """Autograd is running a backward pass (in this thread)."""
    return torch._C._current_graph_task_id() != -1


def _keeps_graph() -> bool:
    """The running backward was called with retain_graph=True."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def _accumulates(p) -> bool:
    """Will the running backward add into this parameter's .grad? Not in
    torch.autograd.grad, nor in a backward(inputs=...) that leaves it out."""
    for face in (p.full_face, p._local_leaf):
        if face is None or not face.requires_grad:
            continue
        try:
            if torch._C._will_engine_execute_node(get_gradient_edge(face).node):
                return True
        except RuntimeError:  # torch raises for a leaf inside autograd.grad, which never
            pass              # accumulates
    return False


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward runs once the unit's own backward is done."""

    @staticmethod
    def forward(ctx, unit, token, *inputs):
        ctx.unit = unit
        ctx.token = token  # the graph holds its forward's token (see UnitContext.live_forwards)
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        if ctx.token is not None:
            unit.ctx.reached.add(ctx.token)
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
        if self.token is not None:
            self.unit.ctx.reached.add(self.token)
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


def _cast_floating(tree, dtype):
    """Floating tensors anywhere in `tree` (containers, dataclasses, model outputs) cast to
    `dtype`, as FSDP2 casts them (torch.distributed.utils' walk)."""
    def cast(t):
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t
    return _apply_to_tensors(cast, tree)


def _managed_ids(module):
    ids = set()
    for sub in module.modules():
        unit = getattr(sub, "_vescale_unit", None)
        if unit is not None:
            for p in unit.params:
                ids.add(id(p.sharded))
    return ids
