"""`vescale plan --time` against numbers nobody here made, each with its source and tolerance.
What the model does not reproduce is said where it is checked (and in
docs/capacity_planning.md), not hidden. Torch-free."""
import importlib.util
import json
import os
import re

import pytest

from vescale_engine.plan.capacity import Setup, estimate
from vescale_engine.plan.model_plan import load_shapes
from vescale_engine.plan.step_time import Group, collective_time, copy_time, load_cluster
from vescale_engine.plan.step_time.report import Workload, predict
from vescale_engine.plan.step_time.schedule import build_schedule

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
MODELS = os.path.join(ROOT, "examples", "models")
_spec = importlib.util.spec_from_file_location(
    "step_time_check", os.path.join(ROOT, "benchmarks", "step_time_check.py"))
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def shapes(name):
    return load_shapes(os.path.join(MODELS, f"{name}.json"))


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100")


# pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (torch, torchao and
# torchtitan of 2024-12-23/26): Llama 3.1 8B, FSDP (torch's fully_shard), local batch 2 of
# 8,192 tokens, selective activation checkpointing, no torch.compile, bf16 parameters and fp32
# reductions (torchtitan's default mixed precision), on Grand Teton hosts of 8 H100 (96 GB
# HBM2e, 500 W) with 400 Gb/s per GPU between hosts. Table 1: 8 GPUs; Table 3: 128 GPUs.
TORCHTITAN_8B = {8: 5762, 128: 5605}
TORCHTITAN_WORK = Workload(seq_len=8192, micro_batch=2, checkpointing="selective")


def test_torchtitan_llama_3_1_8b_fsdp_on_8_and_128_h100(h100):
    """FSDP2's predicted tokens/s per GPU within 15% of torchtitan's at 8 and at 128 GPUs.
    The 8-GPU row is the calibration point of the shipped cluster's efficiencies (their source
    says so): there it guards the calibration; the 128-GPU row is a prediction (+3% here).
    Not reproduced: the 2.7% drop from 8 to 128 GPUs. The model predicts the two within 1% of
    each other, the 128-GPU run slightly faster (its optimizer step updates a 16x smaller shard,
    which outweighs the slower collectives, all but the first and last hidden behind compute):
    the measured drop is mostly what the model leaves out (stragglers and jitter over 16 hosts,
    the fabric's congestion; one sample at iteration 90)."""
    got = {W: predict("fsdp2", shapes("llama-3.1-8b"), Setup(world_size=W, reduce_dtype="fp32"),
                      h100, TORCHTITAN_WORK)["tokens_per_s_per_gpu"] for W in TORCHTITAN_8B}
    for W, published in TORCHTITAN_8B.items():
        assert abs(got[W] / published - 1) <= 0.15, (W, got[W], published)
    assert abs(got[128] / got[8] - 1) < 0.01, got   # near-flat, as measured (-2.7%)


def test_torchtitans_mfu_is_the_models(h100):
    """torchtitan's README: 33% to 39% MFU for the 1D 8B runs (SXM peak; 39% without compile
    by its footnote's reading, 33% ...): the prediction's MFU, by the same definition, lies in
    that range at both sizes."""
    for W in TORCHTITAN_8B:
        mfu = predict("fsdp2", shapes("llama-3.1-8b"), Setup(world_size=W, reduce_dtype="fp32"),
                      h100, TORCHTITAN_WORK)["mfu"]
        assert 0.33 <= mfu <= 0.39, (W, mfu)


# The paper (veScale-FSDP, arXiv 2602.22437): at 1,024 GPUs veScale-FSDP's throughput is +5%
# over FSDP2 on LLaMA-3-70B and up to +66% on MoE models; FSDP2 runs out of memory on
# GPT-OSS-120B at 256 GPUs (its 128 experts over 256 ranks pad the all-gather to 2x).
PAPER_WORK = Workload(seq_len=4096, micro_batch=2, checkpointing="full")


def test_paper_dense_gain_at_1024_gpus(h100):
    """LLaMA-3-70B at 1,024 GPUs: ours ahead of FSDP2 by 1% to 10% (the paper: +5%); here the
    whole gain is FSDP2's copy-out and copy-in (3% of its step), the collectives hidden in both."""
    r = {s: predict(s, shapes("llama3-70b"), Setup(world_size=1024, reduce_dtype="fp32"), h100,
                    PAPER_WORK) for s in ("ours", "fsdp2")}
    gain = r["ours"]["tokens_per_s_per_gpu"] / r["fsdp2"]["tokens_per_s_per_gpu"] - 1
    assert 0.01 <= gain <= 0.10, gain
    assert r["fsdp2"]["copies_share"] == pytest.approx(gain, abs=0.01)


