"""One training step as a GPU runs it, per system: the units' compute in execution order, what
each waits for (its all-gathers), what it issues after (reduce-scatters, HSDP's all-reduce),
the copies each system makes on the compute stream, and the optimizer step.

Built from the same units, planner and traffic rules `vescale plan --memory` uses
(plan/capacity), whose bytes tests/engine/test_capacity.py checks against the collectives a real
training step issues (ours and torch FSDP2, each as rank 0 of W on the fake process group); the
schedule's collectives add up to those bytes exactly (tests/core/plan/test_step_time.py), and
their order is the one the engines issue:

- ours (fsdp/unit.py): the root unit (embeddings, final norm, head) is gathered first and kept
  until backward ends; each decoder unit is gathered before its forward and, when resharded
  after forward, again before its backward, except the last one, which backward starts with;
  one reduce-scatter per unit after its backward (HSDP: the replicas' all-reduce of its
  shard when the next unit's backward ends, before that unit's reduce-scatter, as
  fsdp/backward.py issues them); the buffers are the collectives' own memory (DBuffer): no
  copies.
- FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the same order, the last
  unit regathered too; each all-gather's output is split into the parameters (copy-out,
  `split_with_sizes_copy`, the unit's full bytes) before the unit runs, and each unit's
  gradients are concatenated into the reduce-scatter's input (copy-in, `chunk_cat`, the full
  gradient bytes) after its backward; per-parameter dim-0 padding.
- ZeRO-3 (deepspeed/runtime/zero/stage3.py, partitioned_param_coordinator.py), from DeepSpeed's
  own rules, not a run (its runtime needs a device per rank): the parameters above the
  persistence threshold (each padded to a multiple of W) all-gathered in module order, one
  coalesced collective per prefetch bucket (stage3_prefetch_bucket_size elements);
  gradients copied into the reduce bucket (`__add_grad_to_ipg_bucket`) and reduce-scattered
  each time the bucket reaches reduce_bucket_size elements, and once more at the end.

Left out: TP/EP (the dispatch all-to-alls), offload's host copies, the engines' Python time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..capacity import PlanCache, Setup, default_root, model_units, tensor_uses
from ..capacity.fsdp2 import unit_shard
from ..capacity.ours import UNITS_CHECK_BYTES
from ..capacity.units import expand
from ..capacity.zero3 import ZERO3_DEFAULTS
from ..model_plan import DTYPE_BYTES, ModelShapes
from .compute import Work, group_flops, unit_flops

__all__ = ["SYSTEMS", "Comm", "Task", "Schedule", "build_schedule", "OPTIMIZER_BYTES"]

SYSTEMS = ("ours", "fsdp2", "zero3")
# bytes the optimizer step reads and writes per sharded element (memory-bound): AdamW reads the
# fp32 master, gradient and two moments and writes the master and moments (7 x 4 bytes)
OPTIMIZER_BYTES = {"AdamW": 28, "AdamW8bit": 4 + 4 + 4 + 2 * 2 + 2 * 1 + 4, "Muon": 20,
                   "Shampoo": 28}


@dataclass(frozen=True)
class Comm:
    """`count` collectives one after the other, each of `nbytes` of its full buffer
    (all_reduce: of the buffer each rank holds), over the unit's `group` ("shard", "replica"
    or "hpz")."""
    kind: str
    nbytes: int
    group: str = "shard"
    count: int = 1


@dataclass(frozen=True)
class Task:
    """One unit instance's forward or backward, per token of the micro-batch."""
    unit: str
    phase: str                 # "forward" / "backward"
    work: Work
    gathers: tuple = ()        # what must have arrived before it runs
    reduces: tuple = ()        # what it issues when it ends
    copy_before: int = 0       # device bytes copied on the compute stream before it
    copy_after: int = 0        # and after it


@dataclass(frozen=True)
class Schedule:
    system: str
    tasks: tuple               # one micro-step, in execution order
    optimizer_elements: int    # sharded elements the optimizer step updates on a rank
    shard_group: int
    step_comms: tuple = ()     # the optimizer step's own collectives (recorded steps: Muon's)


