"""The step-time cost model's pieces (vescale_engine/plan/step_time): the cluster loader's
refusals, collective times against hand-computed alpha-beta values and published NCCL numbers,
and FLOPs against torchtitan's formula and published active-parameter counts. Torch-free."""
import copy
import json
import math
import os

import pytest

from vescale_engine.plan.model_plan import ShapesError, load_shapes
from vescale_engine.plan.step_time import (ClusterError, Group, active_params, bus_bandwidth,
                                           collective_time, copy_time, group_flops,
                                           load_cluster, model_flops_per_token, unit_flops,
                                           unit_time)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
MODELS = os.path.join(ROOT, "examples", "models")
GB = 1e9


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100")


def shapes(name):
    return load_shapes(os.path.join(MODELS, f"{name}.json"))


# ---------------------------------------------------------------------------------------------
# cluster.py

def _write(tmp_path, data, name="c.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def _shipped(name="h100"):
    with open(os.path.join(ROOT, "vescale_engine", "plan", "step_time", "clusters",
                           f"{name}.json")) as f:
        return json.load(f)


def test_shipped_clusters_match_the_datasheets():
    h100, h200 = load_cluster("h100"), load_cluster("h200")
    assert h100.device.bf16_flops == h200.device.bf16_flops == 989e12
    assert (h100.device.memory_bandwidth, h200.device.memory_bandwidth) == (3.35e12, 4.8e12)
    assert h100.intra_node.bandwidth == 450e9 and h100.inter_node.bandwidth == 50e9
    assert h100.gpus_per_node == 8 and h200.device.memory_bytes > 1.7 * h100.device.memory_bytes


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_every_shipped_number_has_a_source(name):
    def walk(node, where):
        for key, value in node.items():
            if isinstance(value, dict) and "value" in value:
                assert isinstance(value.get("source"), str) and len(value["source"]) > 20, \
                    f"{where}{key}"
            elif isinstance(value, dict):
                walk(value, f"{where}{key}.")
            else:
                assert not isinstance(value, (int, float)), f"{where}{key}: a bare number"
    walk(_shipped(name), "")


def test_a_path_and_bare_numbers_load(tmp_path):
    data = _shipped()
    data["device"]["bf16_flops"] = 1e15
    cluster = load_cluster(_write(tmp_path, data))
    assert cluster.device.bf16_flops == 1e15 and cluster.name == "h100"


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["device"].pop("memory_bandwidth"), "device.memory_bandwidth: missing"),
    (lambda d: d["inter_node"]["bandwidth"].update(value=0), "inter_node.bandwidth: must be a "
                                                             "positive number"),
    (lambda d: d["intra_node"].update(latency=-1e-6), "intra_node.latency: must be a positive"),
    (lambda d: d["device"].update(matmul_efficiency=1.5), "device.matmul_efficiency: a fraction"),
    (lambda d: d.update(gpus_per_node=7.5), "gpus_per_node: must be an integer"),
    (lambda d: d.pop("intra_node"), "intra_node: missing or not an object"),
    (lambda d: d["device"].update(bf16_flops="989e12"), "device.bf16_flops: must be a positive"),
    (lambda d: d["device"].update(attention_efficiency=True), "device.attention_efficiency"),
    (lambda d: d.update(protocols=["Simple", "ring"]), "protocols: a non-empty list"),
    (lambda d: d.update(protocols=[]), "protocols: a non-empty list"),
    (lambda d: d.update(overlap="no"), "overlap: must be true or false"),
])
def test_cluster_refusals_name_the_file_and_field(tmp_path, edit, field):
    data = copy.deepcopy(_shipped())
    edit(data)
    path = _write(tmp_path, data)
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    message = str(err.value)
    assert message.startswith(path) and field in message and "\n" not in message


