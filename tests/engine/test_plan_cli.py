"""`vescale plan`: JSON verified independently of the planner, sweep table, plot, bad input."""
import json
import math
import os
import subprocess
import sys

import pytest

MODELS = "examples/models"


def vescale(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, cwd=cwd or os.getcwd(), timeout=300)


def verify_plan_json(plan, shapes_file):
    """Check a `vescale plan --json` object against the shapes file, from the contract alone."""
    model = json.load(open(shapes_file))
    m = plan["world_size"]
    assert [g["name"] for g in plan["groups"]] == [g["name"] for g in model["groups"]]
    padded = total = 0
    for group, shapes in zip(plan["groups"], model["groups"]):
        assert group["repeat"] == shapes.get("repeat", 1)
        want = {t["name"]: math.prod(t["shape"]) for t in shapes["tensors"]}
        got = {}
        for buf in group["buffers"]:
            S, end = buf["shard_size"], 0
            assert S > 0 and len(buf["tensors"]) > 0
            for t in sorted(buf["tensors"], key=lambda t: t["offset"]):
                off, n, g = t["offset"], t["numel"], t["block"]
                assert off >= end and off + n <= m * S, "tensors overlap or leave the buffer"
                end = off + n
                for b in range(S * (off // S + 1), off + n, S):
                    assert (b - off) % g == 0, f"{t['name']}: boundary {b} cuts a block"
                units = t["local_units"]
                assert len(units) == m and sum(units) == -(-n // g)
                for r, u in enumerate(units):  # rank r holds exactly the blocks in its shard
                    lo, hi = max(off, r * S), min(off + n, (r + 1) * S)
                    assert u == (max(0, -(-(hi - off) // g) - -(-(lo - off) // g)) if hi > lo else 0)
                got[t["name"]] = n
            pad = m * S - sum(t["numel"] for t in buf["tensors"])
            assert buf["padding"] == pad
            padded += group["repeat"] * pad
        assert got == want
        total += group["repeat"] * sum(want.values())
    assert plan["padding_ratio"] == pytest.approx(padded / total)


@pytest.mark.parametrize("name,m,gran", [("gpt-oss-120b", 256, "rows:16"),
                                         ("llama3-70b", 1024, "rows:16"),
                                         ("deepseek-v3", 64, "tile:32x32"),
                                         ("llama-3.1-405b", 8192, "rows:128"),
                                         ("kimi-k2", 128, "rows:1")])
def test_json_plan_verifies_independently(name, m, gran):
    out = vescale("plan", "--shapes", f"{MODELS}/{name}.json", "--world-size", str(m),
                  "--granularity", gran, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["granularity"] == gran and plan["plan_seconds"] >= 0
    verify_plan_json(plan, f"{MODELS}/{name}.json")


def test_sweep_table_verify_and_plot(tmp_path):
    png = tmp_path / "padding.png"
    out = vescale("plan", "--shapes", f"{MODELS}/gpt-oss-120b.json", "--world-size", "8,64,256",
                  "--granularity", "rows:1,rows:16", "--verify", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("rows:")]
    assert [(r[0], r[1]) for r in rows] == [(g, w) for g in ("rows:1", "rows:16")
                                            for w in ("8", "64", "256")]
    # ours, buffers, 1-buffer, LB, per-block, FSDP2 and ZeRO-3 each with its whole-blocks figure
    assert all(len(r) == 12 for r in rows)
    assert "every invariant holds" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_single_world_size_prints_units():
    out = vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size", "64")
    assert out.returncode == 0, out.stderr
    assert "unit layers x80" in out.stdout and "FSDP2" in out.stdout


BAD_SHAPES = {
    "not json": ("{", "not valid JSON"),
    "no groups": ('{"name": "x"}', "non-empty 'groups'"),
    "zero dim": ('{"groups": [{"name": "g", "tensors": [{"name": "w", "shape": [4, 0]}]}]}',
                 "group 'g', tensor 'w': non-positive dimension"),
    "bad shape": ('{"groups": [{"name": "g", "tensors": [{"name": "w", "shape": "4"}]}]}',
                  "tensor 'w': 'shape' must be"),
    "bad repeat": ('{"groups": [{"name": "g", "repeat": 0, "tensors": []}]}',
                   "group 'g': 'repeat' must be a positive integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_SHAPES))
def test_bad_shapes_file(tmp_path, case):
    text, message = BAD_SHAPES[case]
    shapes = tmp_path / "bad.json"
    shapes.write_text(text)
    png = tmp_path / "never.png"
    out = vescale("plan", "--shapes", str(shapes), "--world-size", "8", "--plot", str(png))
    assert out.returncode == 2
    assert message in out.stderr and str(shapes) in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not png.exists() and os.listdir(tmp_path) == ["bad.json"]


@pytest.mark.parametrize("args,message", [
    (["--world-size", "0"], "world sizes must be positive"),
    (["--world-size", "8", "--granularity", "rows:x"], "unknown granularity"),
    (["--world-size", "8", "--granularity", "tile:32x7"],
     "group 'embed_tokens', tensor 'embed_tokens.weight': tile:32x7 does not fit"),
    (["--world-size", "8", "--shapes", "missing.json"], "missing.json: cannot read"),
])
def test_bad_arguments(args, message, tmp_path):
    shapes = ["--shapes", f"{MODELS}/llama3-70b.json"] if "--shapes" not in args else []
    out = vescale("plan", *shapes, *args, "--plot", str(tmp_path / "p.png"))
    assert out.returncode == 2, out.stdout
    assert message in out.stderr and "Traceback" not in out.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "half", "nan", "inf"])
def test_bad_offload_ratio_is_one_line(value):
    out = vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size", "8",
                  "--memory", f"--offload-optimizer={value}")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert lines == [f"vescale plan: error: --offload-optimizer RATIO must be a number in "
                     f"(0, 1], got {value!r}"], out.stderr


@pytest.mark.parametrize("args,message", [
    (["--offload-optimizer"], "--offload-optimizer needs --memory"),
    (["--offload-param"], "--offload-param needs --memory"),
    (["--memory", "--optimizer", "Muon", "--offload-param"],
     "offload is not estimated for Muon"),
])
def test_offload_flag_errors(args, message):
    out = vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size", "8", *args)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_offload_table_and_json():
    """The flag alone means ratio 1; the offload block prints each system's device peak (the
    main table's), host bytes and PCIe bytes, and --json carries the same numbers."""
    common = ["plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size", "8", "--memory"]
    text = vescale(*common, "--offload-optimizer", "--offload-param")
    assert text.returncode == 0, text.stderr
    data = vescale(*common, "--offload-optimizer", "--offload-param", "--json")
    assert data.returncode == 0, data.stderr
    est = json.loads(data.stdout)
    assert est["memory_setup"]["offload_optimizer"] == 1.0
    assert est["memory_setup"]["offload_param"] is True
    lines = text.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("offload: optimizer "
                                                                      "ratio 1, parameters on "
                                                                      "the host"))
    rows = {line.split()[0]: line.split() for line in lines[start + 3:start + 6]}
    for name, label in (("ours", "ours"), ("fsdp2", "FSDP2"), ("zero3", "ZeRO-3")):
        mem = est["memory"][name]
        pcie = (est["traffic"] if name == "ours" else est["traffic"][name])["pcie"]
        row = rows[label]
        assert float(row[1]) == round(mem["total"] / 1e9, 2)
        assert float(row[2]) == round(mem["param_shard"] / 1e9, 2)
        assert float(row[3]) == round(mem["host"]["total"] / 1e9, 2)
        assert float(row[9]) == round(pcie["host_to_device"] / 1e9, 1)
        assert float(row[10]) == round(pcie["device_to_host"] / 1e9, 1)
    # without the flags: no offload block, no offload keys
    plain = vescale(*common, "--json")
    plain_est = json.loads(plain.stdout)
    assert "offload_optimizer" not in plain_est["memory_setup"]
    assert "pcie" not in plain_est["traffic"] and "host" not in plain_est["memory"]["ours"]
    assert "offload:" not in vescale(*common).stdout


# --------------------------------------------------------------------------------------------
# The output explains itself: FSDP2's and ZeRO-3's figures that ignore the block constraint are
# marked, with what they would pad keeping blocks whole; a plan padding over 25% warns.

# Hand-computable: a [256, 4] and d [128, 4] at 3 ranks, rows:128 (blocks of 128 rows = 512
# elements; 1,536 elements in all). Ours: S = 512, a's two blocks on ranks 0 and 1, d on rank 2:
# no padding. FSDP2: dim-0 chunks of 86 and 43 rows (258 + 129 rows stored: 3 + 1 padded rows,
# 12 elements, 0.78%), which cut the blocks; whole, each chunk rounded up to 128 rows: 384 rows
# of a, 384 of d, 2 x 256 padded rows = 1,536 elements, 100%. ZeRO-3: pieces of 342 and 171
# elements (2 + 1 padded, 0.20%), cutting blocks; whole, pieces of 512: 1,536 padded, 100%.
# rows:1: FSDP2's chunks are whole rows (no mark); ZeRO-3's pieces of 342 and 171 elements cut
# rows of 4: whole, 344 and 172: 8 + 4 = 12 padded (0.78%).
HAND = {"name": "hand", "groups": [{"name": "g", "tensors": [
    {"name": "a", "shape": [256, 4]}, {"name": "d", "shape": [128, 4]}]}]}


@pytest.fixture
def hand(tmp_path):
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(HAND))
    return str(path)


def test_alternatives_marked_with_whole_block_figures(hand):
    out = vescale("plan", "--shapes", hand, "--world-size", "3", "--granularity",
                  "rows:1,rows:128")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith("rows:")}
    # ours, then FSDP2 / whole / ZeRO-3 / whole (the mark follows a figure that cuts blocks)
    assert rows["rows:128"][2] == "0.00%"
    assert rows["rows:128"][7:11] == ["0.78%*", "100.00%", "0.20%*", "100.00%"]
    assert rows["rows:1"][7:11] == ["0.78%", "0.78%", "0.20%*", "0.78%"]
    lines = out.stdout.splitlines()
    foot = lines.index(next(line for line in lines if line.startswith("* ")))
    assert foot == len(lines) - 1 and lines[foot - 1].startswith("rows:128")
    assert "ignores the block constraint" in lines[foot] and "whole:" in lines[foot]
    detail = vescale("plan", "--shapes", hand, "--world-size", "3", "--granularity", "rows:128")
    assert ("(FSDP2 0.781%*, whole blocks 100.000%; ZeRO-3 0.195%*, whole blocks 100.000%)"
            in detail.stdout), detail.stdout
    assert "* ignores the block constraint" in detail.stdout
    data = json.loads(vescale("plan", "--shapes", hand, "--world-size", "3", "--granularity",
                              "rows:128", "--json").stdout)
    assert data["alternatives"]["fsdp2"] == {
        "padding_ratio": 12 / 1536, "ignores_blocks": True, "first_cut_tensor": "g/a",
        "whole_blocks_padding_ratio": 1.0}
    assert data["alternatives"]["zero3"] == {
        "padding_ratio": 3 / 1536, "ignores_blocks": True, "first_cut_tensor": "g/a",
        "whole_blocks_padding_ratio": 1.0}
    assert data["padding_ratio"] == 0 and data["warnings"] == []
    rows1 = json.loads(vescale("plan", "--shapes", hand, "--world-size", "3", "--json").stdout)
    assert rows1["alternatives"]["fsdp2"]["ignores_blocks"] is False
    assert rows1["alternatives"]["zero3"]["whole_blocks_padding_ratio"] == 12 / 1536


def test_alternatives_are_their_own_figures_without_blocks():
    """The whole-blocks figures come from the same loops as the figures the table always had:
    with element blocks they are those figures, unmarked."""
    from vescale_engine.plan import model_plan as mp
    model = mp.load_shapes(f"{MODELS}/deepseek-v3.json")
    plan = mp.plan_model(model, 1024, "element")
    fsdp2, zero3 = mp.alternatives(plan)
    assert fsdp2.padding_ratio == fsdp2.whole_blocks_padding_ratio == \
        mp.fsdp2_padding_ratio(model, 1024) > 0
    assert zero3.padding_ratio == zero3.whole_blocks_padding_ratio == \
        mp.zero3_padding_ratio(model, 1024) > 0
    assert not fsdp2.ignores_blocks and not zero3.ignores_blocks


LLAMA_WARNING = ("warning: rows:128 at 512 ranks pads 237.86% of the parameters (over 25%: its "
                 "blocks are large next to a rank's share of a unit); what helps: a finer "
                 "granularity (rows:32 pads 9.58%), fewer ranks per shard group (128 ranks x 4 "
                 "HSDP replicas pad 9.58%: --world-size 128, or --memory --hsdp 4); no help: "
                 "more buffers (--max-buffers 16 pads 237.86%)")


def test_padding_over_a_quarter_warns_with_what_helps():
    """Llama-3-70B at rows:128 on 512 ranks: a down_proj block (128 x 28,672 elements) is
    larger than a rank's share of a layer; rows:32 and 128-rank shard groups bring it under
    25%, more buffers do not. One line on stderr (a sweep: one per such row); --json lists it."""
    common = ("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--granularity", "rows:128")
    out = vescale(*common, "--world-size", "512")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [LLAMA_WARNING]
    assert "padding 237.857%" in out.stdout
    data = json.loads(vescale(*common, "--world-size", "512", "--json").stdout)
    assert data["warnings"] == [LLAMA_WARNING]
    # what the warning says, checked: the remedies' own plans
    for args, padding in ((("--granularity", "rows:32", "--world-size", "512"), 0.0958),
                          (("--world-size", "128"), 0.0958),
                          (("--world-size", "512", "--max-buffers", "16"), 2.3786)):
        plan = json.loads(vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json",
                                  "--granularity", "rows:128", *args, "--json").stdout)
        assert plan["padding_ratio"] == pytest.approx(padding, abs=1e-4)
    sweep = vescale(*common, "--world-size", "64,256,512")   # 1.97%, 100.89%, 237.86%
    lines = sweep.stderr.splitlines()
    assert len(lines) == 2 and lines[1] == LLAMA_WARNING, sweep.stderr
    assert lines[0].startswith("warning: rows:128 at 256 ranks pads 100.89%")


def test_low_padding_does_not_warn():
    out = vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size", "64,512",
                  "--granularity", "rows:16")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    data = json.loads(vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size",
                              "512", "--granularity", "rows:16", "--json").stdout)
    assert data["padding_ratio"] < 0.25 and data["warnings"] == []


