"""A unit's backward: where it is (TrainingState, transitions asserted), what its forward
calls owe it (Calls), the autograd hooks that begin it (on its outputs) and end it (on its
inputs), and what happens then: gradients preset in place, reduced or kept (no_sync), the
unit resharded. Knows the unit by what it does (unit.py is above it)."""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..shard.stats import STATS
from .context import final_callback, keeps_graph

__all__ = ["TrainingState", "Calls", "UnitBackward", "register_post_backward", "hook_outputs"]


class TrainingState(enum.Enum):
    """Where a unit is in its backward (IDLE again when the backward ends)."""
    IDLE = "idle"
    BACKWARD = "backward"        # its outputs' gradient arrived: gradients are coming in
    REDUCED = "reduced"          # then post_backward: its gradients are reduced (or kept)
    REDUCED_UNREACHED = "reduced, unreached"  # post_backward, no output gradient came first


_STEPS = {  # the transitions a backward may make (and back to IDLE from any)
    (TrainingState.IDLE, TrainingState.BACKWARD),
    (TrainingState.BACKWARD, TrainingState.REDUCED),
    (TrainingState.IDLE, TrainingState.REDUCED_UNREACHED),
    (TrainingState.REDUCED_UNREACHED, TrainingState.REDUCED),
}


@dataclass
class Calls:
    """This iteration's calls of the unit, what its backward owes them, and what the running
    backward did."""
    forward_calls: int = 0       # calls that recorded a graph, their inputs hooked
    calls_without_hook: int = 0  # calls that recorded a graph, no input requiring grad
    reentrant_calls: int = 0     # calls without gradients inside a forward that has them
    recomputes_left: int = 0     # reentrant recomputations still to come in backward
    pending_post_backward: int = 0  # post-backward hooks still to run
    hook_recompute: bool = False    # the next post-forward in backward hooks its outputs
    delivers_grads: bool = False    # this backward adds into the parameters' .grad
    accumulated: bool = False       # a parameter's .grad was added to (ShardedParameter)
    outside_reads: int = 0  # parameters handed to code outside the unit in forward: the unit
    #                         stays gathered, and reduces at the end of backward