def test_protocols_and_overlap_are_optional_and_read(tmp_path):
    """Shipped clusters: NCCL's three protocols, collectives beside compute; a gloo-like file
    narrows the protocols (only Simple's latency and bandwidth) and turns overlap off."""
    shipped = load_cluster("h100")
    assert shipped.protocols == ("LL", "LL128", "Simple") and shipped.overlap
    data = copy.deepcopy(_shipped())
    data.update(protocols=["Simple"], overlap=False)
    cpu = load_cluster(_write(tmp_path, data))
    assert cpu.protocols == ("Simple",) and not cpu.overlap
    small = 64 * 1024   # LL's lower latency wins at small messages, when allowed
    g = Group(8, 8)
    assert collective_time("all_gather", small, g, cpu) > collective_time("all_gather", small,
                                                                         g, shipped)


def test_cluster_refuses_unknown_names_and_bad_json(tmp_path):
    with pytest.raises(ClusterError, match="unknown cluster.*h100, h200"):
        load_cluster("a100")
    with pytest.raises(ClusterError, match="no such file"):
        load_cluster(str(tmp_path / "missing.json"))
    with pytest.raises(ClusterError, match="not valid JSON"):
        load_cluster(_write(tmp_path, "{\"name\": "))


# ---------------------------------------------------------------------------------------------
# collectives.py

def test_all_gather_in_one_node_is_the_ring_alpha_beta_by_hand(h100):
    # 8 GPUs, 1 GB, Simple protocol: base 8.4 us + 7 NVLink steps of 3.4 us, and 7/8 of the
    # buffer at busbw = 450 GB/s x 370/450 = 370 GB/s
    expected = 8.4e-6 + 7 * 3.4e-6 + 7 / 8 * 1e9 / 370e9
    assert collective_time("all_gather", 1e9, Group(8, 8), h100) == pytest.approx(expected, 1e-9)
    assert collective_time("reduce_scatter", 1e9, Group(8, 8), h100) == \
        pytest.approx(expected, 1e-9)


def test_all_gather_across_nodes_by_hand(h100):
    # 64 GPUs on 8 nodes: 56 NVLink steps, 7 network steps of 14 us; busbw min(370, 8 x 47)
    expected = 8.4e-6 + 56 * 3.4e-6 + 7 * 14e-6 + 63 / 64 * 1e9 / 370e9
    assert collective_time("all_gather", 1e9, Group(64, 8), h100) == \
        pytest.approx(expected, 1e-9)
    # one GPU on each of 8 nodes: its own NIC, 47 GB/s
    expected = 8.4e-6 + 7 * 14e-6 + 7 / 8 * 1e9 / 47e9
    assert collective_time("all_gather", 1e9, Group(8, 1), h100) == pytest.approx(expected, 1e-9)


def test_all_reduce_picks_the_faster_of_ring_and_tree(h100):
    two_nodes, many = Group(16, 8), Group(1024, 8)
    big, small = 4e9, 1024
    ring_big, tree_big = (collective_time("all_reduce", big, two_nodes, h100, a)
                          for a in ("ring", "tree"))
    assert ring_big < tree_big   # bandwidth: the ring's busbw vs the tree's 0.92 of it
    ring_small, tree_small = (collective_time("all_reduce", small, many, h100, a)
                              for a in ("ring", "tree"))
    assert tree_small < ring_small / 10   # latency: log2(nodes) steps vs 2 x ranks steps
    assert collective_time("all_reduce", big, two_nodes, h100) == ring_big
    assert collective_time("all_reduce", small, many, h100) == tree_small
    # at 1024 ranks the ring's 2 x 1023 step latencies (~6.6 ms) outweigh the tree's bandwidth
    # loss even at 4 GB, as NCCL's tuner also finds: the tree wins
    assert collective_time("all_reduce", big, many, h100) == \
        collective_time("all_reduce", big, many, h100, "tree")
    # ring all_reduce in a node: 2 x 7 NVLink steps and twice an all_gather's bytes
    ring_8 = collective_time("all_reduce", 8e9, Group(8, 8), h100, "ring")
    assert ring_8 == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * 8e9 / 370e9, rel=1e-9)


