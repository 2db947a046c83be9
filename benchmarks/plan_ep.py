"""MoE with expert parallelism at scale: per-rank memory and traffic of one training step for
DeepSeek-V3 and Kimi K2 at 1,024 and 8,192 ranks with EP 8, 32 and 64, ours next to FSDP2+EP
(torchtitan's recipe) and ZeRO-3 (DeepSpeed AutoEP), from `vescale_engine.plan.capacity` (what
`vescale plan --memory --ep N` prints). Pure Python, no torch: estimated, not measured.

It first writes the two shapes files it reads, benchmarks/capacity_models/deepseek-v3.json and
kimi-k2.json, from the published configs (DeepseekV3ForCausalLM's tensors as transformers 5.24
lays them out: fused experts `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`
[E, H, I], the model's base_model_tp_plan and base_model_ep_plan), so the files and the table
always agree.

    python benchmarks/plan_ep.py     # writes the shapes files and benchmarks/results/plan_ep.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vescale_engine.plan import capacity, model_plan  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "capacity_models")
RESULTS = os.path.join(HERE, "results", "plan_ep.md")
WORLD_SIZES = (1024, 8192)
EP_SIZES = (8, 32, 64)
TOKENS = 4096   # per data-parallel rank per micro-step: one 4,096-token sequence

# The published configs (config.json of each; field names as there).
CONFIGS = {
    "deepseek-v3": dict(
        source="deepseek-ai/DeepSeek-V3 config.json (transformers DeepseekV3Config defaults, "
               "configuration_deepseek_v3.py)",
        vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128),
    "kimi-k2": dict(
        source="moonshotai/Kimi-K2-Instruct config.json (DeepseekV3ForCausalLM; as "
               "examples/models/kimi-k2.json)",
        vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=1,
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
        num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128),
}

# transformers 5.24 configuration_deepseek_v3.py base_model_tp_plan (attention is not split)
# and modeling_deepseek_v3.py's _tp_plan for the head; base_model_ep_plan.
TP_PLAN = {
    "mlp.experts.gate_up_proj": "packed_colwise",
    "mlp.experts.down_proj": "rowwise",
    "mlp.shared_experts.gate_proj": "colwise",
    "mlp.shared_experts.up_proj": "colwise",
    "mlp.shared_experts.down_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
EP_PLAN = {"mlp.experts.gate_up_proj": "grouped_gemm", "mlp.experts.down_proj": "grouped_gemm"}


def shapes(name: str, c: dict) -> dict:
    """The shapes file of a DeepSeek-V3-architecture model."""
    H, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]

    def t(tensor, *shape):
        return {"name": tensor, "shape": list(shape)}

    attention = [
        t("input_layernorm.weight", H),
        t("self_attn.q_a_proj.weight", c["q_lora_rank"], H),
        t("self_attn.q_a_layernorm.weight", c["q_lora_rank"]),
        t("self_attn.q_b_proj.weight", heads * qk, c["q_lora_rank"]),
        t("self_attn.kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + c["qk_rope_head_dim"], H),
        t("self_attn.kv_a_layernorm.weight", c["kv_lora_rank"]),
        t("self_attn.kv_b_proj.weight", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
          c["kv_lora_rank"]),
        t("self_attn.o_proj.weight", H, heads * c["v_head_dim"]),
        t("post_attention_layernorm.weight", H),
    ]
    F, E, I = c["intermediate_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    shared = c["n_shared_experts"] * I
    dense_mlp = [t("mlp.gate_proj.weight", F, H), t("mlp.up_proj.weight", F, H),
                 t("mlp.down_proj.weight", H, F)]
    moe_mlp = [t("mlp.gate.weight", E, H), t("mlp.gate.e_score_correction_bias", E),
               t("mlp.experts.gate_up_proj", E, 2 * I, H), t("mlp.experts.down_proj", E, H, I),
               t("mlp.shared_experts.gate_proj.weight", shared, H),
               t("mlp.shared_experts.up_proj.weight", shared, H),
               t("mlp.shared_experts.down_proj.weight", H, shared)]
    dense = c["first_k_dense_replace"]
    return {
        "name": name,
        "description": f"{c['source']}: " + ", ".join(f"{k} {v}" for k, v in c.items()
                                                      if k != "source") +
                       "; tie_word_embeddings false, num_nextn_predict_layers not included. "
                       "Written by benchmarks/plan_ep.py.",
        "tp_plan": TP_PLAN, "ep_plan": EP_PLAN,
        "moe": {"experts_per_token": c["num_experts_per_tok"], "hidden_size": H},
        "groups": [
            {"name": "embed_tokens", "repeat": 1,
             "tensors": [t("embed_tokens.weight", c["vocab_size"], H)]},
            {"name": "dense_layers", "repeat": dense, "tensors": attention + dense_mlp},
            {"name": "moe_layers", "repeat": c["num_hidden_layers"] - dense,
             "tensors": attention + moe_mlp},
            {"name": "head", "repeat": 1,
             "tensors": [t("norm.weight", H), t("lm_head.weight", c["vocab_size"], H)]},
        ]}


def write_shapes() -> dict:
    paths = {}
    for name, config in CONFIGS.items():
        paths[name] = os.path.join(SHAPES, f"{name}.json")
        text = json.dumps(shapes(name, config), indent=1) + "\n"
        with open(paths[name], "w") as f:
            f.write(text)
    return paths


def rows(paths: dict, world_sizes=WORLD_SIZES, ep_sizes=EP_SIZES) -> list:
    """One row per (model, world size, ep): each system's memory and traffic in bytes."""
    out = []
    for name, path in paths.items():
        model = model_plan.load_shapes(path)
        cache = capacity.PlanCache()
        for world in world_sizes:
            for ep in (1,) + tuple(ep_sizes):
                setup = capacity.Setup(world, ep=ep, tokens=TOKENS)
                est = capacity.estimate(model, setup, cache=cache)
                out.append({"model": name, "params": model.numel, "world": world, "ep": ep,
                            "efsdp": setup.expert_shard_size, "est": est})
    return out


