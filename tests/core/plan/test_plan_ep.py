"""`vescale plan --tp N --ep N` (issue 25, item 6): TP/EP-local shapes, per-rank bytes against
the mesh arithmetic worked out here from the original shapes (not from the planner's local
model), per-group traffic and all-to-all bytes, FSDP2+EP's placement rule, one-line errors,
and the committed MoE shapes files and docs table against benchmarks/plan_ep.py."""
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import cli
from vescale_engine.plan import capacity, model_plan, parallel
from vescale_engine.plan.capacity import units

ROOT = Path(__file__).resolve().parents[3]  # tests/core/<package>/ is three folders down
_spec = importlib.util.spec_from_file_location("plan_ep", ROOT / "benchmarks" / "plan_ep.py")
plan_ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_ep)

# A tiny MoE model: HF DeepSeek-V3 tensor layout, dims chosen so that FSDP2 pads nothing on
# (world 16, tp 2, ep 4): dp_shard 8, efsdp 4.
H, E, I, V, LAYERS = 16, 8, 32, 64, 3
TINY = {
    "name": "tiny-moe",
    "tp_plan": {"self_attn.q_proj": "colwise", "self_attn.o_proj": "rowwise",
                "mlp.experts.gate_up_proj": "packed_colwise", "mlp.experts.down_proj": "rowwise",
                "lm_head": "colwise"},
    "ep_plan": {"mlp.experts.gate_up_proj": "grouped_gemm",
                "mlp.experts.down_proj": "grouped_gemm"},
    "moe": {"experts_per_token": 2, "hidden_size": H},
    "groups": [
        {"name": "embed", "tensors": [{"name": "embed.weight", "shape": [V, H]}]},
        {"name": "layers", "repeat": LAYERS, "tensors": [
            {"name": "norm.weight", "shape": [H]},
            {"name": "self_attn.q_proj.weight", "shape": [2 * H, H]},
            {"name": "self_attn.q_proj.bias", "shape": [2 * H]},
            {"name": "self_attn.o_proj.weight", "shape": [H, 2 * H]},
            {"name": "self_attn.o_proj.bias", "shape": [H]},
            {"name": "mlp.gate.weight", "shape": [E, H]},
            {"name": "mlp.experts.gate_up_proj", "shape": [E, 2 * I, H]},
            {"name": "mlp.experts.down_proj", "shape": [E, H, I]}]},
        {"name": "head", "tensors": [{"name": "final_norm.weight", "shape": [H]},
                                     {"name": "lm_head.weight", "shape": [V, H]}]}]}