def _busbw(kind, nbytes, group, cluster):
    """nccl-tests' busbw of the modelled time (its README: algbw x (n-1)/n, all_reduce x 2)."""
    factor = (2 if kind == "all_reduce" else 1) * (group.size - 1) / group.size
    return nbytes / collective_time(kind, nbytes, group, cluster) * factor


def test_against_published_nccl_numbers(h100):
    # Single DGX H100, large messages, non-SHARP: "NCCL can get an effective NVLink bandwidth of
    # 370GB/s, which you can observe as BusBw when running non-allreduce operations, or when
    # running with NCCL_ALGO=RING" (NCCL's sjeaugey, github.com/NVIDIA/nccl-tests/issues/212).
    # Tolerance 5%: the model's 8 GB point must sit at that plateau.
    assert _busbw("all_gather", 8 * GB, Group(8, 8), h100) == pytest.approx(370e9, rel=0.05)
    assert _busbw("reduce_scatter", 8 * GB, Group(8, 8), h100) == \
        pytest.approx(370e9, rel=0.05)
    # NDR 400 Gb/s: "you should see 46-48GB/s per NIC" (NVIDIA's AddyLaddy,
    # github.com/NVIDIA/nccl-tests/issues/290): one GPU per node rides its own NIC.
    assert 44e9 <= _busbw("all_gather", 8 * GB, Group(16, 1), h100) <= 48e9
    # 32 DGX H100 nodes (256 GPUs, 8x 400 Gb/s), 2 GB: all_reduce ~340 GB/s busbw
    # (github.com/NVIDIA/nccl/issues/1218). Tolerance 15%. (Its all_gather, ~200 GB/s, is below
    # this model's ~310: congestion at scale is left out, collectives.py says so.)
    assert _busbw("all_reduce", 2 * 2**30, Group(256, 8), h100) == \
        pytest.approx(340e9, rel=0.15)


def test_full_nodes_keep_most_of_nvlink_busbw_across_nodes(h100):
    # eight rings leave each node through eight NICs: ~8 x 47 GB/s, capped by NVLink's 370
    assert bus_bandwidth(Group(64, 8), h100) == pytest.approx(370e9)
    assert bus_bandwidth(Group(64, 2), h100) == pytest.approx(2 * 47e9)
    assert bus_bandwidth(Group(64, 1), h100) == pytest.approx(47e9)


KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
SIZES = [0, 1, 1024, 65536, 2**20, 2**24, 2**27, 2**30, 2**33]


@pytest.mark.parametrize("kind", KINDS)
def test_more_bytes_are_never_faster(h100, kind):
    for group in (Group(8, 8), Group(16, 8), Group(64, 8), Group(8192, 8), Group(4, 1),
                  Group(2, 2)):
        times = [collective_time(kind, n, group, h100) for n in SIZES]
        assert times == sorted(times), (kind, group)
        assert times[-1] > times[0]


@pytest.mark.parametrize("kind", KINDS)
def test_crossing_nodes_is_never_faster(h100, kind):
    for size in (8, 16, 64):
        for nbytes in SIZES[1:]:
            # the same ranks spread over more nodes: per_node 8 (as few nodes as possible) down
            # to 1 (one per node)
            per_node = [k for k in (8, 4, 2, 1) if size % k == 0]
            times = [collective_time(kind, nbytes, Group(size, k), h100) for k in per_node]
            assert times == sorted(times), (kind, size, nbytes, times)
            assert times[-1] > times[0]


def test_more_ranks_take_longer_per_rank_buffer(h100):
    # the same bytes per rank (an FSDP shard) over more ranks: never faster
    shard = 2**24
    times = [collective_time("all_gather", shard * n, Group.packed(n, 8), h100)
             for n in (8, 16, 64, 512, 8192)]
    assert times == sorted(times)


def test_collective_refusals(h100):
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("gather", 1, Group(8, 8), h100)
    with pytest.raises(ValueError, match="ring"):
        collective_time("all_gather", 1, Group(8, 8), h100, "tree")
    with pytest.raises(ValueError, match="9 ranks per node"):
        collective_time("all_gather", 1, Group(18, 9), h100)
    with pytest.raises(ValueError, match="per_node must divide"):
        Group(12, 8)
    with pytest.raises(ValueError, match="whole nodes"):
        Group.packed(12, 8)
    assert collective_time("all_reduce", 1e9, Group(1, 1), h100) == 0.0