def test_paper_moe_gains_exceed_the_dense_one_at_1024_gpus(h100):
    """MoE at 1,024 GPUs, ours against FSDP2 (the paper: up to +66%, against +5% dense).
    GPT-OSS-120B: ours ahead far beyond 66% (FSDP2 pads its 128-expert stacks' dim 0 to 1,024
    rows: 8x the gathered bytes, the cause of the paper's OOM at 256). DeepSeek-V3, 4 x 4,096
    tokens per rank: ours ahead by more than on the dense model and by at least 10% (FSDP2's
    copies of 256 experts' tensors). Not reproduced: at 2 x 4,096 tokens per rank the model
    puts ours 6% behind FSDP2 on DeepSeek-V3, communication-bound, because ours issues one
    collective per buffer (up to --max-buffers per unit, three for these layers) and each pays
    the ring's latency over 1,024 ranks (~5 ms), where FSDP2 issues one per unit."""
    def gain(name, work):
        r = {s: predict(s, shapes(name), Setup(world_size=1024, reduce_dtype="fp32"), h100,
                        work)["tokens_per_s_per_gpu"] for s in ("ours", "fsdp2")}
        return r["ours"] / r["fsdp2"] - 1
    dense = gain("llama3-70b", PAPER_WORK)
    assert gain("gpt-oss-120b", PAPER_WORK) > 0.66
    larger = Workload(seq_len=4096, micro_batch=4, checkpointing="full")
    assert gain("deepseek-v3", larger) >= max(0.10, dense)
    assert gain("deepseek-v3", PAPER_WORK) < 0   # the disagreement above, pinned


def test_paper_fsdp2_out_of_memory_on_gpt_oss_at_256_gpus():
    """GPT-OSS-120B at 256 GPUs: FSDP2's gathered parameters are about twice ours (the
    paper's cause of its OOM), ours fits the same device with room for activations."""
    est = estimate(shapes("gpt-oss-120b"), Setup(world_size=256))
    ours, fsdp2 = est["memory"]["ours"], est["memory"]["fsdp2"]
    assert 1.7 <= fsdp2["gathered_peak"] / ours["gathered_peak"] <= 2.1
    assert fsdp2["total"] > 1.8 * ours["total"]


# The paper, GPT-OSS-120B on 64 GPUs with FSDP2 (Shard(0)), per decoder layer (one FSDP unit:
# the copies match a layer's 6.4 GB, not a step's): all-gather 43.7 ms and copy-out 5.2 ms,
# reduce-scatter 94.2 ms and copy-in 12.4 ms. The paper does not say its network.
PAPER_GPT_OSS_64 = {"all_gather": 43.7e-3, "reduce_scatter": 94.2e-3, "copy_out": 5.2e-3,
                    "copy_in": 12.4e-3}


def test_paper_gpt_oss_collectives_and_copies_at_64_gpus(h100):
    """What the shipped H100 cluster can check of the paper's per-layer figures: the
    reduce-scatter's time over the all-gather's (2.16 in the paper: fp32 gradients against
    bf16 weights, 2x the bytes) within 25%, and FSDP2's copy-out (HBM bandwidth) within 25%.
    Not reproduced, because the clusters differ: the absolute collective times (17 and 34 ms
    here, 2.5x faster: 8 x 400 Gb/s per node give each GPU ~370 GB/s busbw across nodes; the
    paper's figures imply ~150 GB/s), and the copy-in (9.0 ms here, -27%: FSDP2's chunk_cat into
    the fp32 reduce buffer runs below a copy's bandwidth)."""
    m = shapes("gpt-oss-120b")
    layer = next(t for t in build_schedule("fsdp2", m, Setup(world_size=64, reduce_dtype="fp32"),
                                           4096).tasks
                 if t.unit == "layers" and t.phase == "backward")
    group = Group.packed(64, h100.gpus_per_node)
    ag = collective_time("all_gather", layer.gathers[0].nbytes, group, h100)
    rs = collective_time("reduce_scatter", layer.reduces[0].nbytes, group, h100)
    paper = PAPER_GPT_OSS_64
    ratio = paper["reduce_scatter"] / paper["all_gather"]
    assert abs((rs / ag) / ratio - 1) <= 0.25, (rs / ag, ratio)
    copy_out = copy_time(layer.copy_before, h100)
    assert abs(copy_out / paper["copy_out"] - 1) <= 0.25, copy_out
    assert 6.0e9 < layer.gathers[0].nbytes < 7.0e9   # a layer's bf16 weights: ~6.4 GB