# What TP splits, and on which dim, by transformers' styles (colwise: dim ndim-2, a bias its
# only dim; rowwise: the last dim, its bias whole; packed_colwise: dim ndim-2 in two halves).
TP_SPLIT = {"self_attn.q_proj.weight": 0, "self_attn.q_proj.bias": 0,
            "self_attn.o_proj.weight": 1, "mlp.experts.gate_up_proj": 1,
            "mlp.experts.down_proj": 2, "lm_head.weight": 0}
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def run(*args, capsys):
    code = cli.main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def expected_shapes(tp, ep):
    """{(group, tensor): local shape} worked out from TP_SPLIT / EXPERTS alone."""
    out = {}
    for g in TINY["groups"]:
        for t in g["tensors"]:
            shape = list(t["shape"])
            if t["name"] in EXPERTS and ep > 1:
                shape[0] //= ep
                out[(g["name"] + ".experts", t["name"])] = shape
                continue
            if t["name"] in TP_SPLIT and tp > 1:
                shape[TP_SPLIT[t["name"]]] //= tp
            out[(g["name"], t["name"])] = shape
    return out


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 4), (2, 4)])
def test_local_shapes_in_the_json(tiny, tp, ep, capsys):
    code, out, err = run("--shapes", tiny, "--world-size", 16, "--tp", tp, "--ep", ep, "--json",
                         "--verify", capsys=capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["world_size"] == 16
    assert plan["mesh"] == {"tp": tp, "ep": ep, "dp": 16 // tp, "dp_shard": 16 // tp,
                            "efsdp": 16 // ep}
    got = {(g["name"], t["name"]): t["shape"] for g in plan["groups"]
           for b in g["buffers"] for t in b["tensors"]}
    assert got == expected_shapes(tp, ep)
    groups = {g["name"]: g for g in plan["groups"]}
    assert [g["name"] for g in plan["groups"]] == ["embed", "layers"] + \
        (["layers.experts"] if ep > 1 else []) + ["head"]
    for g in plan["groups"]:
        want = 16 // ep if g["name"].endswith(".experts") else 16 // tp
        assert (g["expert"], g["shard_group_size"]) == (g["name"].endswith(".experts"), want)
        assert all(len(t["local_units"]) == want for b in g["buffers"] for t in b["tensors"])
    if tp > 1 and ep == 1:   # a TP cut on dim 1 of [E, 2I/tp, H]: blocks are whole experts
        block = {t["name"]: t["block"] for b in groups["layers"]["buffers"] for t in b["tensors"]}
        assert block["mlp.experts.gate_up_proj"] % (2 * I // tp * H) == 0
        assert block["mlp.experts.down_proj"] % (I // tp) == 0


def per_rank_elements(world, tp, ep):
    """A rank's share: TP-split dense tensors numel / (dp_shard x tp), TP-replicated numel /
    dp_shard, experts numel / (efsdp x ep) (not TP-split when ep > 1; E/ep per rank)."""
    dp_shard = world // tp
    efsdp = dp_shard * tp // ep
    total = 0
    for g in TINY["groups"]:
        for t in g["tensors"]:
            n = math.prod(t["shape"]) * g.get("repeat", 1)
            if t["name"] in EXPERTS and ep > 1:
                total += n / (efsdp * ep)
            elif t["name"] in TP_SPLIT and tp > 1:
                total += n / (dp_shard * tp)
            else:
                total += n / dp_shard
    return total


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 4), (2, 4), (4, 8)])
def test_per_rank_parameter_bytes(tiny, tp, ep):
    model = model_plan.load_shapes(str(tiny))
    est = capacity.estimate(model, capacity.Setup(16, tp=tp, ep=ep))
    want = per_rank_elements(16, tp, ep)
    ours, fsdp2, zero3 = (est["memory"][s] for s in ("ours", "fsdp2", "zero3"))
    # ours: the fp32 master is the share plus its padding, to the byte; the gradient shard too
    assert ours["master"] == pytest.approx(4 * want + ours["padding"], abs=4)
    assert ours["grad"] == ours["master"]
    # AdamW: two fp32 moments and a 4-byte step per buffer (at most 4 buffers a unit instance)
    assert 0 < ours["optimizer"] - 2 * ours["master"] <= 4 * 4 * (2 * LAYERS + 2)
    if (tp, ep) == (2, 4):   # FSDP2 (torchtitan's placement) pads nothing here: exact
        assert fsdp2["padding_ratio"] == 0 and fsdp2["master"] == 4 * want
        assert zero3["grad"] == 4 * want   # ZeRO-3's fp32 partitions: divisible, exact


def test_experts_shard_over_efsdp_not_dp(tiny):
    """Each unit's collectives over its own group, exactly, on FSDP2's unpadded shards: dense
    (dp_shard - 1) / dp_shard of the dense share, experts (efsdp - 1) / efsdp of theirs; the
    all-to-all bytes by the formula; both differ if experts shard over dp_shard."""
    model = model_plan.load_shapes(str(tiny))
    setup = capacity.Setup(16, tp=2, ep=4, tokens=100)
    est = capacity.estimate(model, setup)
    dense = expert = 0
    for g in TINY["groups"]:
        for t in g["tensors"]:
            n = math.prod(t["shape"]) * g.get("repeat", 1)
            if t["name"] in EXPERTS:
                expert += n // 4            # E/ep experts
            else:
                dense += n // 2 if t["name"] in TP_SPLIT else n
    rs = 7 * (dense // 8) * 2 + 3 * (expert // 4) * 2   # dp_shard 8, efsdp 4, bf16
    assert est["traffic"]["fsdp2"]["reduce_scatter"] == rs
    ours = est["traffic"]["reduce_scatter"]
    assert rs <= ours <= rs * (1 + est["memory"]["ours"]["padding_ratio"]) + 64
    assert est["traffic"]["zero3"]["reduce_scatter"] == rs
    # all-to-all: 4 passes x 3 layers x tokens/tp x k x H x 2 B x (ep-1)/ep
    a2a = 4 * LAYERS * (100 * 2 * H * 2 * 3 // (4 * 2))
    assert [est["traffic"][s]["all_to_all"] for s in ("fsdp2", "zero3")] == [a2a, a2a]
    assert est["traffic"]["all_to_all"] == a2a
    assert est["setup"]["efsdp"] == 4 and est["setup"]["shard_group_size"] == 8
    no_ep = capacity.estimate(model, capacity.Setup(16, tp=2))["traffic"]
    assert "all_to_all" in no_ep and no_ep["all_to_all"] == 0


def test_fsdp2_ep_shards_experts_on_dim1_when_efsdp_exceeds_local_experts(tiny, capsys):
    """torchtitan: Shard(1) when efsdp x ep > E, which FSDP2 needs to divide evenly. At (64,
    ep 2): efsdp 32 > 4 local experts; down_proj's dim 1 (16) does not split over 32."""
    model = model_plan.load_shapes(str(tiny))
    local, _ = parallel.local_model(model, parallel.make_mesh(16, 1, 4), [],
                                    parallel.read_plans(str(tiny))[1])
    experts = next(g for g in local.groups if g.expert)
    assert [model_plan.fsdp2_shard_dim(experts, s, 4) for _, s in experts.tensors] == [1, 1]
    assert [model_plan.fsdp2_shard_dim(experts, s, 2) for _, s in experts.tensors] == [0, 0]
    est = capacity.estimate(model, capacity.Setup(64, ep=2))
    reason = est["memory"]["fsdp2"]["unsupported"]
    assert "uneven sharding on dim 1: mlp.experts.down_proj [4, 16, 32] over 32" in reason
    assert "total" in est["memory"]["ours"] and "total" in est["memory"]["zero3"]
    code, out, err = run("--shapes", tiny, "--world-size", 64, "--ep", 2, "--memory",
                         capsys=capsys)
    assert code == 0, err
    assert f"FSDP2   n/a: {reason}" in out.splitlines()


def test_layers_and_their_experts_interleave():
    dense = units.Unit("layers", (), 2)
    experts = units.Unit("layers.experts", (), 2, (), True, "layers")
    head = units.Unit("head", (), 1)
    assert [(u.name, i) for u, i in units.expand([dense, experts, head])] == [
        ("layers", 0), ("layers.experts", 0), ("layers", 1), ("layers.experts", 1), ("head", 0)]


@pytest.mark.parametrize("args,message", [
    (["--world-size", 12, "--tp", 8], "world size 12 is not divisible by tp 8"),
    (["--world-size", 16, "--ep", 3], "ep 3 does not divide the 16 ranks of a replica"),
    (["--world-size", 32, "--ep", 16], "tensor 'mlp.experts.gate_up_proj': 8 experts are not "
                                        "divisible by ep 16"),
    (["--world-size", 64, "--tp", 64], "tensor 'self_attn.q_proj.weight': dim 0 of [32, 16]"),
    (["--world-size", 16, "--ep", 2, "--tokens", 8], "--tokens needs --memory"),
    (["--world-size", 16, "--ep", 2, "--memory", "--tokens", "0"],
     "--tokens must be a positive integer"),
    (["--world-size", 16, "--tp", 2, "--memory", "--optimizer", "Muon"],
     "Muon is not estimated with --tp"),
    (["--world-size", 16, "--ep", 2, "--memory", "--offload-optimizer"],
     "offload is not estimated with --tp or --ep"),
    (["--world-size", 16, "--ep", 2, "--memory", "--root", "layers.experts"],
     "root group 'layers.experts' is not a group"),
])
def test_errors_are_one_line(tiny, args, message, capsys):
    code, out, err = run("--shapes", tiny, *args, capsys=capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_tp_split_rules():
    """transformers' styles on one tensor each: the dim, the halves, a rowwise bias whole."""
    assert parallel._tp_local((48, 16), "colwise", 4, "w") == ((12, 16), 1)
    assert parallel._tp_local((48,), "colwise", 4, "b") == ((12,), 1)
    assert parallel._tp_local((16, 48), "rowwise", 4, "w") == ((16, 12), 12)
    assert parallel._tp_local((16,), "rowwise", 4, "x.bias") == ((16,), 1)
    assert parallel._tp_local((8, 64, 16), "packed_colwise", 4, "g") == ((8, 16, 16), 256)
    with pytest.raises(ValueError, match=r"g: dim 1 of \[8, 48, 16\] \(48\) is not divisible "
                                         r"by 16 x 2 packed halves"):
        parallel._tp_local((8, 48, 16), "packed_colwise", 16, "g")


def test_plans_missing_or_wrong_are_one_line(tmp_path, capsys):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({k: v for k, v in TINY.items() if k not in ("tp_plan",
                                                                           "ep_plan")}))
    for flag, message in (("--tp", "needs a 'tp_plan'"), ("--ep", "needs an 'ep_plan'")):
        code, out, err = run("--shapes", plain, "--world-size", 16, flag, 2, capsys=capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**TINY, "tp_plan": {"self_attn.q_proj": "sideways"}}))
    code, out, err = run("--shapes", bad, "--world-size", 16, "--tp", 2, capsys=capsys)
    assert code == 2 and "tp_plan['self_attn.q_proj']: unknown style 'sideways'" in err
    none = tmp_path / "none.json"
    none.write_text(json.dumps({**TINY, "ep_plan": {"mlp.nothing": "grouped_gemm"}}))
    code, out, err = run("--shapes", none, "--world-size", 16, "--ep", 2, capsys=capsys)
    assert code == 2 and "the ep_plan names no tensor" in err
    nomoe = tmp_path / "nomoe.json"
    nomoe.write_text(json.dumps({k: v for k, v in TINY.items() if k != "moe"}))
    code, out, err = run("--shapes", nomoe, "--world-size", 16, "--ep", 2, "--memory",
                         capsys=capsys)
    assert code == 2 and "--ep needs 'moe'" in err and len(err.strip().splitlines()) == 1


def test_cli_table_and_memory_block():
    """One real process: the sweep table and the memory block with the all-to-all column."""
    shapes = "benchmarks/capacity_models/deepseek-v3.json"
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", "--shapes", shapes,
                          "--world-size", "1024,8192", "--ep", "32", "--memory"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("rows:1 ")]
    assert [r[1] for r in rows] == ["1024", "8192"]
    assert out.stdout.count("expert units over 32 (efsdp") == 1   # 1024 / 32
    assert out.stdout.count("expert units over 256 (efsdp") == 1  # 8192 / 32
    systems = [line.split() for line in out.stdout.splitlines()
               if line.split() and line.split()[0] in ("ours", "FSDP2", "ZeRO-3")]
    assert len(systems) == 6 and all(len(r) == 10 for r in systems)   # ... + all2all
    model = model_plan.load_shapes(str(ROOT / shapes))
    est = capacity.estimate(model, capacity.Setup(8192, ep=32))
    assert float(systems[3][5]) == round(est["memory"]["ours"]["total"] / 1e9, 2)
    assert float(systems[3][9]) == round(est["traffic"]["all_to_all"] / 1e9, 1)