def build_schedule(system: str, model: ModelShapes, setup: Setup, seq_len: int,
                   checkpointing: str = "none", cache: PlanCache | None = None) -> Schedule:
    """The schedule of one micro-step of `system` (SYSTEMS) for a (global) shapes file with an
    architecture section, its units as `vescale plan --memory` forms them."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r} (expected one of {', '.join(SYSTEMS)})")
    flops = {g.name: g for g in group_flops(model, seq_len)}
    root_groups = setup.root if setup.root is not None else default_root(model)
    root, others = model_units(model, root_groups, tensor_uses(model.path))
    works = {u.name: unit_flops(flops[u.name], checkpointing) for u in others}
    forward = [unit_flops(flops[name], checkpointing) for name in root_groups]
    root_work = (Work(sum(f.matmul for f, _ in forward), sum(f.attention for f, _ in forward)),
                 Work(sum(b.matmul for _, b in forward), sum(b.attention for _, b in forward)))
    order = [u for u, _ in expand(others)]
    build = {"ours": _ours, "fsdp2": _fsdp2, "zero3": _zero3}[system]
    return build(root, order, works, root_work, setup, cache or PlanCache())


def _reduces(setup: Setup, rs_bytes: int, shard_bytes: int) -> tuple:
    """A unit's reduce-scatter, then HSDP's all-reduce of the reduced shard over the
    replicas."""
    out = (Comm("reduce_scatter", rs_bytes),)
    if setup.hsdp > 1:
        out += (Comm("all_reduce", shard_bytes, "replica"),)
    return out


def _pipeline(setup: Setup, units: list, root_unit, root_work, gather, reduce, regather_last,
              copies=lambda unit, phase: (0, 0)) -> tuple:
    """Forward: the root's gather, the units in order, the head; backward: the head, the
    units in reverse (regathered when resharded), the embeddings with the root's reduce.
    `gather(unit, phase)` and `reduce(unit)` give a unit's collectives (tuples), `copies(unit,
    phase)` the bytes copied before and after it on the compute stream."""
    tasks = [Task("root", "forward", Work(0.0, 0.0), gather(root_unit, "forward"),
                  copy_before=copies(root_unit, "forward")[0])] if root_unit else []
    for unit, work in units:
        before, _ = copies(unit, "forward")
        tasks.append(Task(unit.name, "forward", work[0], gather(unit, "forward"),
                          copy_before=before))
    tasks.append(Task("root", "forward", root_work[0]))
    tasks.append(Task("root", "backward", root_work[1]))
    for i, (unit, work) in reversed(list(enumerate(units))):
        again = setup.reshard_after_forward and (regather_last or i + 1 < len(units))
        before, after = copies(unit, "backward") if again else (0, copies(unit, "backward")[1])
        tasks.append(Task(unit.name, "backward", work[1],
                          gather(unit, "backward") if again else (), reduce(unit),
                          before, after))
    if root_unit:
        tasks.append(Task("root", "backward", Work(0.0, 0.0), (), reduce(root_unit),
                          copy_after=copies(root_unit, "backward")[1]))
    return tuple(tasks)


def _quantized(kind: str, M: int, buffers: list) -> tuple:
    """ZeRO++'s collectives of a unit, per buffer: the int8 payload, then the fp32 scales."""
    return tuple(Comm(kind, nbytes) for n, g in buffers for nbytes in (M * n, M * 4 * g))


def _ours(root, order, works, root_work, setup, cache) -> Schedule:
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]
    plans = {u.name: cache.plan(u, setup) for u in {u.name: u for u in order}.values()}
    if root.tensors:
        plans["root"] = cache.plan(root, setup)
    # per unit, per buffer (one collective each, in the unit's buffer order): the rank's
    # shard elements and, quantized, its scales (the most any rank has)
    buffers = {name: list(zip((b.shard_size for b in p.buffers), p.buffer_groups))
               for name, p in plans.items()}

    def gather(unit, phase):
        M = plans[unit.name].world
        if phase == "backward" and setup.hpz > 1:   # hpZ: from the secondary copies
            return tuple(Comm("all_gather", M * n * pb, "hpz") for n, _ in buffers[unit.name])
        if setup.quantized_weights:   # the int8 payload, then one fp32 scale per group
            return _quantized("all_gather", M, buffers[unit.name])
        return tuple(Comm("all_gather", M * n * pb) for n, _ in buffers[unit.name])

    def reduce(unit):
        M = plans[unit.name].world
        if setup.quantized_gradients:
            return _quantized("all_to_all", M, buffers[unit.name]) + \
                tuple(c for n, _ in buffers[unit.name] for c in _reduces(setup, 0, n * rb)[1:])
        return tuple(c for n, _ in buffers[unit.name] for c in _reduces(setup, M * n * rb,
                                                                         n * rb))

    units = [(u, works[u.name]) for u in order]
    tasks = list(_pipeline(setup, units, root if root.tensors else None, root_work, gather,
                           reduce, regather_last=False))
    # each forward ends with a check that every rank ran the same units (fsdp/unit.py): an
    # all-reduce of a few bytes over the root's group, waited for before backward
    head = next(i for i, t in enumerate(tasks) if t.phase == "backward")
    tasks[head] = dataclasses.replace(tasks[head], gathers=(Comm("all_reduce",
                                                                 UNITS_CHECK_BYTES),))
    if setup.hsdp > 1:
        tasks = _replicas_one_unit_later(tasks)
    elements = sum(p.shard * p.unit.repeat for p in plans.values())
    return Schedule("ours", tuple(tasks), elements, setup.shard_size)


def _replicas_one_unit_later(tasks: list) -> list:
    """Ours issues a unit's replica all-reduces when the next unit's backward ends, before
    that unit's reduce-scatters (fsdp/backward.py: one reduce-scatter in flight; the
    all-reduce follows it), and the last unit's after its own."""
    out, carried, last = [], (), max(i for i, t in enumerate(tasks) if t.reduces)
    for i, task in enumerate(tasks):
        if task.reduces:
            mine = tuple(c for c in task.reduces if c.group == "replica")
            reduces = carried + tuple(c for c in task.reduces if c.group != "replica")
            carried = mine
            task = dataclasses.replace(task, reduces=reduces + (carried if i == last else ()))
        out.append(task)
    return out


def _fsdp2(root, order, works, root_work, setup, cache) -> Schedule:
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]

    shards = {}

    def shard(unit):
        if unit.name not in shards:
            shards[unit.name] = unit_shard(unit, setup)
        return shards[unit.name]

    def gather(unit, phase):
        return (Comm("all_gather", setup.group_size(unit) * shard(unit) * pb),)

    def reduce(unit):
        return _reduces(setup, setup.group_size(unit) * shard(unit) * rb, shard(unit) * rb)

    def copies(unit, phase):
        """copy-out of the gathered parameters before the unit runs; copy-in of its
        gradients into the reduce-scatter input after its backward."""
        full = setup.group_size(unit) * shard(unit)
        return full * pb, (full * rb if phase == "backward" else 0)

    units = [(u, works[u.name]) for u in order]
    tasks = _pipeline(setup, units, root if root.tensors else None, root_work, gather, reduce,
                      regather_last=True, copies=copies)
    elements = shard(root) + sum(shard(u) * u.repeat for u in {u.name: u for u in order}.values())
    return Schedule("fsdp2", tasks, elements, setup.shard_size)


def _zero3(root, order, works, root_work, setup, cache) -> Schedule:
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]
    limit, bucket_limit = ZERO3_DEFAULTS["param_persistence_threshold"], \
        ZERO3_DEFAULTS["reduce_bucket_size"]
    M = setup.shard_size
    bucket = [0]   # padded gradient elements waiting in the reduce bucket

    parts, gathers = {}, {}   # per unit: each tensor's padded elements; its gathers

    def padded(unit) -> list:
        if unit.name not in parts:
            parts[unit.name] = [(M * -(-t.numel // M), t.numel >= limit) for t in unit.tensors]
        return parts[unit.name]

    def gather(unit, phase):
        """The parameters above the persistence threshold, in module order, fetched together
        up to prefetch_bucket_size elements: one coalesced all-gather per bucket
        (partitioned_param_coordinator's fetch of a submodule and the ones after it)."""
        if unit.name not in gathers:
            buckets, filling = [], 0
            for n, fetched in padded(unit):
                if not fetched:
                    continue
                if filling and filling + n > ZERO3_DEFAULTS["prefetch_bucket_size"]:
                    buckets.append(filling)
                    filling = 0
                filling += n
            buckets += [filling] if filling else []
            sizes = [n * pb for n in buckets]
            gathers[unit.name] = tuple(Comm("all_gather", n, count=sizes.count(n))
                                       for n in dict.fromkeys(sizes))
        return gathers[unit.name]

    def reduce(unit):
        out = ()
        for n, _ in padded(unit):   # each gradient into the bucket; a full bucket is reduced
            bucket[0] += n
            if bucket[0] >= bucket_limit:
                out += _reduces(setup, bucket[0] * rb, bucket[0] // M * rb)
                bucket[0] = 0
        return out

    tasks = [Task("root", "forward", Work(0.0, 0.0), gather(root, "forward"))] \
        if root.tensors else []
    for unit in order:
        tasks.append(Task(unit.name, "forward", works[unit.name][0], gather(unit, "forward")))
    tasks += [Task("root", "forward", root_work[0]),
              Task("root", "backward", root_work[1], gather(root, "backward"))]
    kept, later = set(), 0   # the last units within max_reuse_distance stay gathered
    for i in reversed(range(len(order))):
        if 2 * later >= ZERO3_DEFAULTS["max_reuse_distance"]:
            break
        kept.add(i)
        later += order[i].numel
    for i, unit in reversed(list(enumerate(order))):
        full = sum(n for n, _ in padded(unit)) * rb
        tasks.append(Task(unit.name, "backward", works[unit.name][1],
                          () if i in kept else gather(unit, "backward"), reduce(unit),
                          copy_after=full))
    last = reduce(root) if root.tensors else ()
    if bucket[0]:
        last += _reduces(setup, bucket[0] * rb, bucket[0] // M * rb)
    tasks.append(Task("root", "backward", Work(0.0, 0.0), (), last,
                      copy_after=sum(n for n, _ in padded(root)) * rb))
    elements = (sum(n for n, _ in padded(root)) + sum(n for u in order
                                                      for n, _ in padded(u))) // M
    return Schedule("zero3", tuple(tasks), elements, M)
