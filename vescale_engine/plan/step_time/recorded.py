"""A schedule whose collectives are the ones a real step issued (`vescale plan --time
--fake-world`): vescale_engine/fake_world records ours' or FSDP2's step as rank 0 of W, each
collective with its unit, its role there (the unit's gather or its reduction) and the phase;
here they replace the planned ones, task by task. What stays from schedule.py: the compute
(the units' order and work, which no collective changes) and the optimizer's elements.

Where each recorded collective goes:
- a unit's gather in forward (backward): the first forward (backward) task of that unit
  instance (the root's: its first, which the embeddings run in);
- a unit's reduction: the last backward task of that unit instance, at its end (the root's:
  the step's last task);
- outside any unit, in forward: what backward waits for (ours' units check); in backward: the
  step's last task; in the optimizer step: the step's collectives, after the last reduction.
FSDP2's copies are the recorded bytes: copy-out of every gathered byte, copy-in of every
reduce-scattered byte.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from ..capacity import Setup
from ..model_plan import ModelShapes
from .schedule import Comm, Schedule

__all__ = ["from_record", "compare"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _instances(model: ModelShapes, schedule: Schedule) -> list:
    """Each task's unit instance as the recorded step names it ("" the root; "layers.3"; a
    group within another: "moe_layers.3.experts")."""
    within = {g.name: g.within for g in model.groups}
    counts = Counter((t.unit, t.phase) for t in schedule.tasks)
    seen = Counter()
    out = []
    for task in schedule.tasks:
        if task.unit == "root":
            out.append("")
            continue
        key = (task.unit, task.phase)
        i = seen[key]
        seen[key] += 1
        index = i if task.phase == "forward" else counts[key] - 1 - i   # backward: reversed
        parent = within.get(task.unit)
        out.append(f"{parent}.{index}.{task.unit}" if parent else f"{task.unit}.{index}")
    return out


def _group(c: dict, setup: Setup) -> str:
    """Which of the schedule's groups a recorded collective ran over (rank 0's groups:
    consecutive ranks for the shard group and hpZ's, strided by the shard group for the
    replicas)."""
    size, stride = c["group_size"], c["stride"]
    if stride == 1 and size == setup.shard_size:
        return "shard"
    if stride == setup.shard_size and size == setup.hsdp:
        return "replica"
    if stride == 1 and size == setup.hpz:
        return "hpz"
    raise ValueError(f"the recorded step issued a {c['kind']} over {size} ranks (stride "
                     f"{stride}), none of the time model's groups (shard {setup.shard_size}, "
                     f"replicas {setup.hsdp}, hpZ {setup.hpz})")


def from_record(planned: Schedule, model: ModelShapes, setup: Setup, record: dict) -> Schedule:
    """`planned` (schedule.build_schedule's, the same system, model and setup) with the
    recorded step's collectives in place of its own."""
    if (record["system"], record["world_size"]) != (planned.system, setup.world_size):
        raise ValueError(f"a step of {record['system']} at {record['world_size']} ranks "
                         f"recorded, {planned.system} at {setup.world_size} planned")
    names = _instances(model, planned)
    tasks = [dict(gathers=[], reduces=[]) for _ in planned.tasks]
    first_backward = next(i for i, t in enumerate(planned.tasks) if t.phase == "backward")
    step = []

    def first(unit, phase):
        return next((i for i, t in enumerate(planned.tasks)
                     if names[i] == unit and t.phase == phase), None)

    def last(unit):
        return max((i for i, t in enumerate(planned.tasks)
                    if names[i] == unit and t.phase == "backward"), default=None)

    for c in record["collectives"]:
        if c["kind"] not in KINDS:
            raise ValueError(f"the recorded step issued {c['kind']}, which the time model "
                             f"does not play")
        comm = Comm(c["kind"], c["nbytes"], _group(c, setup))
        if c["phase"] == "step":
            step.append(comm)
            continue
        if c["role"] == "gather":
            at, where = first(c["unit"], c["phase"]), "gathers"
        elif c["role"] == "reduce":
            at, where = last(c["unit"]), "reduces"
        elif c["phase"] == "forward":
            at, where = first_backward, "gathers"
        else:
            at, where = len(tasks) - 1, "reduces"
        if at is None:
            raise ValueError(f"the recorded step's unit {c['unit']!r} is none of the "
                             f"schedule's (is it the same model and setup?)")
        tasks[at][where].append(comm)
    out = []
    for task, got in zip(planned.tasks, tasks):
        changes = dict(gathers=tuple(got["gathers"]), reduces=tuple(got["reduces"]))
        if planned.system == "fsdp2":
            changes["copy_before"] = sum(c.nbytes for c in got["gathers"]
                                         if c.kind == "all_gather")
            changes["copy_after"] = sum(c.nbytes for c in got["reduces"]
                                        if c.kind == "reduce_scatter")
        out.append(dataclasses.replace(task, **changes))
    return dataclasses.replace(planned, tasks=tuple(out), step_comms=tuple(step))


def compare(planned: Schedule, recorded: Schedule) -> dict:
    """{"collectives": [planned, recorded], "bytes": [planned, recorded], "same": ...}: the
    two schedules' collectives, counted and added up; `same`: equal task by task."""
    def listed(s):
        return [c for t in s.tasks for c in t.gathers + t.reduces for _ in range(c.count)] + \
            list(s.step_comms)
    a, b = listed(planned), listed(recorded)
    same = all((t.gathers, t.reduces, t.copy_before, t.copy_after) ==
               (u.gathers, u.reduces, u.copy_before, u.copy_after)
               for t, u in zip(planned.tasks, recorded.tasks)) and \
        planned.step_comms == recorded.step_comms
    return {"collectives": [len(a), len(b)],
            "bytes": [sum(c.nbytes for c in a), sum(c.nbytes for c in b)], "same": same}