def test_our_own_h200_run_at_world_size_1():
    """benchmarks/results/gpu_check_cuda/gpu_step_time_cuda.md, the GPU check's step-time
    part on one H200 (2026-11-30, torch 2.11): ours 0.1078 s, FSDP2 0.1089 s per step of
    gpu_step_time.py's 974M-parameter GPT (8 x 1,024 tokens, bf16, fp32 reduction). Ours is
    the h200 file's calibration point (within 2%); FSDP2's is a prediction (within 10%: its
    copy-out and copy-in, and torch's fused AdamW, against ours)."""
    with open(os.path.join(ROOT, "benchmarks", "results", "gpu_check_cuda",
                           "gpu_step_time_cuda.md")) as f:
        text = f.read()
    dims = re.search(r"(\d+) blocks, width (\d+), vocab (\d+)\), batch (\d+) x (\d+)", text)
    layers, dim, vocab, batch, seq = map(int, dims.groups())
    measured = {"layers": layers, "dim": dim, "vocab": vocab, "seq": seq, "batch": batch,
                "step_s": {label: float(re.search(rf"\| {label} \| ([0-9.]+) \|", text).group(1))
                           for label in check.SYSTEMS}}
    predicted = check.predict(measured, "h200")
    assert abs(predicted["veScale"][0] / measured["step_s"]["veScale"] - 1) <= 0.02
    assert abs(predicted["FSDP2"][0] / measured["step_s"]["FSDP2"] - 1) <= 0.10


def _gloo_check(results: str) -> tuple:
    """(the benchmark module, its committed result, {system: re-predicted seconds})."""
    spec = importlib.util.spec_from_file_location(
        "step_time_gloo", os.path.join(ROOT, "benchmarks", "step_time_gloo.py"))
    gloo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gloo)
    with open(os.path.join(ROOT, "benchmarks", "results", results)) as f:
        result = json.load(f)
    predicted = {}
    for system, name in (("vescale", "ours"), ("fsdp2", "fsdp2")):
        predicted[system] = gloo.predict(result["cluster"], result["gpt"], result["world"], name)
        assert predicted[system] == pytest.approx(result["predicted_s"][system], rel=1e-9)
    return gloo, result, predicted


def test_this_machine_on_gloo():
    """benchmarks/results/step_time_gloo.json: the model calibrated on this machine (gloo's
    measured per-message cost and bandwidth, copy bandwidth, and one rank's compute measured
    without communication by as many processes at once as there are ranks) predicts ours' and
    FSDP2's measured 2-rank steps of fsdp_step_time.py's GPT within 15%. Re-predicted here from
    the committed calibration, so a change to the model that breaks the agreement fails this
    test; the measurement itself is the benchmark's (`python benchmarks/step_time_gloo.py`)."""
    gloo, result, predicted = _gloo_check("step_time_gloo.json")
    assert result["world"] == 2
    for system in ("vescale", "fsdp2"):
        assert abs(predicted[system] / result["measured_s"][system] - 1) <= gloo.TOLERANCE, \
            system


def test_this_machine_at_4_ranks():
    """benchmarks/results/step_time_gloo_4.json (`--world 4`: 4 ranks on 2 cores, the floor
    measured by 4 processes at once): ours within 15%. FSDP2's step is 18% over the
    prediction there, outside the issue's 15% (and 13% at 2 ranks): on CPU it costs more than
    its collectives and copies, which is all the model gives it (docs/capacity_planning.md);
    re-predicted here so that the committed figures stay the model's."""
    gloo, result, predicted = _gloo_check("step_time_gloo_4.json")
    assert result["world"] == 4
    assert abs(predicted["vescale"] / result["measured_s"]["vescale"] - 1) <= gloo.TOLERANCE
    assert predicted["fsdp2"] < result["measured_s"]["fsdp2"]
