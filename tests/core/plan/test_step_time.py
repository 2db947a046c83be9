"""`vescale plan --time`'s schedule and critical path (vescale_engine/plan/step_time): every
system's collectives add up to the bytes `--memory`'s traffic counts (which
tests/engine/test_capacity.py checks against the collectives real steps issue), the simulator's
overlap by hand, and the scan's speed. Torch-free."""
import dataclasses
import os
import time

import pytest

from vescale_engine.plan.capacity import PlanCache, Setup, estimate
from vescale_engine.plan.model_plan import load_shapes
from vescale_engine.plan.step_time import load_cluster
from vescale_engine.plan.step_time.compute import Work
from vescale_engine.plan.step_time.report import (Workload, predict, scan,
                                                  settings_that_matter)
from vescale_engine.plan.step_time.schedule import Comm, Schedule, Task, build_schedule
from vescale_engine.plan.step_time.simulate import Placement, simulate

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
MODELS = os.path.join(ROOT, "examples", "models")


def shapes(name):
    return load_shapes(os.path.join(MODELS, f"{name}.json"))


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100")


def sent(schedule: Schedule, setup: Setup) -> dict:
    """Bytes per rank per optimizer step, by the traffic's keys, from the schedule's
    collectives: what an all-gather receives and a reduce-scatter (or the quantized
    gradients' all-to-all) sends, (M-1)/M of the full buffer; the all-reduces' ring bytes,
    2(R-1)/R of the buffer, summed before the division as the traffic does."""
    size = {"shard": schedule.shard_group, "replica": setup.hsdp, "hpz": setup.hpz}
    out, ring = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}, {}
    for task in schedule.tasks:
        for c in task.gathers + task.reduces:
            M = size[c.group]
            if c.kind == "all_reduce":
                ring[M] = ring.get(M, 0) + c.count * c.nbytes
                continue
            key = {"all_gather": "all_gather_hpz" if c.group == "hpz" else "all_gather",
                   "reduce_scatter": "reduce_scatter", "all_to_all": "reduce_scatter"}[c.kind]
            out[key] = out.get(key, 0) + c.count * c.nbytes * (M - 1) // M
    n = setup.grad_accum
    out = {k: n * v for k, v in out.items()}
    out["all_reduce"] = sum(n * 2 * (M - 1) * b // M for M, b in ring.items())
    return out


SETUPS = [
    ("llama3-70b", dict(world_size=64)),
    ("llama3-70b", dict(world_size=256, reshard_after_forward=False, reduce_dtype="fp32")),
    ("llama3-70b", dict(world_size=512, hsdp=4, grad_accum=2)),
    ("gpt-oss-120b", dict(world_size=128, optimizer="AdamW8bit")),
    ("deepseek-v3", dict(world_size=1024, granularity="rows:16")),
    ("llama-3.1-8b", dict(world_size=64, quantized_weights=True, quantized_gradients=True)),
    ("llama-3.1-8b", dict(world_size=64, quantized_weights=True, hpz=8)),
]


@pytest.mark.parametrize("model,changes", SETUPS,
                         ids=[f"{m}-" + "-".join(f"{k}={v}" for k, v in c.items())
                              for m, c in SETUPS])
def test_each_systems_collectives_add_up_to_the_traffic_estimate(model, changes):
    """The schedule moves exactly the bytes --memory's traffic counts, system by system
    (ZeRO++ settings: ours only)."""
    m, setup = shapes(model), Setup(**changes)
    est = estimate(m, setup)
    for system in ("ours", "fsdp2", "zero3"):
        if system != "ours" and (setup.quantized or setup.hpz > 1):
            continue
        traffic = est["traffic"] if system == "ours" else est["traffic"][system]
        mine = sent(build_schedule(system, m, setup, 4096), setup)
        expected = {k: traffic.get(k, 0) for k in mine}
        assert mine == expected, (system, mine, expected)


def test_units_and_phases_in_the_engines_order():
    """Ours: forward gathers the root then every layer; backward starts with the last layer,
    still gathered, and ends with the root's reduce-scatter; FSDP2 regathers the last layer
    too; every unit reduce-scattered once per micro-step."""
    m = shapes("llama3-70b")
    setup = Setup(world_size=64)
    ours, fsdp2 = (build_schedule(s, m, setup, 4096) for s in ("ours", "fsdp2"))
    phases = [(t.unit, t.phase) for t in ours.tasks]
    assert phases[0] == ("root", "forward") and phases[-1] == ("root", "backward")
    assert phases.count(("layers", "forward")) == phases.count(("layers", "backward")) == 80
    first_back = next(t for t in ours.tasks if t.unit == "layers" and t.phase == "backward")
    assert [c.kind for c in first_back.gathers] == []
    assert [c.kind for c in next(t for t in fsdp2.tasks if t.unit == "layers" and
                                 t.phase == "backward").gathers] == ["all_gather"]
    for s in (ours, fsdp2):
        reduces = [t.unit for t in s.tasks if any(c.kind == "reduce_scatter" for c in t.reduces)]
        assert reduces == ["layers"] * 80 + ["root"]
    # FSDP2's copies, ours none: copy-out of every gather, copy-in of every gradient
    assert all(t.copy_before == 0 and t.copy_after == 0 for t in ours.tasks)
    layer = next(t for t in fsdp2.tasks if t.unit == "layers" and t.phase == "backward")
    assert layer.copy_before == layer.gathers[0].nbytes and \
        layer.copy_after == layer.reduces[0].nbytes


def _cluster_of(h100, **device):
    return dataclasses.replace(h100, device=dataclasses.replace(h100.device, **device))


def _flat(h100):
    """A cluster whose numbers make times easy: 1 FLOP/s of matmul per token-FLOP, links of 1
    byte/s and no latency do not exist, so the tests below use a schedule's structure only."""
    return _cluster_of(h100, bf16_flops=1.0, matmul_efficiency=1.0, attention_efficiency=1.0)


def test_overlap_by_hand(h100, monkeypatch):
    """Three units: gathers of 1 s, computes of 2 s, one reduce-scatter of 1 s each. With
    prefetch 1 every gather but the first hides behind the compute before it: 1 + 3 x 2 + the
    last reduce-scatter's 1 s = 8 s; with prefetch 0 each gather is issued after the unit
    before it ended, behind that unit's reduce-scatter on the one link: 3 x (1 + 2 + 1) =
    12 s."""
    import vescale_engine.plan.step_time.simulate as sim
    monkeypatch.setattr(sim, "collective_time", lambda kind, nbytes, group, cluster: nbytes)
    monkeypatch.setattr(sim, "copy_time", lambda nbytes, cluster: nbytes)
    tasks = tuple(Task(f"u{i}", "backward", Work(2.0, 0.0), (Comm("all_gather", 1),),
                       (Comm("reduce_scatter", 1),)) for i in range(3))
    schedule = Schedule("test", tasks, 0, 8)
    place = Placement.of(8, 8, 1, 8)
    cluster = _flat(h100)
    hidden = simulate(schedule, cluster, place, tokens=1, prefetch=1)
    # the gradient norm's all-reduce is 8 "seconds" here (its bytes): taken off
    assert hidden.step - 8 == pytest.approx(1 + 3 * 2 + 1)
    exposed = simulate(schedule, cluster, place, tokens=1, prefetch=0)
    assert exposed.step - 8 == pytest.approx(3 * (1 + 2 + 1))
    assert hidden.compute == exposed.compute == pytest.approx(6)
    assert exposed.exposed == pytest.approx(exposed.step - 6)
    # no overlap (CPU ranks on gloo): every collective adds to the compute
    serial = simulate(schedule, dataclasses.replace(cluster, overlap=False), place, tokens=1)
    assert serial.step - 8 == pytest.approx(3 * 2 + 3 * 1 + 3 * 1)
    # copies run on the compute stream: 0.5 s before each unit adds 1.5 s
    copied = Schedule("test", tuple(dataclasses.replace(t, copy_before=0.5) for t in tasks), 0, 8)
    assert simulate(copied, cluster, place, tokens=1).step - hidden.step == pytest.approx(1.5)


def test_accumulation_extrapolates_exactly(h100):
    """Micro-steps past the second repeat its period: 7 played as 2 and extrapolated equal 7
    played one by one (the closed form is used from 4 on; 3 is played in full)."""
    import vescale_engine.plan.step_time.simulate as sim
    m = shapes("llama3-70b")
    setup = Setup(world_size=64)
    schedule = build_schedule("ours", m, setup, 4096)
    place = Placement.of(64, 64, 1, 8)
    fast = simulate(schedule, h100, place, 4096, grad_accum=7)
    slow = sim._play(schedule.tasks * 7, h100, 4096, 1,
                     lambda c: c.count * sim.collective_time(c.kind, c.nbytes,
                                                             getattr(place, c.group), h100))
    norm = sim.collective_time("all_reduce", 8, place.shard, h100)
    assert fast.step - fast.optimizer - norm == pytest.approx(slow[0], rel=1e-9)


def test_predict_reports_mfu_and_shares(h100):
    m = shapes("llama-3.1-8b")
    r = predict("fsdp2", m, Setup(world_size=8), h100, Workload(8192, 2, "selective"))
    assert r["tokens_per_s_per_gpu"] == pytest.approx(16384 / r["step_s"])
    assert 0 < r["mfu"] < 1 and 0 < r["copies_share"] < 0.1 and 0 <= r["exposed_share"] < 1
    # the MFU counts model FLOPs: selective recompute makes the step longer, not the MFU higher
    none = predict("fsdp2", m, Setup(world_size=8), h100, Workload(8192, 2, "none"))
    assert none["mfu"] > r["mfu"]


def test_fsdp2_that_cannot_shard_is_reported_not_timed(h100):
    """FSDP2 shards dim 0: GPT-OSS's 128-expert stacks pad past the memory at 256 ranks
    (the paper's OOM) but run; a model FSDP2 refuses reports why."""
    m = shapes("gpt-oss-120b")
    r = predict("fsdp2", m, Setup(world_size=256), h100, Workload(4096, 1))
    ours = predict("ours", m, Setup(world_size=256), h100, Workload(4096, 1))
    assert r["step_s"] > ours["step_s"]   # twice the gathered bytes of the expert stacks


def test_refusals(h100):
    m = shapes("llama3-70b")
    with pytest.raises(ValueError, match="TP/EP"):
        predict("ours", m, Setup(world_size=64, tp=8), h100, Workload())
    with pytest.raises(ValueError, match="offload"):
        predict("ours", m, Setup(world_size=64, offload_optimizer=1.0), h100, Workload())
    with pytest.raises(ValueError, match="whole nodes"):
        predict("ours", m, Setup(world_size=12), h100, Workload())
    with pytest.raises(ValueError, match="unknown system"):
        build_schedule("megatron", m, Setup(world_size=8), 4096)


def test_settings_that_matter_name_the_large_changes(h100):
    """Communication-bound GPT-OSS at 1,024 ranks with few tokens: keeping units gathered
    and int8 weights cut the step; the list is sorted by the size of the change."""
    m = shapes("gpt-oss-120b")
    rows = settings_that_matter(m, Setup(world_size=1024), h100, Workload(4096, 1))
    names = [r[0] for r in rows]
    assert "reshard_after_forward off" in names and "quantized weights (int8)" in names
    assert [abs(r[2]) for r in rows] == sorted((abs(r[2]) for r in rows), reverse=True)
    assert all(r[2] < 0 for r in rows if r[0] in ("reshard_after_forward off",
                                                  "quantized weights (int8)"))


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(MODELS)
                                        if f.endswith(".json")))