def gb(x: int) -> str:
    return f"{x / 1e9:,.2f}"


def system_cells(est: dict, system: str) -> list:
    m = est["memory"][system]
    t = est["traffic"] if system == "ours" else est["traffic"][system]
    if "unsupported" in m:
        return ["n/a"] * 6
    return [gb(m["master"] + m["grad"] + m["optimizer"]), gb(m["gathered_peak"]),
            f"**{gb(m['total'])}**" if system == "ours" else gb(m["total"]),
            f"{100 * m['padding_ratio']:.2f}%", gb(t["all_gather"]), gb(t["reduce_scatter"])]


def summary_table(found: list) -> str:
    """The compact table docs/capacity_planning.md shows."""
    head = ("| model | ranks | ep | efsdp | peak GB ours | FSDP2+EP | ZeRO-3 AutoEP | ours / "
            "FSDP2 | all-gather GB ours | FSDP2 | all-to-all GB |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in found:
        if r["ep"] == 1:
            continue
        mem, tr = r["est"]["memory"], r["est"]["traffic"]
        ours, fsdp2 = mem["ours"]["total"], mem["fsdp2"].get("total")
        lines.append(" | ".join([
            f"| {r['model']}", f"{r['world']:,}", str(r["ep"]), f"{r['efsdp']:,}", gb(ours),
            gb(fsdp2) if fsdp2 else "n/a", gb(mem["zero3"]["total"]),
            f"{ours / fsdp2:.2f}" if fsdp2 else "n/a", gb(tr["all_gather"]),
            gb(tr["fsdp2"]["all_gather"]) if fsdp2 else "n/a", gb(tr["all_to_all"])]) + " |")
    return head + "\n".join(lines) + "\n"


def full_table(found: list) -> str:
    head = ("| model | ranks | ep | efsdp | system | state GB | gathered GB | peak GB | padding |"
            " all-gather GB | reduce-scatter GB | all-to-all GB |\n"
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in found:
        for system, label in (("ours", "ours"), ("fsdp2", "FSDP2+EP" if r["ep"] > 1 else
                                                  "FSDP2"),
                              ("zero3", "ZeRO-3 AutoEP" if r["ep"] > 1 else "ZeRO-3")):
            t = r["est"]["traffic"] if system == "ours" else r["est"]["traffic"][system]
            a2a = gb(t["all_to_all"]) if "all_to_all" in t else ("n/a" if r["ep"] > 1 else "0")
            lines.append(f"| {r['model']} | {r['world']:,} | {r['ep']} | "
                         f"{r['efsdp'] if r['ep'] > 1 else '-'} | {label} | "
                         + " | ".join(system_cells(r["est"], system)) + f" | {a2a} |")
    return head + "\n".join(lines) + "\n"


def report(found: list) -> str:
    params = {r["model"]: r["params"] for r in found}
    return (
        "# MoE with expert parallelism: per-rank memory and traffic at scale\n\n"
        "Produced by `python benchmarks/plan_ep.py` (pure Python: `vescale_engine.plan.capacity`,"
        " what `vescale plan --memory --ep N` prints; estimated, not measured). Models: "
        + ", ".join(f"{n} ({p / 1e9:.1f}B parameters, benchmarks/capacity_models/{n}.json)"
                    for n, p in params.items())
        + ". AdamW, bf16 parameters and gradient reduction, fp32 master, gradients and moments,"
        " one micro-step, units resharded after forward, granularity rows:1; activations "
        "excluded. GB = 10^9 bytes per rank.\n\n"
        "Meshes: dense units (embeddings, attention, router, shared experts, head) sharded over "
        "all ranks (dp); each MoE layer's experts a unit of its own, E/ep experts per rank, "
        "sharded over efsdp = ranks / ep. FSDP2+EP: torchtitan's apply_fsdp (experts on the "
        "efsdp mesh, dim 0 padded to even chunks, or dim 1 when efsdp x ep > E); ZeRO-3 AutoEP: "
        "flat partitions of ceil(numel / group) with experts over the expert-data-parallel "
        "group. ep 1 is plain data parallelism (every rank gathers every expert). all-to-all: "
        f"{TOKENS:,} tokens per rank per micro-step, each sent to 8 experts as a 7168-wide bf16 "
        "vector, (ep-1)/ep of them off-rank under uniform routing, dispatch and combine in "
        "forward and backward: the same for the three systems. state = master + gradient "
        "shards + optimizer state; gathered = the largest transient of forward/backward.\n\n"
        + full_table(found))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS, help="the Markdown report to write")
    args = parser.parse_args(argv)
    found = rows(write_shapes())
    text = report(found)
    with open(args.out, "w") as f:
        f.write(text)
    print(summary_table(found), end="")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
