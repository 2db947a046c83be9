"""The state the units of one root share for one forward and backward (UnitContext), the
forward running in this thread, and what runs once per backward for all of them: the final
callback (units no gradient reached, every reduction finished, the same units checked on every
rank) and reset_iteration after a forward or backward that raised. Knows units by what they
do (unit.py is above it), never by their class."""
from __future__ import annotations

import itertools
import threading
import weakref
import zlib

import torch
import torch.distributed as dist

from ..launch.collective_timeout import explain_timeout
from ..shard.host_memory import release_free_host_memory

__all__ = ["UnitContext", "ForwardToken", "ACTIVE", "forward_in_progress", "running_backward",
           "keeps_graph", "reset_iteration", "reuse_distances", "final_callback",
           "compare_units", "check_same_units", "next_iteration"]

_ITERATIONS = itertools.count()  # tags a root's forward/backward (hpZ's secondary copies)


def next_iteration() -> int:
    return next(_ITERATIONS)


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
        # Per forward: the all-reduce comparing the units every rank ran (check_same_units)
        self.unit_checks = []

    @property
    def backward_pending(self) -> bool:
        return len(self.live_forwards) > 0


class ForwardToken:
    """Held by one forward's autograd graph (see UnitContext.live_forwards)."""


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
        if ACTIVE.ctx is ctx:
            ACTIVE.ctx = ACTIVE.opener = None
        ctx.order, ctx.last_order, ctx.reuse_distance = [], [], {}
        ctx.callback_queued = False
        ctx.reducing, ctx.all_reducing = [], []
        ctx.backward_task = None
        ctx.live_forwards = weakref.WeakSet()
        ctx.reached = set()
        ctx.token = None


def reuse_distances(order) -> dict:
    """For each non-root unit of a forward order: the elements gathered between its forward and
    its backward, i.e. every later unit's parameters twice (once in forward, once in backward).
    The root is left out: it stays gathered through forward and backward."""
    distances, later = {}, 0
    for unit in reversed([u for u in order if not u.is_root]):
        distances[unit] = 2 * later
        later += unit.numel
    return distances


def final_callback(ctx):
    for unit in reversed(ctx.order):
        if unit.backward.owes_post_backward():
            unit.backward.post_backward()
    for unit in reversed(ctx.order):  # every all-reduce in flight before waiting for any
        unit.group.advance_gradients()
    for unit in reversed(ctx.order):
        unit.group.finish_gradients()
        unit.backward.reshard()
        unit.backward.end()
        unit.group.fold_outside_grads()
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
    check_same_units(ctx)  # before the optimizer steps with these gradients



# -- every rank ran the same units ----------------------------------------------------------------
# Ranks whose forwards run different units (MoE routing, a module some ranks skip) pair their
# all-gathers wrongly: of units of one size, silently (each computes with another's
# parameters); of different sizes or counts, they wait forever (launch/stall.py names them).
# So each forward ends with one small asynchronous all-reduce of a digest of the units it ran,
# over the root's shard group, and the end of backward (or the next forward, for a forward
# nothing differentiated) checks it: a difference is one line naming the first unit that
# differs, before the optimizer steps.

def compare_units(ctx):
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


def check_same_units(ctx):
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


ACTIVE = _Active()


def forward_in_progress() -> bool:
    """A sharded root's forward is running (its units gather and reshard as it goes)."""
    return ACTIVE.ctx is not None


def running_backward() -> bool:
    """Autograd is running a backward pass (in this thread)."""
    return torch._C._current_graph_task_id() != -1


def keeps_graph() -> bool:
    """The running backward was called with retain_graph=True."""
    return torch._C._autograd._get_current_graph_task_keep_graph()