@pytest.mark.parametrize("args,message", [
    (["--seq", "4096"], "--seq needs --memory"),
    (["--memory", "--sp", "2"], "--sp needs --seq"),
    (["--memory", "--seq", "4096", "--sp", "3"], "--sp 3 does not divide the world size 8"),
    (["--memory", "--seq", "4097", "--sp", "2"], "--seq 4097 does not split over --sp 2"),
    (["--memory", "--seq", "4096", "--sp", "2", "--tp", "2"], "--sp 2 with --tp/--ep"),
    (["--memory", "--seq", "0"], "--seq"),
])
def test_sequence_flag_errors(args, message):
    out = vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size", "8", *args)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_sequence_flags_refuse_a_model_that_is_not_a_dense_decoder():
    out = vescale("plan", "--shapes", f"{MODELS}/deepseek-v3.json", "--world-size", "64",
                  "--memory", "--seq", "4096")
    assert out.returncode == 2 and "needs a dense Llama-style decoder" in out.stderr, out.stderr


def test_activations_and_the_longest_sequence_per_system():
    """Activations per rank at sp 8 are 1/8 of FSDP2's (one copy of the attention output
    more per layer), and the longest sequence follows what each system leaves free."""
    from vescale_engine.plan import model_plan
    from vescale_engine.plan.activations import DecoderDims, activation_bytes, longest_sequence
    out = vescale("plan", "--shapes", f"{MODELS}/llama3-70b.json", "--world-size", "64",
                  "--memory", "--seq", "131072", "--sp", "8", "--device-memory", "141",
                  "--activation-checkpointing", "--tiled-mlp", "--tiled-loss")
    assert out.returncode == 0, out.stderr
    dims = DecoderDims.from_shapes(model_plan.load_shapes(f"{MODELS}/llama3-70b.json"))
    options = dict(checkpointing=True, tiled_mlp=True, tiled_loss=True)
    ours = activation_bytes(dims, 131072, sp=8, **options)
    fsdp2 = activation_bytes(dims, 131072, sp=1, **options)
    assert 1 / 8 < ours / fsdp2 < 1.02 / 8
    lines = out.stdout.splitlines()
    row = next(line for line in lines if line.strip().startswith("ours, sp 8"))
    assert f"{ours / 1e9:.2f}" in row
    longest = next(line for line in lines if line.startswith("longest sequence in 141 GB"))
    parts = longest.split(": ", 1)[1].removesuffix(" (tokens)").split("; ")
    fits = [int(part.rsplit(" ", 1)[1].replace(",", "")) for part in parts]
    assert fits[0] % 8 == 0 and fits[0] > 4 * fits[2] and abs(fits[0] - fits[1]) < fits[0] / 10
    assert longest_sequence(dims, 141e9, sp=8, **options) > fits[0]  # the model state is room