def test_all_to_all_across_nodes_rides_the_nic(h100):
    # 64 ranks on 8 nodes, 1 GB per rank: 56/64 of it leaves the node through the rank's NIC
    t = collective_time("all_to_all", 1e9, Group(64, 8), h100)
    assert t == pytest.approx(8.4e-6 + 14e-6 + 56 / 64 * 1e9 / 47e9, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# compute.py

def test_llama_8b_flops_match_torchtitans_formula():
    # torchtitan: 6 * (params - embedding params) + 12 * L * H * Q * T, from the published config
    # (hidden 4096, 32 layers, 32 heads, 8 kv heads, head_dim 128, FFN 14336, vocab 128256)
    h, f, L, V, kv, H, Q = 4096, 14336, 32, 128256, 1024, 32, 128
    layer = 2 * h * h + 2 * kv * h + 3 * h * f + 2 * h
    n_params = L * layer + h + 2 * V * h
    assert n_params == 8_030_261_248          # Llama-3.1-8B's published parameter count
    N = n_params - V * h                       # torchtitan leaves out the embedding, not the head
    model = shapes("llama-3.1-8b")
    assert active_params(model) == N
    for T in (2048, 8192):
        assert model_flops_per_token(model, T) == pytest.approx(6 * N + 12 * L * H * Q * T,
                                                                rel=1e-12)


def test_llama_8b_is_near_the_6n_rule():
    # 6N (N: all parameters) is the usual rule; at short sequences attention adds little and the
    # embedding lookup is not a matmul: within 2% at T = 2048, and attention is 22% at T = 8192
    model = shapes("llama-3.1-8b")
    six_n = 6 * model.numel
    assert model_flops_per_token(model, 2048) == pytest.approx(six_n, rel=0.02)
    assert model_flops_per_token(model, 8192) / six_n == pytest.approx(1.20, abs=0.02)


@pytest.mark.parametrize("name, published, band", [
    # "5.1B active parameters per token" (OpenAI, gpt-oss model card), with the unembedding
    ("gpt-oss-120b", 5.1e9, 0.03),
    # "671B total parameters with 37B activated for each token" (DeepSeek-V3 technical report);
    # 37B counts the embedding too (0.93B), which torchtitan's N leaves out: 5%
    ("deepseek-v3", 37e9, 0.05),
    # "32 billion activated parameters" (Kimi K2, moonshotai/Kimi-K2 README)
    ("kimi-k2", 32e9, 0.05),
])
def test_moe_active_parameters(name, published, band):
    model = shapes(name)
    assert active_params(model) == pytest.approx(published, rel=band)
    assert active_params(model) < model.numel / 10   # experts count at top_k / n_experts


def test_moe_model_flops_count_only_the_routed_experts():
    model = shapes("gpt-oss-120b")
    layer = next(g for g in group_flops(model, 4096) if g.name == "layers")
    experts = sum(math.prod(s) for n, s in model.groups[1].tensors if ".experts." in n)
    dense = sum(math.prod(s) for n, s in model.groups[1].tensors if ".experts." not in n)
    assert layer.params == pytest.approx(dense + experts * 4 / 128)
    assert layer.attention == 2 * 4096 * 64 * (64 + 64)


def test_mla_attention_uses_both_head_dims():
    layer = next(g for g in group_flops(shapes("deepseek-v3"), 4096) if g.layer)
    assert layer.attention == 2 * 4096 * 128 * (192 + 128)


def test_executed_flops_and_checkpointing():
    g = next(g for g in group_flops(shapes("llama-3.1-8b"), 8192) if g.name == "layers")
    fwd, bwd = unit_flops(g, "none")
    assert (fwd.matmul, fwd.attention) == (g.matmul, g.attention / 2)   # causal: halved
    assert (bwd.matmul, bwd.attention) == (2 * g.matmul, 2.5 * g.attention / 2)
    _, full = unit_flops(g, "full")
    assert full.total == pytest.approx(bwd.total + fwd.total)
    _, sel = unit_flops(g, "selective")
    assert sel.matmul == pytest.approx(2.5 * g.matmul) and sel.attention == bwd.attention
    assert bwd.total < sel.total < full.total
    head = next(g for g in group_flops(shapes("llama-3.1-8b"), 8192) if g.name == "head")
    assert unit_flops(head, "full") == unit_flops(head, "none")   # the head is not checkpointed
    assert unit_flops(g, causal=False)[0].attention == g.attention
    with pytest.raises(ValueError, match="checkpointing"):
        unit_flops(g, "some")


def test_unit_time_and_copy_time(h100):
    g = next(g for g in group_flops(shapes("llama-3.1-8b"), 8192) if g.name == "layers")
    fwd, _ = unit_time(g, 8192, h100)
    d = h100.device
    by_hand = 8192 * (g.matmul / (989e12 * d.matmul_efficiency)
                      + g.attention / 2 / (989e12 * d.attention_efficiency))
    assert fwd == pytest.approx(by_hand, rel=1e-12)
    # 1 GB copied: read + write at 85% of 3.35 TB/s
    assert copy_time(1e9, h100) == pytest.approx(2e9 / (3.35e12 * 0.85))


def _with_architecture(tmp_path, arch, name="llama-3.1-8b"):
    with open(os.path.join(MODELS, f"{name}.json")) as f:
        data = json.load(f)
    if arch is None:
        data.pop("architecture")
    else:
        data["architecture"] = arch
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    return str(path)


GOOD = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "vocab": 128256}


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.pop("heads"), "architecture.heads: missing"),
    (lambda a: a.update(layers=0), "architecture.layers: must be an integer >= 1"),
    (lambda a: a.update(kv_heads=5), "architecture.kv_heads: 5 does not divide heads 32"),
    (lambda a: a.update(experts=8), "architecture.experts_per_token: must be between 1"),
    (lambda a: a.update(head_dims=128), "architecture.head_dims: unknown field"),
    (lambda a: a.update(tied_embeddings="no"), "architecture.tied_embeddings: must be true"),
])
def test_architecture_refusals(tmp_path, edit, message):
    arch = dict(GOOD)
    edit(arch)
    path = _with_architecture(tmp_path, arch)
    with pytest.raises(ShapesError) as err:
        load_shapes(path)
    assert str(err.value).startswith(path) and message in str(err.value)