def test_moe_shapes_files_and_docs_table_are_the_scripts():
    """The committed shapes files are what benchmarks/plan_ep.py writes; the fused files hold
    what examples/models/*.json (written independently, one tensor per expert) hold; the docs'
    table is what the script prints today."""
    paths = {}
    for name, config in plan_ep.CONFIGS.items():
        paths[name] = ROOT / "benchmarks" / "capacity_models" / f"{name}.json"
        assert json.loads(paths[name].read_text()) == plan_ep.shapes(name, config), name
        fused = model_plan.load_shapes(str(paths[name]))
        listed = model_plan.load_shapes(str(ROOT / "examples" / "models" / f"{name}.json"))
        assert fused.numel == listed.numel
        for a, b in zip(fused.groups, listed.groups, strict=True):
            assert (a.name, a.repeat) == (b.name, b.repeat)
            assert [t for t in a.tensors if ".experts." not in t[0]] == \
                [t for t in b.tensors if ".experts." not in t[0]]
    text = (ROOT / "docs" / "capacity_planning.md").read_text()
    table = plan_ep.summary_table(plan_ep.rows({n: str(p) for n, p in paths.items()}))
    assert table in text
    assert "python benchmarks/plan_ep.py" in text
    assert re.search(r"## MoE with expert parallelism", text)