class UnitBackward:
    def __init__(self, unit):
        self.unit = unit
        self.state = TrainingState.IDLE
        self.calls = Calls()

    def _step(self, to: TrainingState) -> None:
        assert (self.state, to) in _STEPS, f"{self.unit.name}: {self.state.name} -> {to.name}"
        self.state = to

    @property
    def in_backward(self) -> bool:
        """This backward reached the unit's outputs (its gradients are arriving or reduced)."""
        return self.state in (TrainingState.BACKWARD, TrainingState.REDUCED)

    @property
    def reduced(self) -> bool:
        return self.state in (TrainingState.REDUCED, TrainingState.REDUCED_UNREACHED)

    def owes_post_backward(self) -> bool:
        """The final callback runs post_backward for a unit this iteration ran."""
        calls = self.calls
        return self.in_backward or calls.forward_calls or calls.calls_without_hook or \
            calls.outside_reads

    def grad_arrives(self, grad) -> None:
        """A gradient reached one of the unit's full parameters. One read outside the unit in
        forward (unit.serve_outside_read) may get it before the unit's outputs get theirs,
        or without the unit having run: that begins the unit's backward."""
        if self.state is TrainingState.IDLE and self.calls.outside_reads:
            self.pre_backward(grad)

    def new_iteration(self) -> None:
        """A new forward: forget the last graph's calls."""
        self.calls = Calls()
        self.end()

    def end(self) -> None:
        """A backward finished: what the next one through the same graph (retain_graph=True)
        starts from. Each hooked call and each reentrant checkpoint's recomputation (whose
        nested backward brings that call's gradients) is owed its post-backward again."""
        calls = self.calls
        calls.pending_post_backward = calls.forward_calls + calls.reentrant_calls
        calls.recomputes_left = calls.reentrant_calls
        calls.delivers_grads = calls.accumulated = False
        self.state = TrainingState.IDLE
        for p in self.unit.params:
            p.backward_flag = None

    def in_nested_backward(self) -> bool:
        """Autograd runs a backward inside the one that began this backward: a reentrant
        checkpoint's, over its recomputation (another recomputation may follow it)."""
        return torch._C._current_graph_task_id() != self.unit.ctx.backward_task

    @property
    def syncs_gradients(self) -> bool:
        """Backward reduces gradients (neither no_sync nor set_requires_gradient_sync(False))."""
        return self.unit.ctx.require_sync and self.unit.switches.requires_gradient_sync

    # -- begin ---------------------------------------------------------------------------------

    def pre_backward(self, grad):
        """The hook on the unit's outputs (the first gradient to arrive begins its backward)."""
        if self.in_backward:
            return grad
        with record_function(f"vescale::pre_backward ({self.unit.name})"):
            self._begin()
        return grad

    def _begin(self):
        unit = self.unit
        self._step(TrainingState.BACKWARD if self.state is TrainingState.IDLE
                   else TrainingState.REDUCED)
        ctx = unit.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            ctx.backward_task = torch._C._current_graph_task_id()
            Variable._execution_engine.queue_callback(functools.partial(final_callback, ctx))
        unit.wait_unshard()
        STATS.log("backward", unit.name)
        for p in unit.params:
            p.backward_flag = p.requires_grad
        trainable = [p for p in unit.params if p.backward_flag]
        # Whether this backward adds into the parameters' .grad: not torch.autograd.grad
        # (input gradients). Parameters that only a reentrant checkpoint inside the unit
        # uses are not in this graph but in its nested backward's: `accumulated` tells.
        self.calls.delivers_grads = any(_accumulates(p) for p in trainable)
        # A gradient may be written over its parameter once complete, unless something reads
        # the value after that: a retained graph's next backward, the next recomputation of a
        # reentrant checkpoint (each has a nested backward of its own), or the next forward
        # (the unit stays unsharded after backward: set_reshard_after_backward(False)).
        in_place = unit.switches.grads_in_place and self.syncs_gradients and \
            not self.calls.reentrant_calls and not keeps_graph() and \
            unit.switches.reshard_after_backward
        for buf in {id(p.buffer): p.buffer for p in trainable}.values():
            buf.unreduced.begin_backward(grads_in_place=in_place)
        for p in trainable:
            p.preset_grad()
        self._prefetch()

    def _prefetch(self):
        unit, order = self.unit, self.unit.ctx.order
        if unit.switches.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            for other in unit.switches.backward_prefetch:
                if other is not unit:
                    other.unshard(async_op=True)
        elif unit.is_root:  # backward reaches the last unit of the forward first
            if order and order[-1] is not unit:
                order[-1].unshard(async_op=True)
        elif unit in order:  # the unit backward reaches next is the one before us in forward
            i = order.index(unit)
            if i > 0:  # a no-op when it stayed gathered since its forward
                order[i - 1].unshard(async_op=True)

    # -- end -----------------------------------------------------------------------------------

    def post_backward(self):
        """All of the unit's parameter gradients are in: reduce-scatter, then reshard."""
        if self.reduced:
            return
        unit = self.unit
        self._step(TrainingState.REDUCED if self.state is TrainingState.BACKWARD
                   else TrainingState.REDUCED_UNREACHED)
        for buf in unit.buffers:
            buf.unreduced.flush_deferred_grads()
        STATS.log("post_backward", unit.name)
        ctx = unit.ctx
        for other in ctx.all_reducing:  # issued one unit ago: overlapped with that unit
            other.group.finish_gradients()
        # One reduce-scatter in flight at a time frees each full gradient buffer as early as
        # FSDP2 does; the replicas' all-reduce it leads to runs during the next unit.
        ctx.all_reducing = [other for other in ctx.reducing if other.group.advance_gradients()]
        ctx.reducing = [unit]
        delivered = self.in_backward and (self.calls.delivers_grads or self.calls.accumulated)
        gradients = self._gradient_members() if delivered else []
        if gradients:
            if not self.syncs_gradients:
                unit.group.keep_unreduced(gradients)
            else:
                unit.group.reduce(gradients, unit.switches.requires_all_reduce)
        self.reshard()

    def reshard(self):
        """Reshard, unless set_reshard_after_backward(False) keeps the unit unsharded for the
        next forward (its `.grad` views of the full gradient buffers are dropped)."""
        unit = self.unit
        if unit.switches.reshard_after_backward or not unit.is_unsharded:
            unit.reshard()
            return
        for p in unit.params:
            p.drop_full_grads()
        unit.keep_unsharded()

    def _gradient_members(self):
        """The parameters whose gradient this backward delivers, as autograd does on an
        unsharded model: recorded by a forward with requires_grad set and still set now (or
        holding an unreduced no_sync gradient). A flag changed while the unit's backward ran
        cannot be honoured either way: an error naming it."""
        name = self.unit.name
        for p in self.unit.params:
            if p.backward_flag is not None and p.requires_grad != p.backward_flag:
                raise RuntimeError(
                    f"{p.fqn}: requires_grad changed from {p.backward_flag} to "
                    f"{p.requires_grad} while the backward of its unit ({name}) ran; set "
                    "it before that backward starts or after it ends")
            if p.backward_flag is False and p.full_face is not None and \
                    p.full_face.grad is not None:
                raise RuntimeError(
                    f"{p.fqn}: got a gradient with requires_grad=False at the start of its "
                    f"unit's backward ({name}); set requires_grad before backward starts")
        return [p for p in self.unit.params if (p.graphed and p.requires_grad) or p.unreduced]


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
    def forward(ctx, backward, token, *inputs):
        ctx.backward = backward
        ctx.token = token  # the graph holds its forward's token (see UnitContext.live_forwards)
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        backward = ctx.backward
        if ctx.token is not None:
            backward.unit.ctx.reached.add(ctx.token)
        ctx.token = None
        calls = backward.calls
        calls.pending_post_backward -= 1
        if calls.pending_post_backward == 0 and not (calls.calls_without_hook or
                                                     calls.outside_reads):
            backward.post_backward()
        return (None, None, *grads)


class _OutputGradHook:
    """The hook on a unit's outputs: the unit's backward begins. It holds its forward's token
    for as long as the graph holds the hook."""

    def __init__(self, backward, token):
        self.backward = backward
        self.token = token

    def __call__(self, grad):
        if self.token is not None:
            self.backward.unit.ctx.reached.add(self.token)
        return self.backward.pre_backward(grad)


def register_post_backward(backward, args, kwargs, token):
    """The unit's inputs requiring grad through _PostBackward: (args, kwargs, hooked)."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return args, kwargs, False
    out = _PostBackward.apply(backward, token, *[flat[i] for i in positions])
    out = out if isinstance(out, tuple) else (out,)
    for i, t in zip(positions, out):
        flat[i] = t
    args, kwargs = tree_unflatten(flat, spec)
    return args, kwargs, True


def hook_outputs(backward, output, token):
    hook = _OutputGradHook(backward, token)
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if t.is_leaf and "_vescale_full" in t.__dict__:
                continue  # a full parameter returned (a hook on it would stay for life): its
                #           gradient begins the backward (UnitBackward.grad_arrives)
            t.register_hook(hook)