def test_scan_to_8192_ranks_runs_in_seconds(h100, name):
    """Every shipped shapes file, weak and strong scaling from 8 to 8,192 ranks, three
    systems: seconds (the issue's bound; a generous 30 s here for a loaded machine)."""
    m = shapes(name)
    started = time.monotonic()
    out = scan(m, Setup(world_size=8), h100, Workload(4096, 1, "selective"))
    took = time.monotonic() - started
    assert [r["world_size"] for r in out["weak"]] == [2 ** k for k in range(3, 14)]
    assert len(out["strong"]) == 11 and out["strong"][0]["grad_accum"] == 1024
    assert took < 30, took
    for row in out["weak"]:
        assert row["ours"]["step_s"] > 0


def test_weak_scaling_never_speeds_forward_and_backward_up(h100):
    """Weak scaling: the same work per rank on more ranks never takes less time before the
    optimizer step (bigger rings, more nodes), for every system; the optimizer step itself
    shrinks with the shard."""
    out = scan(shapes("llama3-70b"), Setup(world_size=8), h100, Workload(4096, 1))
    for system in ("ours", "fsdp2", "zero3"):
        steps = [r[system]["step_s"] - r[system]["optimizer_s"] for r in out["weak"]]
        assert steps == sorted(steps), (system, steps)
        optimizer = [r[system]["optimizer_s"] for r in out["weak"]]
        assert optimizer == sorted(optimizer, reverse=True)


def test_plan_cache_is_shared_and_results_deterministic(h100):
    m, setup, work = shapes("deepseek-v3"), Setup(world_size=256), Workload(4096, 1)
    cache = PlanCache()
    first = predict("ours", m, setup, h100, work, cache)
    assert predict("ours", m, setup, h100, work, cache) == first == predict("ours", m, setup,
                                                                             h100, work)