def test_flops_refuse_inconsistent_or_missing_architecture(tmp_path):
    with pytest.raises(ShapesError, match="no 'architecture' section"):
        group_flops(load_shapes(_with_architecture(tmp_path, None)), 4096)
    with pytest.raises(ShapesError, match="layers is 30 but the groups with attention"):
        group_flops(load_shapes(_with_architecture(tmp_path, dict(GOOD, layers=30))), 4096)
    dense = {k: v for k, v in json.load(open(os.path.join(MODELS, "gpt-oss-120b.json")))
             ["architecture"].items() if k not in ("experts", "experts_per_token")}
    with pytest.raises(ShapesError, match="expert tensor, but architecture.experts"):
        group_flops(load_shapes(_with_architecture(tmp_path, dense, "gpt-oss-120b")), 4096)


def test_tied_embeddings_count_once_as_the_head(tmp_path):
    untied = active_params(load_shapes(_with_architecture(tmp_path, GOOD)))
    tied = active_params(load_shapes(_with_architecture(tmp_path,
                                                        dict(GOOD, tied_embeddings=True))))
    assert tied - untied == 128256 * 4096


def test_every_example_model_has_a_consistent_architecture():
    for name in sorted(os.listdir(MODELS)):
        model = load_shapes(os.path.join(MODELS, name))
        assert model.architecture is not None, name
        flops = group_flops(model, 4096)          # raises if the layer count disagrees
        assert sum(g.repeat for g in flops if g.layer) == model.architecture.layers
