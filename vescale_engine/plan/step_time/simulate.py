"""The critical path of one training step: a schedule (schedule.py) played on two queues, the
compute stream and the communication stream, as the engines overlap them.

- Compute runs the tasks in order; a task starts when the one before it ended and its
  all-gathers arrived; the copies a system makes (FSDP2's copy-out before a unit, copy-in after
  its backward) run on the compute stream around it, at device-memory bandwidth.
- Collectives run one at a time, in the order the host issues them (NCCL on one communicator
  per group: the all-gather and reduce-scatter streams share the links, so they are not
  counted twice). A unit's all-gather is issued `prefetch` units ahead of the unit that needs
  it, but not before the compute `prefetch + 1` units back ended (its memory is then free):
  with prefetch 1, unit i+1's gather overlaps unit i's compute, as FSDP2's and ours do by
  default (forward: the host runs ahead; backward: explicit prefetch). A task's
  reduce-scatters are issued when its backward ends.
- A cluster without overlap (CPU ranks, where gloo's collectives take the cores the compute
  runs on) adds every collective's time to the compute's instead.
- Gradient accumulation repeats the micro-step (ours and FSDP2 reduce every micro-step, as
  `--memory`'s traffic counts them); the optimizer step starts when the last collective ended:
  the gradient norm's all-reduce (a few bytes: its latency) and the step's own collectives
  (Schedule.step_comms), then a memory-bound pass over the rank's shard
  (schedule.OPTIMIZER_BYTES per element).

Left out: host overheads (kernel launches, Python hooks: a small unit on a fast GPU can be
host-bound), stragglers and link congestion, compute slowed by concurrent NCCL kernels (they
take SMs), memory-allocator stalls.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .collectives import Group, collective_time
from .compute import copy_time
from .schedule import OPTIMIZER_BYTES, Comm, Schedule

__all__ = ["StepTime", "Placement", "simulate"]


@dataclass(frozen=True)
class Placement:
    """How a step's groups sit on the nodes: each kind of group of schedule.Comm."""
    shard: Group
    replica: Group | None = None
    hpz: Group | None = None

    @classmethod
    def of(cls, world: int, shard: int, hpz: int, gpus_per_node: int) -> "Placement":
        """Shard groups of consecutive ranks (data-parallel replicas outermost, as
        parallel_plan's mesh), replicas strided by the shard group, hpZ's groups consecutive
        inside a shard group."""
        replicas = world // shard
        per_node = 1 if shard >= gpus_per_node else min(replicas, gpus_per_node // shard)
        return cls(_packed(shard, gpus_per_node),
                   Group(replicas, per_node) if replicas > 1 else None,
                   _packed(hpz, gpus_per_node) if hpz > 1 else None)


def _packed(size: int, gpus_per_node: int) -> Group:
    try:
        return Group.packed(size, gpus_per_node)
    except ValueError as err:
        raise ValueError(f"{err}: choose a world size (and shard group) that fills whole "
                         f"nodes") from None


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one rank, and where they went."""
    step: float
    compute: float        # the compute stream's busy time (copies and optimizer included)
    copies: float         # of which device-memory copies around the units
    optimizer: float      # of which the optimizer step
    communication: float  # the communication stream's busy time
    exposed: float        # step - compute: waiting on collectives
    by_kind: dict         # communication seconds per collective kind

    def as_dict(self) -> dict:
        return {"step_s": self.step, "compute_s": self.compute, "copies_s": self.copies,
                "optimizer_s": self.optimizer, "communication_s": self.communication,
                "exposed_communication_s": self.exposed,
                "communication_by_kind_s": dict(self.by_kind)}


def simulate(schedule: Schedule, cluster: Cluster, placement: Placement, tokens: int,
             optimizer: str = "AdamW", grad_accum: int = 1, prefetch: int = 1) -> StepTime:
    """Play `grad_accum` micro-steps of `tokens` tokens per rank, then the optimizer step.
    Micro-steps after the second repeat the second's period exactly (the same tasks, the
    queues in the same state), so many are played as two and extrapolated."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    costs = {}

    def cost(c: Comm) -> float:
        if c not in costs:
            costs[c] = c.count * collective_time(c.kind, c.nbytes, getattr(placement, c.group),
                                                 cluster)
        return costs[c]

    if grad_accum <= 3:
        end, busy, copies, by_kind = _play(schedule.tasks * grad_accum, cluster, tokens,
                                           prefetch, cost)
    else:   # the first micro-step, the second, and (grad_accum - 2) more like the second
        played = [_play(schedule.tasks * m, cluster, tokens, prefetch, cost) for m in (2, 3)]
        more = grad_accum - 2
        end, busy, copies = (a + more * (b - a) for a, b in zip(played[0][:3], played[1][:3]))
        by_kind = {k: v + more * (played[1][3][k] - v) for k, v in played[0][3].items()}
    norm = collective_time("all_reduce", 8, placement.shard, cluster)
    if not cluster.overlap:   # one processor: nothing hides
        end = busy + sum(by_kind.values())
    by_kind["all_reduce"] = by_kind.get("all_reduce", 0.0) + norm
    for c in schedule.step_comms:   # after the gradients, before the update
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + cost(c)
        end += cost(c)
    optimizer_s = copy_time(OPTIMIZER_BYTES[optimizer] * schedule.optimizer_elements / 2,
                            cluster)
    step = end + norm + optimizer_s
    busy += optimizer_s
    comm = sum(by_kind.values())
    return StepTime(step, busy, copies, optimizer_s, comm, step - busy, by_kind)


def _play(tasks, cluster, tokens, prefetch, cost) -> tuple:
    """(when both queues are done, compute busy, copies, {kind: communication seconds})."""
    by_kind = {}
    n = len(tasks)
    ends = [0.0] * n          # compute end of each task
    arrived = [0.0] * n       # when each task's gathers have all arrived
    link = compute = busy = copies = 0.0
    issued = 0
    for k, task in enumerate(tasks):
        while issued < n and issued <= k + prefetch:   # gathers the host has issued by now
            j = issued
            ready = ends[j - prefetch - 1] if j - prefetch - 1 >= 0 else 0.0
            for c in tasks[j].gathers:
                t = cost(c)
                link = max(link, ready) + t
                by_kind[c.kind] = by_kind.get(c.kind, 0.0) + t
            arrived[j] = link if tasks[j].gathers else 0.0
            issued += 1
        before, after = copy_time(task.copy_before, cluster), copy_time(task.copy_after, cluster)
        run = before + task.work.time(tokens, cluster) + after
        compute = ends[k] = max(compute, arrived[k]) + run
        busy += run
        copies += before + after
        for c in task.reduces:
            t = cost(c)
            link = max(link, compute) + t
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + t
    return max(compute, link), busy, copies, by_kind
