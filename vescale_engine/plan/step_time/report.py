"""`vescale plan --time`'s answer: per system the step time, tokens per second per GPU, MFU and
where the time went; for ours the settings that move it most; and scans over world sizes (weak
scaling: the same micro-batch per rank; strong: the same global batch, split over more ranks).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..capacity import PlanCache, Setup
from ..model_plan import ModelShapes, fsdp2_unsupported
from .cluster import Cluster
from .compute import model_flops_per_token
from .recorded import compare, from_record
from .schedule import SYSTEMS, build_schedule
from .simulate import Placement, simulate

__all__ = ["NO_TP_EP", "Workload", "predict", "settings_that_matter", "scan", "DEFAULT_SCAN"]

DEFAULT_SCAN = tuple(2 ** k for k in range(3, 14))   # 8 .. 8,192 ranks


@dataclass(frozen=True)
class Workload:
    """What one rank computes per micro-step, and how the engines run it."""
    seq_len: int = 4096
    micro_batch: int = 1          # sequences per rank per micro-step
    checkpointing: str = "none"   # compute.CHECKPOINTING
    prefetch: int = 1             # units gathered ahead (simulate.py)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch


NO_TP_EP = ("--time models FSDP and HSDP steps; TP/EP (their all-to-alls and TP collectives) "
            "are not in the time model: drop --tp/--ep")


def _refuse(setup: Setup) -> None:
    if setup.tp > 1 or setup.ep > 1:
        raise ValueError(NO_TP_EP)
    if setup.offloads:
        raise ValueError("--time does not model offload's host copies: drop "
                         "--offload-optimizer/--offload-param")


def predict(system: str, model: ModelShapes, setup: Setup, cluster: Cluster, work: Workload,
            cache: PlanCache | None = None, record: dict | None = None) -> dict:
    """One system's step: seconds and where they went, tokens/s per GPU, MFU (torchtitan's
    model FLOPs over the cluster's dense bf16 peak). `record`: a step of `system` recorded
    on the fake process group (vescale_engine.fake_world) for this model and setup: its
    collectives are played instead of the planned ones, and `schedule` compares the two."""
    _refuse(setup)
    if system == "fsdp2":
        unsupported = fsdp2_unsupported(model, setup.shard_size, setup.expert_shard_size)
        if unsupported:
            return {"unsupported": unsupported}
    schedule = build_schedule(system, model, setup, work.seq_len, work.checkpointing, cache)
    checked = {}
    if record is not None:
        planned, schedule = schedule, from_record(schedule, model, setup, record)
        checked = {"schedule": {"source": f"recorded (torch {record['torch']})",
                                **compare(planned, schedule)}}
    try:
        placement = Placement.of(setup.world_size, setup.shard_size,
                                 setup.hpz if system == "ours" else 1, cluster.gpus_per_node)
    except ValueError as err:
        raise ValueError(f"world size {setup.world_size} on {cluster.name}: {err}") from None
    step = simulate(schedule, cluster, placement, work.tokens, setup.optimizer, setup.grad_accum,
                    work.prefetch)
    tokens_per_s = work.tokens * setup.grad_accum / step.step
    mfu = tokens_per_s * model_flops_per_token(model, work.seq_len) / cluster.device.bf16_flops
    return {**step.as_dict(), "tokens_per_s_per_gpu": tokens_per_s, "mfu": mfu,
            "exposed_share": step.exposed / step.step, "copies_share": step.copies / step.step,
            **checked}


# Ours with one setting changed: what each does to the step (settings_that_matter)
_VARIANTS = (
    ("reshard_after_forward off", lambda s, w: (dataclasses.replace(
        s, reshard_after_forward=not s.reshard_after_forward), w)),
    ("prefetch 2", lambda s, w: (s, dataclasses.replace(w, prefetch=2))),
    ("quantized weights (int8)", lambda s, w: (dataclasses.replace(
        s, quantized_weights=True), w)),
    ("quantized gradients (int8)", lambda s, w: (dataclasses.replace(
        s, quantized_gradients=True), w)),
    ("hpZ within a node (8)", lambda s, w: (dataclasses.replace(s, hpz=8), w)),
    ("one buffer per unit (fewer collectives)", lambda s, w: (dataclasses.replace(
        s, max_buffers=1), w)),
    ("granularity element", lambda s, w: (dataclasses.replace(s, granularity="element"), w)),
    ("granularity rows:128", lambda s, w: (dataclasses.replace(s, granularity="rows:128"), w)),
)


def settings_that_matter(model: ModelShapes, setup: Setup, cluster: Cluster, work: Workload,
                         cache: PlanCache | None = None, top: int = 5) -> list:
    """[(setting, step seconds, change against the setup's step)] for ours with one setting
    changed, largest changes first; settings the setup cannot take are skipped."""
    cache = cache or PlanCache()
    base = predict("ours", model, setup, cluster, work, cache)["step_s"]
    rows = []
    for name, change in _VARIANTS:
        s, w = change(setup, work)
        if (s, w) == (setup, work) or (s.hpz > 1 and (s.shard_size % s.hpz or
                                                      s.hpz >= s.shard_size)):
            continue
        try:
            step = predict("ours", model, s, cluster, w, cache)["step_s"]
        except ValueError:   # a granularity the model's shapes cannot take
            continue
        rows.append((name, step, step / base - 1))
    rows.sort(key=lambda r: -abs(r[2]))
    return rows[:top]


def scan(model: ModelShapes, setup: Setup, cluster: Cluster, work: Workload,
         world_sizes=DEFAULT_SCAN, systems=SYSTEMS, records: dict | None = None) -> dict:
    """{"weak": [...], "strong": [...]}: per world size and system, predict()'s result. Weak:
    `work` per rank at every size; strong: the global batch of the largest size (work's
    micro-batch on each of its ranks), run with gradient accumulation on fewer ranks.
    `records`: {(world size, system): recorded step} (a micro-step's collectives do not
    depend on how many micro-steps accumulate)."""
    records = records or {}
    cache = PlanCache()
    largest = max(world_sizes)
    out = {"weak": [], "strong": []}
    for world in sorted(world_sizes):
        for kind in ("weak", "strong"):
            accum = setup.grad_accum * (largest // world if kind == "strong" else 1)
            if kind == "strong" and largest % world:
                continue
            s = dataclasses.replace(setup, world_size=world, grad_accum=accum)
            row = {"world_size": world, "grad_accum": accum}
            for system in systems:
                row[system] = predict(system, model, s, cluster, work, cache,
                                      records.get((world, system)))
            out[kind].append(row)
    return out
