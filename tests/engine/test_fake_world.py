"""`vescale plan --time --fake-world`: a real step of ours and of torch's FSDP2, run as rank 0 of W
on the fake process group (python -m vescale_engine.fake_world, as the command runs it), gives
the time model its collectives; they are the planner's schedule, task by task, for every
structure and setup the planner schedules (else the prediction would rest on a schedule no
engine runs), the step's own collectives (Muon's) are kept, and a record that does not fit the
model or setup is refused by name."""
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vescale_engine.plan.capacity import CapacityError, Setup
from vescale_engine.plan.model_plan import load_shapes
from vescale_engine.plan.step_time import load_cluster
from vescale_engine.plan.step_time.recorded import compare, from_record
from vescale_engine.plan.step_time.report import Workload, predict
from vescale_engine.plan.step_time.schedule import build_schedule

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("capacity_check",
                                               ROOT / "benchmarks" / "capacity_check.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# (model, system, world size, setup changes): both systems, HSDP's replicas, ZeRO++'s
# quantized collectives and hpZ's backward gathers, no reshard after forward, accumulation
CASES = [
    ("dense", "ours", 8, {}),
    ("dense", "fsdp2", 16, {"hsdp": 2, "reduce_dtype": "fp32"}),
    ("dense", "ours", 16, {"hsdp": 2, "reduce_dtype": "fp32", "optimizer": "AdamW8bit"}),
    ("dense", "ours", 8, {"hpz": 2, "quantized_weights": True, "quantized_gradients": True}),
    ("moe", "ours", 32, {"reshard_after_forward": False}),
    ("moe", "fsdp2", 8, {"reshard_after_forward": False}),
    ("tied", "fsdp2", 8, {"grad_accum": 2, "param_dtype": "fp32"}),
]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return bench.write_tiny(tmp_path_factory.mktemp("shapes"))   # the benchmark's TINY


def record(path, setup: Setup, system: str) -> dict:
    """The command's own way: a fresh process, the case on stdin, the record on stdout."""
    case = {"shapes": str(path), "setup": dataclasses.asdict(setup), "system": system}
    done = subprocess.run([sys.executable, "-m", "vescale_engine.fake_world"],
                          input=json.dumps(case), capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("kind,system,world,changes", CASES,
                         ids=[f"{k}-{s}-W{w}-" + "-".join(f"{a}={b}" for a, b in c.items())
                              for k, s, w, c in CASES])
def test_the_recorded_step_is_the_planned_schedule(shapes, kind, system, world, changes):
    model = load_shapes(str(shapes[kind]))
    setup = Setup(world, **changes)
    found = record(shapes[kind], setup, system)
    assert found["collectives"] and {c["role"] for c in found["collectives"]} >= \
        {"gather", "reduce"}
    planned = build_schedule(system, model, setup, 4096)
    recorded = from_record(planned, model, setup, found)
    check = compare(planned, recorded)
    assert check["same"], (check, [(t.unit, t.phase, t.gathers, t.reduces)
                                   for t in recorded.tasks])
    cluster, work = load_cluster("h100"), Workload(4096, 1)
    with_record = predict(system, model, setup, cluster, work, record=found)
    assert with_record.pop("schedule")["same"]
    assert with_record == predict(system, model, setup, cluster, work)


def test_the_optimizer_steps_own_collectives_are_kept(shapes):
    """Muon gathers each matrix on one rank in its step (all-to-alls): recorded in the step's
    phase, played after the last reduction, and the step takes longer than the planner's."""
    model, setup = load_shapes(str(shapes["tied"])), Setup(16, optimizer="Muon")
    found = record(shapes["tied"], setup, "ours")
    planned = build_schedule("ours", model, setup, 4096)
    recorded = from_record(planned, model, setup, found)
    assert recorded.tasks == planned.tasks
    assert {c.kind for c in recorded.step_comms} == {"all_to_all"}
    check = compare(planned, recorded)
    assert not check["same"] and check["collectives"][1] > check["collectives"][0]
    cluster, work = load_cluster("h100"), Workload(4096, 1)
    assert predict("ours", model, setup, cluster, work, record=found)["step_s"] > \
        predict("ours", model, setup, cluster, work)["step_s"]


def _synthetic(planned, setup, **change) -> dict:
    """A record of `planned`'s first gather, changed."""
    c = planned.tasks[0].gathers[0]
    entry = {"kind": c.kind, "nbytes": c.nbytes, "group_size": setup.shard_size, "stride": 1,
             "phase": "forward", "role": "gather", "unit": "", **change}
    return {"system": planned.system, "world_size": setup.world_size, "torch": "x",
            "collectives": [entry]}


def test_a_record_that_does_not_fit_is_refused_by_name(shapes):
    model, setup = load_shapes(str(shapes["dense"])), Setup(8)
    planned = build_schedule("ours", model, setup, 4096)
    cases = [
        (dict(group_size=4), "over 4 ranks (stride 1), none of the time model's groups"),
        (dict(kind="broadcast_"), "issued broadcast_, which the time model does not play"),
        (dict(unit="blocks.0"), "unit 'blocks.0' is none of the schedule's"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            from_record(planned, model, setup, _synthetic(planned, setup, **change))
    with pytest.raises(ValueError, match="ours at 16 ranks recorded, ours at 8 planned"):
        from_record(planned, model, setup, {**_synthetic(planned, setup), "world_size": 16})
    # what fits lands where the issue order says: the root's first task, the rest empty
    one = from_record(planned, model, setup, _synthetic(planned, setup))
    assert one.tasks[0].gathers == planned.tasks[0].gathers[:1]
    assert not any(t.gathers or t.reduces for t in one.tasks[1:])


def vescale(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_command_records_every_world_size_and_says_so(shapes):
    out = vescale("plan", "--shapes", str(shapes["dense"]), "--world-size", "8,16", "--time",
                  "--fake-world", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    for row in rows:
        time = row["time"]
        for system in ("ours", "fsdp2"):
            assert time[system]["schedule"]["same"], (row["world_size"], system)
            assert time[system]["schedule"]["source"].startswith("recorded (torch ")
        assert "schedule" not in time["zero3"]   # DeepSpeed's rules, not a run
    assert out.stderr.count("recorded in") == 4   # progress: each run, with its time


def test_the_table_says_where_the_collectives_came_from(capsys):
    """The text output's line (the recordings themselves: the test above)."""
    from launcher import plan_time
    same = {"source": "recorded (torch 2.x)", "collectives": [9, 9], "bytes": [5e9, 5e9],
            "same": True}
    other = {**same, "collectives": [9, 10], "bytes": [5e9, 6e9], "same": False}
    plan_time._print_sources({("rows:1", 8): {"ours": {"schedule": same},
                                              "fsdp2": {"schedule": same}, "zero3": {}}})
    plan_time._print_sources({("rows:1", 8): {"ours": {"schedule": other},
                                              "fsdp2": {"schedule": same}, "zero3": {}}})
    plan_time._print_sources({("rows:1", 8): {"ours": {}, "fsdp2": {}, "zero3": {}}})
    first, second = capsys.readouterr().out.strip().splitlines()   # nothing without records
    assert first.startswith("collectives: ours and FSDP2 as recorded on the fake process "
                            "group (torch 2.x), every one the planner's too; ZeRO-3 from")
    assert "unlike the planner's for ours at 8: 10 collectives, 6.000 GB recorded, 9, 5.000 " \
           "GB planned;" in second


def test_a_host_without_the_memory_is_refused_before_any_run(monkeypatch):
    from launcher import plan_time
    monkeypatch.setattr(os, "sysconf", lambda name: 1 << 20 if name == "SC_AVPHYS_PAGES"
                        else 4096)   # 4 GiB free
    with pytest.raises(CapacityError, match=r"--fake-world: a step of fsdp2 as rank 0 of 64 "
                                            r"needs about 9\.0 GB of host memory"):
        plan_time._check_memory("fsdp2", 64, {"total": 9e9})
    plan_time._check_memory("fsdp2", 64, {"total": 1e9})   # fits: no error
