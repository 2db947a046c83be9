"""Tensor and expert parallelism through `initialize` (docs/parallelism.md): the config keys,
the rank layout, the batch arithmetic on the data-parallel size, the plan checks that fail
before any collective, and training on 4 gloo ranks equal to one process on the same global
batch: (dp 2, tp 2) for a tiny Llama, (dp 4 with ep 2) for a tiny Mixtral."""
from __future__ import annotations

import math

import pytest
import torch

from config_schemas.validate import ConfigError
from dist_harness import engine_log_messages
from vescale_engine.engine.config import ParallelSizes, build_config

WORLD = 4
STEPS = 5
LR = 1e-3


# -- tiny models, built the same on every rank ---------------------------------------------------

def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def tiny_mixtral(seed=0, experts=4):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=32))


def tiny_qwen3_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32))


def tiny_deepseek_v3(seed=0):
    """Multi-head latent attention, one dense layer first, then routed plus shared experts."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=32))


def config(**edits):
    base = {"train_batch_size": 4, "gradient_clipping": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    return {**base, **edits}


# -- config and batch arithmetic (no ranks) -----------------------------------------------------

@pytest.mark.parametrize("keys,world,want", [
    ({"tensor_parallel": {"autotp_size": 2}}, 4, ParallelSizes(4, tp=2)),
    ({"tensor_parallel": {"autotp_size": 0}}, 4, ParallelSizes(4)),
    ({"tensor_parallel": {"autotp_size": 2}, "vescale": {"hsdp_replicate_size": 2}}, 8,
     ParallelSizes(8, tp=2, replicate=2)),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, 4, ParallelSizes(4, ep=2)),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2},
      "vescale": {"hsdp_replicate_size": 2}}, 8, ParallelSizes(8, ep=2, replicate=2)),
    ({"expert_parallel": {"enabled": False, "autoep_size": 2}}, 4, ParallelSizes(4)),
])
def test_rank_layout(keys, world, want):
    sizes = build_config(config(train_batch_size=8, **keys), world).parallel
    assert sizes == want
    assert sizes.dp == world // want.tp and sizes.shard * sizes.replicate == sizes.dp
    if want.ep > 1:
        assert sizes.efsdp == sizes.shard // want.ep
    # TP innermost: consecutive ranks share a TP group, the data-parallel rank is rank // tp
    assert [sizes.dp_rank(r) for r in range(world)] == [r // want.tp for r in range(world)]


def test_batch_arithmetic_uses_the_data_parallel_size():
    tp = {"tensor_parallel": {"autotp_size": 2}}
    # 4 ranks, tp 2: 2 data-parallel ranks
    cfg = build_config(config(train_batch_size=8, **tp), 4)
    assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_per_gpu,
            cfg.batch.gradient_accumulation_steps) == (8, 4, 1)
    keys = config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3, **tp)
    del keys["train_batch_size"]
    cfg = build_config(keys, 8)
    assert cfg.batch.train_batch_size == 2 * 3 * 4
    with engine_log_messages() as said:  # derived over dp ranks, not DeepSpeed AutoTP's world
        cfg = build_config(config(train_batch_size=12, train_micro_batch_size_per_gpu=3, **tp), 4)
    assert cfg.batch.gradient_accumulation_steps == 2
    assert any("derived over the 2 data-parallel ranks (micro-batch 3, accumulation 2); "
               "DeepSpeed AutoTP derives it over all 4 ranks" in m for m in said), said
    # experts borrow data-parallel ranks: every rank keeps its own micro-batch
    ep = {"expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert build_config(config(train_batch_size=8, **ep), 4).batch.micro_batch_per_gpu == 2
    with pytest.raises(ConfigError, match="train_batch_size 6 is not a multiple of .* x 2 "
                                          "data-parallel ranks"):
        build_config(config(train_batch_size=6, train_micro_batch_size_per_gpu=2, **tp), 4)
    # all three given may count every rank, as DeepSpeed AutoTP checks them (and Hugging
    # Face's "auto" fills them): what trains is the micro-batch and the accumulation
    both = dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3, **tp)
    for total in (2 * 3 * 2, 2 * 3 * 4):
        cfg = build_config(config(**{**both, "train_batch_size": total}), 4)
        assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_per_gpu,
                cfg.batch.gradient_accumulation_steps) == (total, 2, 3)
    with pytest.raises(ConfigError, match=r"train_batch_size 18 != .* = 12 \(or x 4 ranks = 24, "
                                          r"as DeepSpeed AutoTP counts\)"):
        build_config(config(**{**both, "train_batch_size": 18}), 4)


@pytest.mark.parametrize("keys,world,message", [
    ({"tensor_parallel": {"autotp_size": 3}}, 4,
     "tensor_parallel.autotp_size 3 does not divide the world size 4"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 3}}, 4,
     r"expert_parallel.autoep_size 3 does not divide the data-parallel shard size 4"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 4},
      "vescale": {"hsdp_replicate_size": 2}}, 4,
     r"expert_parallel.autoep_size 4 does not divide the data-parallel shard size 2"),
    ({"tensor_parallel": {"autotp_size": 2}, "vescale": {"hsdp_replicate_size": 4}}, 4,
     r"vescale.hsdp_replicate_size 4 does not divide the data-parallel size 2 \(world 4 / "
     r"autotp_size 2\)"),
    ({"tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"enabled": True,
                                                                 "autoep_size": 2}}, 4,
     "tensor and expert parallelism together are not supported yet"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2},
      "zero_optimization": {"stage": 0}}, 4, "needs zero_optimization.stage >= 1"),
    ({"vescale": {"tensor_parallel": {"*.q": "colwise"}}}, 4,
     "vescale.tensor_parallel is a tensor-parallel plan: it needs tensor_parallel.autotp_size"),
    ({"tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"enabled": True,
                                                                 "autoep_siz": 2}}, 4,
     "expert_parallel.autoep_siz: unknown key; did you mean 'autoep_size'"),
    ({"tensor_parallel": {"autotp_size": 2}, "vescale": {"tensor_parallel": {"*.q": "col"}}},
     4, r"vescale.tensor_parallel.\*.q: 'col' is not allowed"),
])
def test_config_errors_are_one_line(keys, world, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_config(config(train_batch_size=8, **keys), world)
    assert "\n" not in str(err.value)


# -- the model's side, checked before any collective (no ranks) ----------------------------------

def test_plan_checks_need_no_collective():
    from torch import nn
    from vescale_engine.engine.parallel_plan import check_plan
    tp2, ep2 = ParallelSizes(4, tp=2), ParallelSizes(4, ep=2)
    plan = check_plan(tiny_llama(), tp2, {})
    assert plan.tp_source == "the model's base_model_tp_plan"
    assert plan.tp_plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert plan.tp_plan["model.layers.0.mlp.up_proj"] == "colwise"
    ours = check_plan(tiny_llama(), tp2, {"model.layers.*.mlp.up_proj": "colwise"})
    assert ours.tp_source == "vescale.tensor_parallel"
    moe = check_plan(tiny_mixtral(), ep2, {})
    assert moe.expert_modules == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert moe.ep_plan["model.layers.0.mlp.experts.gate_up_proj"] == "grouped_gemm"

    def error(model, sizes, plan=None):
        with pytest.raises(ValueError) as err:
            check_plan(model, sizes, plan or {})
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "expert_parallel.autoep_size 2 does not divide the 3 experts of " \
           "model.layers.0.mlp.experts" in error(tiny_mixtral(experts=3), ep2)
    assert "LlamaForCausalLM has no expert-parallel plan" in error(tiny_llama(), ep2)
    assert "Sequential has no tensor-parallel plan" in error(nn.Sequential(nn.Linear(4, 4)), tp2)
    assert "num_key_value_heads 2 is not divisible" in error(tiny_llama(), ParallelSizes(8, tp=4))
    assert "vescale.tensor_parallel['layers.*.up']: matches no module" in error(
        tiny_llama(), tp2, {"layers.*.up": "colwise"})
    assert "model.norm is a LlamaRMSNorm; colwise splits nn.Linear" in error(
        tiny_llama(), tp2, {"model.norm": "colwise"})
    assert "in_features 3 is not divisible by tensor_parallel.autotp_size 2" in error(
        nn.Sequential(nn.Linear(3, 4)), tp2, {"0": "rowwise"})


# -- 4 gloo ranks ---------------------------------------------------------------------------------

POOL_WORLD = WORLD


def meshes_and_plans(rank, world):
    """The groups of each layout, the placements the plans give, the batch check."""
    import torch.distributed as dist
    from vescale_engine.engine.parallel_plan import (apply_parallel_plan, build_meshes,
                                                     check_plan, require_same_batch)
    ranks = dist.get_process_group_ranks
    out = {}
    tp = build_meshes(ParallelSizes(world, tp=2), "cpu")
    out["tp"] = ranks(tp.tp.get_group())
    out["dense_dp"] = ranks(tp.dense_dp().get_group())
    hsdp = build_meshes(ParallelSizes(world, ep=2, replicate=2), "cpu")
    out["hsdp_dense"] = hsdp.dense_dp().mesh.tolist()
    out["hsdp_experts"] = hsdp.expert_dp().mesh.tolist()
    ep = build_meshes(ParallelSizes(world, ep=2), "cpu")
    out["ep"] = ranks(ep.ep.get_group())
    out["efsdp"] = ranks(ep.expert_dp().get_group())
    out["ep_dense_dp"] = ranks(ep.dense_dp().get_group())

    model = tiny_llama()
    apply_parallel_plan(model, check_plan(model, tp.sizes, {}), tp)
    q = model.model.layers[0].self_attn.q_proj.weight
    o = model.model.layers[0].self_attn.o_proj.weight
    out["q"] = (str(q.placements), tuple(q.to_local().shape))
    out["o"] = (str(o.placements), tuple(o.to_local().shape))
    ours = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    apply_parallel_plan(ours, check_plan(ours, tp.sizes, {"0": "colwise", "2": "rowwise"}), tp)
    out["ours"] = (str(ours[0].weight.placements), str(ours[2].weight.placements))
    moe = tiny_mixtral()
    apply_parallel_plan(moe, check_plan(moe, ep.sizes, {}), ep)
    experts = moe.model.layers[0].mlp.experts
    out["experts"] = (str(experts.gate_up_proj.placements),
                      tuple(experts.gate_up_proj.to_local().shape), experts.num_experts)

    same = torch.arange(6).reshape(2, 3)
    require_same_batch((same,), {"labels": same}, tp.tp.get_group(), torch.device("cpu"))
    mine = same + (rank % 2)  # the two ranks of a TP group differ
    try:
        require_same_batch((mine,), {}, tp.tp.get_group(), torch.device("cpu"))
        out["differ"] = None
    except ValueError as err:
        out["differ"] = str(err)
    assert out["tp"] == [rank - rank % 2, rank - rank % 2 + 1]  # consecutive ranks
    assert out["dense_dp"] == [rank % 2, rank % 2 + 2]
    assert out["ep"] == [rank - rank % 2, rank - rank % 2 + 1]
    assert out["efsdp"] == [rank % 2, rank % 2 + 2]
    assert out["ep_dense_dp"] == [0, 1, 2, 3]  # experts borrow: every rank is dp
    assert out["hsdp_dense"] == [[0, 1], [2, 3]]  # (replicate 2, shard 2)
    assert out["hsdp_experts"] == ([[0], [2]] if rank % 2 == 0 else [[1], [3]])
    assert out["q"] == ("(Shard(dim=0),)", (8, 16))
    assert out["o"] == ("(Shard(dim=1),)", (16, 8))
    assert out["ours"] == ("(Shard(dim=0),)", "(Shard(dim=1),)")
    assert out["experts"] == ("(Shard(dim=0),)", (2, 64, 16), 2)
    group = [rank - rank % 2, rank - rank % 2 + 1]
    assert out["differ"] == (
        f"data inconsistency within the tensor-parallel group {group}: rank(s) "
        f"[{group[1]}] got a different batch from rank {group[0]}; the ranks of a TP group "
        "must get the same batch (data-parallel rank = rank // autotp_size, as the "
        "dataloader initialize returns does)")


def test_meshes_plans_and_the_tp_batch_check(pool):
    pool.run(meshes_and_plans)


def initialize_errors(rank, world):
    """initialize's errors with tensor/expert parallelism: one line, every rank, and no mesh
    built (the check runs before any collective but the config agreement)."""
    from unittest import mock
    import vescale_engine
    from vescale_engine.engine import engine as engine_module
    from dist_harness import value_errors
    built = []
    real = engine_module.build_meshes

    def spy(*args):
        built.append(args)
        return real(*args)

    def init(model, **keys):
        return lambda: vescale_engine.initialize(model=model, config=config(**keys))
    ep = {"expert_parallel": {"enabled": True, "autoep_size": 2}}
    with mock.patch.object(engine_module, "build_meshes", spy):
        errors = value_errors([
            init(tiny_mixtral(experts=6), expert_parallel={"enabled": True, "autoep_size": 4}),
            init(tiny_llama(), **ep),
            init(tiny_llama(), tensor_parallel={"autotp_size": 3}),
            init(tiny_llama(), tensor_parallel={"autotp_size": 2},
                 vescale={"tensor_parallel": {"nothing.*": "rowwise"}}),
            lambda: vescale_engine.initialize(model=tiny_llama(), config=config(), mpu=object()),
            init(tiny_llama(), tensor_parallel={"autotp_size": 2}, optimizer=SHAMPOO),
        ])
    return errors, len(built)


def test_initialize_errors_are_one_line_on_every_rank_before_any_mesh(pool):
    got = pool.run(initialize_errors)
    for errors, built in got:
        assert built == 0
        assert errors[0] == ("expert_parallel.autoep_size 4 does not divide the 6 experts of "
                             "model.layers.0.mlp.experts")
        assert errors[1].startswith("expert_parallel.autoep_size 2: LlamaForCausalLM has no "
                                    "expert-parallel plan")
        assert errors[2] == "tensor_parallel.autotp_size 3 does not divide the world size 4"
        assert errors[3] == ("vescale.tensor_parallel['nothing.*']: matches no module of "
                             "LlamaForCausalLM")
        assert "tensor_parallel.autotp_size" in errors[4]
        assert errors[5].startswith("optimizer Shampoo with tensor_parallel.autotp_size 2: "
                                    "tensor parallelism splits matrices"), errors[5]
        assert all("\n" not in e for e in errors)
    assert got[0] == got[1] == got[2] == got[3]


# -- training through initialize equals one process on the same global batch ----------------------

def global_batch(rows=4, seq=8, seed=1):
    return torch.randint(0, 64, (rows, seq), generator=torch.Generator().manual_seed(seed))


def reference_run(model, ids, clip=0.0, steps=STEPS):
    """One process, the whole global batch, torch's AdamW with the config's hyperparameters;
    (losses, gradient norms)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                    clip if clip else float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def ours_alone_run(model, ids, optimizer, steps=STEPS):
    """One process with our optimizer `optimizer` (a config "optimizer" section): the model
    sharded over this rank alone, the whole global batch; (losses, gradient norms, full
    parameters)."""
    import torch.distributed as dist
    from vescale_engine.fsdp import full_state_dict, fully_shard
    from vescale_engine.optim import build_optimizer, sharding_granularity
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank, all
    given = {} if optimizer["type"] == "Shampoo" else {"default": "rows:1"}  # its own rows:B
    fully_shard(model, mesh=groups[dist.get_rank()],
                granularity=sharding_granularity(optimizer, given, model))
    opt = build_optimizer(optimizer["type"], model.parameters(), optimizer["params"])
    losses, norms = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, full_state_dict(model)


def local_piece(sp, full):
    """This rank's flat piece of the one-process tensor `full`: its TP/EP-local block, then the
    RaggedShard range."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    t = full.detach()
    spec = sp.dtensor_spec
    if spec is not None:
        shape, offset = compute_local_shape_and_global_offset(t.shape, spec.mesh, spec.placements)
        for d, (n, o) in enumerate(zip(shape, offset)):
            t = t.narrow(d, o, n)
    begin, end = sp.flat_range
    return t.reshape(-1)[begin:end]


def train_against_one_process(rank, world, build, keys, micro_rows):
    """(max |loss - reference|, max |parameter - reference|, max relative |norm - reference|,
    what the engine reports) after STEPS steps; each data-parallel rank trains on its rows of
    the global batch. The reference: torch's AdamW, or with keys["optimizer"] ours (Muon,
    AdamW8bit) on one process."""
    import torch.distributed as dist
    import vescale_engine
    from vescale_engine.fsdp.lookup import sharded_parameters, units_under
    ids = global_batch()
    reference = build()
    keys = config(**keys)
    if "optimizer" in keys and keys["optimizer"]["type"] != "AdamW":
        want, want_norms, ref = ours_alone_run(reference, ids, keys["optimizer"])
    else:
        want, want_norms = reference_run(reference, ids, keys["gradient_clipping"])
        ref = dict(reference.named_parameters())
    rows = [ids[i] for i in range(ids.shape[0])]  # the loader initialize returns, checked too
    engine, _, loader, _ = vescale_engine.initialize(model=build(), config=keys,
                                                     training_data=rows)
    dp = engine.dp_rank
    mine = ids[dp * micro_rows:(dp + 1) * micro_rows]
    losses, norms = [], []
    for _ in range(STEPS):
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank's micro-batch loss (TP peers: the same one)
        losses.append(mean.item() / world)
    names = {}
    for fqn, sp in sharded_parameters(engine.module):
        names[fqn] = sp
    worst = max((local_piece(sp, ref[fqn]) - sp.sharded.detach()).abs().max().item()
                if sp.sharded.numel() else 0.0 for fqn, sp in names.items())
    placements = sorted({str(sp.dtensor_spec.placements) for sp in names.values()
                         if sp.dtensor_spec is not None})
    report = dict(dp_world_size=engine.dp_world_size, dp_rank=dp, placements=placements,
                  split=sum(sp.dtensor_spec is not None for sp in names.values()),
                  units=sorted({(type(u.module).__name__,
                                 tuple(dist.get_process_group_ranks(u.buffers[0].shard_group)),
                                 u.group.gradient_divide_factor)
                                for u in units_under(engine.module) if u.buffers}, key=str),
                  router=type(names["model.layers.0.mlp.gate.weight"].unit.module).__name__
                  if "model.layers.0.mlp.gate.weight" in names else None,
                  micro=engine.train_micro_batch_size_per_gpu(),
                  sampler=(loader.sampler.num_replicas, loader.sampler.rank),
                  first_batch=next(iter(loader)).tolist())
    engine.destroy()
    norm_err = max(abs(a - b) / b for a, b in zip(norms, want_norms))
    return max(abs(a - b) for a, b in zip(losses, want)), worst, norm_err, report


OUR_PLAN = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}


@pytest.mark.parametrize("keys", [{"gradient_clipping": 0.05},
                                  {"vescale": {"hsdp_replicate_size": 2}},
                                  {"vescale": {"tensor_parallel": OUR_PLAN}}],
                         ids=["clipped", "hsdp", "our_plan"])
def test_dp2_tp2_llama_equals_one_process(pool, keys):
    got = pool.run(train_against_one_process, tiny_llama,
                   {"tensor_parallel": {"autotp_size": 2}, **keys}, 2)
    for rank, (loss_err, param_err, norm_err, report) in enumerate(got):
        assert loss_err < 1e-6 and param_err < 1e-6, (rank, loss_err, param_err)
        assert norm_err < 1e-5, (rank, norm_err)  # clipped: the coefficient is right too
        assert report["dp_world_size"] == 2 and report["dp_rank"] == rank // 2
        assert report["micro"] == 2 and report["sampler"] == (2, rank // 2)
        assert report["placements"] == ["(Shard(dim=0),)", "(Shard(dim=1),)"]  # col, row
        # the model's plan splits attention, the vocabulary and the head too; ours the MLPs
        assert report["split"] == (6 if "vescale" in keys and "tensor_parallel" in
                                   keys["vescale"] else 16), report["split"]
    batches = [report["first_batch"] for *_, report in got]
    assert batches[0] == batches[1] != batches[2] == batches[3]  # TP peers: one batch


@pytest.mark.parametrize("keys", [{"gradient_clipping": 0.05},
                                  {"vescale": {"hsdp_replicate_size": 2}}],
                         ids=["clipped", "hsdp"])
def test_dp4_ep2_mixtral_equals_one_process(pool, keys):
    got = pool.run(train_against_one_process, tiny_mixtral,
                   {"expert_parallel": {"enabled": True, "autoep_size": 2}, **keys}, 1)
    for rank, (loss_err, param_err, norm_err, report) in enumerate(got):
        assert loss_err < 1e-6 and param_err < 1e-6, (rank, loss_err, param_err)
        assert norm_err < 1e-5, (rank, norm_err)
        assert report["dp_world_size"] == 4 and report["dp_rank"] == rank
        assert report["sampler"] == (4, rank) and report["micro"] == 1
        assert report["placements"] == ["(Shard(dim=0),)"]  # the fused experts
        # experts: own units over efsdp (the dense dp size as divisor); the router: dense
        assert report["router"] == "MixtralDecoderLayer"
        if "vescale" not in keys:
            efsdp = (rank % 2, rank % 2 + 2)
            assert ("MixtralExperts", efsdp, 4.0) in report["units"], report["units"]
            assert ("MixtralDecoderLayer", (0, 1, 2, 3), None) in report["units"]
    assert len({str(report["first_batch"]) for *_, report in got}) == 4


@pytest.mark.parametrize("build,experts,layer", [(tiny_qwen3_moe, "Qwen3MoeExperts",
                                                   "Qwen3MoeDecoderLayer"),
                                                  (tiny_deepseek_v3, "DeepseekV3Experts",
                                                   "DeepseekV3DecoderLayer")],
                         ids=["qwen3_moe", "deepseek_v3"])
def test_dp4_ep2_qwen3_moe_and_deepseek_v3_equal_one_process(pool, build, experts, layer):
    """The models' own EP plans (fused experts split on dim 0, all-to-all dispatch), clipped."""
    got = pool.run(train_against_one_process, build,
                   {"expert_parallel": {"enabled": True, "autoep_size": 2},
                    "gradient_clipping": 0.05}, 1)
    for rank, (loss_err, param_err, norm_err, report) in enumerate(got):
        assert loss_err < 1e-6 and param_err < 1e-6, (rank, loss_err, param_err)
        assert norm_err < 1e-5, (rank, norm_err)
        assert report["placements"] == ["(Shard(dim=0),)"]
        assert (experts, (rank % 2, rank % 2 + 2), 4.0) in report["units"], report["units"]
        assert (layer, (0, 1, 2, 3), None) in report["units"], report["units"]


MUON = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1, "ns_dtype": "fp32",
                                   "adamw_lr": LR, "adamw_weight_decay": 0.0}}
ADAMW8BIT = {"type": "AdamW8bit", "params": {"lr": LR, "weight_decay": 0.0, "block": "block:8"}}
# B = 12: partial blocks in the 16-wide matrices, whole-matrix sharding of the experts (64 and
# 16 rows are not both multiples of 12); roots at steps 2 and 4, preconditioned from step 2
SHAMPOO = {"type": "Shampoo", "params": {"lr": LR, "weight_decay": 0.01,
                                         "max_preconditioner_dim": 12,
                                         "precondition_frequency": 2, "epsilon": 1e-8}}


@pytest.mark.parametrize("build,keys,micro_rows", [
    (tiny_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2}, "optimizer": MUON},
     1),
    (tiny_llama, {"tensor_parallel": {"autotp_size": 2}, "optimizer": ADAMW8BIT}, 2),
    (tiny_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2},
                    "optimizer": SHAMPOO}, 1)],
    ids=["dp4_ep2_mixtral_muon", "dp2_tp2_llama_adamw8bit", "dp4_ep2_mixtral_shampoo"])
def test_muon_under_ep_and_adamw8bit_under_tp_equal_one_process(pool, build, keys, micro_rows):
    """Muon orthogonalizes whole local experts over efsdp; AdamW8bit's block:8 divides every
    TP piece of the tiny Llama, so its blocks are one process's; Shampoo's blocks of the
    experts' local matrices are whole global matrices': each equals our optimizer on one
    process over the same global batch."""
    got = pool.run(train_against_one_process, build, keys, micro_rows)
    for rank, (loss_err, param_err, norm_err, report) in enumerate(got):
        assert loss_err < 1e-6 and param_err < 1e-6, (rank, loss_err, param_err)
        assert norm_err < 1e-5, (rank, norm_err)
        assert report["split"] > 0, report


def tp_batch_mismatch(rank, world):
    """A loader of one's own that shards by the global rank: the first forward stops every
    rank of each TP group, before the model runs."""
    import vescale_engine
    engine, _, _, _ = vescale_engine.initialize(
        model=tiny_llama(), config=config(tensor_parallel={"autotp_size": 2}))
    ids = global_batch()[rank:rank + 1].repeat(2, 1)  # by global rank: TP peers differ
    try:
        engine(input_ids=ids, labels=ids)
        message = None
    except ValueError as err:
        message = str(err)
    finally:
        engine.destroy()
    group = [rank - rank % 2, rank - rank % 2 + 1]
    assert message is not None and message.startswith(
        f"data inconsistency within the tensor-parallel group {group}: rank(s) "
        f"[{group[1]}] got a different batch from rank {group[0]}"), message


def test_tp_peers_given_different_batches_stop_at_the_first_forward(pool):
    pool.run(tp_batch_mismatch)


# -- checkpoints: true global shapes, loaded at another layout --------------------------------------

def tp_ep_placements():
    """(mesh, placements) on a (dp 2, tp 2) mesh of 4 ranks: Shard on dims 0 and 1,
    _StridedShard on both (transformers' packed gate/up), FSDP2's 2-D expert placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return ((mesh["tp"], [Shard(0)]), (mesh["tp"], [Shard(1)]),
            (mesh["tp"], [_StridedShard(0, split_factor=2)]),
            (mesh["tp"], [_StridedShard(1, split_factor=2)]),
            (mesh, [_StridedShard(0, split_factor=2), Shard(0)]))


def strided_boxes(rank, world):
    """Each rank's RaggedPiece boxes of DTensors of an arange, for TP/EP placements (Shard on
    dim 0 and 1, _StridedShard as transformers' packed gate/up, FSDP2's 2-D expert placement):
    [(placements, global shape, [(offsets, values)])]."""
    from torch.distributed.tensor import distribute_tensor
    from vescale_engine.shard.ragged_piece import RaggedPiece
    from vescale_engine.fsdp.dtensor_params import local_index_maps
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    out = []
    for sub, placements in tp_ep_placements():
        d = distribute_tensor(full, sub, placements)
        local = d.to_local().reshape(-1)
        n = local.numel()
        start = (rank // 2) * (n // 2) if len(placements) == 1 else 0  # dp row's half
        end = start + n // 2 if len(placements) == 1 else n
        piece = RaggedPiece(local[start:end], full.shape, start, local_shape=d.to_local().shape,
                            index_maps=local_index_maps(d._spec))
        out.append((str(placements), [(tuple(o), piece.box(o).clone()) for o in piece.boxes]))
    return out


def test_pieces_of_tp_ep_local_tensors_are_boxes_of_the_global_tensor(pool):
    """The local->global box map (Shard, _StridedShard, 2-D): the boxes of every rank cover the
    global tensor exactly once and hold its values."""
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    got = pool.run(strided_boxes)
    for case in range(len(got[0])):
        seen = torch.zeros_like(full)
        covered = {}
        for rank_boxes in got:
            name, boxes = rank_boxes[case]
            for offsets, values in boxes:
                where = tuple(slice(o, o + n) for o, n in zip(offsets, values.shape))
                assert torch.equal(full[where], values), (name, offsets)
                covered.setdefault(offsets, values.shape)
                seen[where] += 1
        if "Strided" in name and "Shard(dim=0)" not in name.split("),")[-1]:
            assert len(covered) > 2, (name, covered)  # gate and up segments: split boxes
        # the two dp rows hold halves of each TP-local tensor: every element exactly once
        assert torch.equal(seen, torch.ones_like(full)), (name, seen)


def _full_checkpoint(path):
    """The checkpoint's model and optimizer tensors at their global shapes, read by this one
    process alone (no process group: one rank's load, as a plain model would)."""
    import torch.distributed.checkpoint as dcp
    from vescale_engine.checkpoint.sharded import read_metadata
    md = read_metadata(path)
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in
          md.state_dict_metadata.items() if k.startswith(("model.", "optim.state."))}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    coverage = {k: sum(math.prod(c.sizes) for c in m.chunks)
                for k, m in md.state_dict_metadata.items() if k.startswith("model.")}
    return sd, {k: (n, math.prod(md.state_dict_metadata[k].size)) for k, n in coverage.items()}


def _state_errors(engine, full, params_only=False):
    """Max |piece - the checkpoint's global tensor| over the engine's parameters and optimizer
    state on this rank (0.0: bitwise), and how many entries were compared."""
    from vescale_engine.checkpoint.entries import optimizer_state
    from vescale_engine.fsdp.lookup import sharded_parameters
    worst, compared = 0.0, 0
    state = optimizer_state(engine.optimizer, create=False)
    for fqn, sp in sharded_parameters(engine.module):
        pairs = [(sp.sharded.detach(), full[f"model.{fqn}"])]
        for name, t in ({} if params_only else state.get(sp.sharded, {})).items():
            if t.dim():
                pairs.append((t, full[f"optim.state.{fqn}.{name}"]))
        for mine, whole in pairs:
            if mine.numel():
                worst = max(worst, (local_piece(sp, whole) - mine).abs().max().item())
            compared += 1
    return worst, compared


def _steps(engine, ids, micro_rows, n):
    import torch.distributed as dist
    losses = []
    for _ in range(n):
        mine = ids[engine.dp_rank * micro_rows:(engine.dp_rank + 1) * micro_rows]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def checkpoint_across_layouts(rank, world, build, parallel, micro_rows, path):
    """Train 2 steps at (dp, tp/ep) = `parallel`, save, train 2 more; load that checkpoint at
    (dp 4, tp/ep 1), compare every piece (parameters, AdamW state) bitwise with the checkpoint
    read by one process alone, and train the same 2 steps; save there and load back at
    `parallel` (bitwise, the next step's loss). For experts, also into FSDP2+EP (torch's
    fully_shard) through plain dcp.load; every piece covered, no difference."""
    import os
    import torch.distributed as dist
    import vescale_engine
    from vescale_engine.fsdp.lookup import sharded_parameters
    ids = global_batch()
    engine, *_ = vescale_engine.initialize(model=build(), config=config(**parallel))
    _steps(engine, ids, micro_rows, 2)
    engine.save_checkpoint(path, tag="t")
    saved_err, saved_n = None, 0
    dist.barrier()
    full, coverage = _full_checkpoint(f"{path}/t")
    saved_err, saved_n = _state_errors(engine, full)
    after = _steps(engine, ids, micro_rows, 2)
    engine.destroy()

    plain, *_ = vescale_engine.initialize(model=build(seed=7), config=config())
    plain.load_checkpoint(path, tag="t")
    loaded_err, loaded_n = _state_errors(plain, full)
    resumed = _steps(plain, ids, 1, 2)
    plain.save_checkpoint(path, tag="u")  # and back: a dp-4 checkpoint into TP/EP pieces
    plain_next = _steps(plain, ids, 1, 1)
    plain.destroy()
    dist.barrier()
    full_u, _ = _full_checkpoint(f"{path}/u")
    if dist.get_rank() == 0:  # the same weights as a Hugging Face file, global shapes
        from vescale_engine.checkpoint.safetensors_format import save_file
        os.makedirs(f"{path}/hf")
        save_file({k[6:]: v for k, v in full_u.items() if k.startswith("model.")},
                  f"{path}/hf/model.safetensors")
    dist.barrier()
    split, *_ = vescale_engine.initialize(model=build(seed=9), config=config(**parallel))
    hf = split.load_hf_checkpoint(f"{path}/hf")  # this rank's bytes only
    hf_err, _ = _state_errors(split, full_u, params_only=True)
    own = sum(sp.sharded.numel() * sp.sharded.element_size()
              for _, sp in sharded_parameters(split.module))
    split.load_checkpoint(path, tag="u")
    back_err, back_n = _state_errors(split, full_u)
    split_next = _steps(split, ids, micro_rows, 1)
    split.destroy()
    out = dict(coverage=coverage, saved=(saved_err, saved_n), loaded=(loaded_err, loaded_n),
               after=after, resumed=resumed, back=(back_err, back_n),
               next=(plain_next[0], split_next[0]), hf=(hf_err, hf.bytes_read, own))
    if "expert_parallel" in parallel:
        out["fsdp2"] = _fsdp2_ep_load(build, f"{path}/t", full)
    # true global shapes, every element once (TP-replicated pieces deduplicated by DCP)
    assert all(n == numel for n, numel in out["coverage"].values()), out["coverage"]
    assert out["saved"][0] == 0.0 and out["saved"][1] > 20, (rank, out["saved"])
    assert out["loaded"][0] == 0.0 and out["loaded"][1] > 20, (rank, out["loaded"])
    assert max(abs(a - b) for a, b in zip(out["after"], out["resumed"])) < 1e-6, out
    assert out["back"][0] == 0.0 and out["back"][1] > 20, (rank, out["back"])
    assert abs(out["next"][0] - out["next"][1]) < 1e-6, (rank, out["next"])
    hf_err, read, own = out["hf"]
    assert hf_err == 0.0 and read == own, (rank, out["hf"])  # exact, only its own bytes
    if "fsdp2" in out:
        assert out["fsdp2"] == 0.0, (rank, out["fsdp2"])


def _fsdp2_ep_load(build, path, full):
    """Our checkpoint into torch's FSDP2 + EP (experts Shard(0) on ep, fully_shard over efsdp;
    the rest over all 4 ranks) by plain dcp.load of its DTensor state dict: max |error|."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from vescale_engine.engine.parallel_plan import apply_parallel_plan, build_meshes, check_plan
    meshes = build_meshes(ParallelSizes(WORLD, ep=2), "cpu")
    model = build(seed=7)
    apply_parallel_plan(model, check_plan(model, meshes.sizes, {}), meshes)
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=meshes.expert_dp())
    fully_shard(model, mesh=meshes.dense_dp())
    sd = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=path)  # torch's own planner and reader
    worst = 0.0
    for k, v in model.state_dict().items():
        whole = v.full_tensor() if hasattr(v, "full_tensor") else v
        worst = max(worst, (whole - full[f"model.{k}"]).abs().max().item())
    return worst


@pytest.mark.parametrize("build,parallel,micro_rows", [
    (tiny_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2}}, 1),
    (tiny_llama, {"tensor_parallel": {"autotp_size": 2}}, 2)], ids=["dp2_ep2", "dp2_tp2"])
def test_checkpoint_at_tp_ep_loads_at_dp4_one_process_and_fsdp2(pool, tmp_path, build, parallel,
                                                                  micro_rows):
    pool.run(checkpoint_across_layouts, build, parallel, micro_rows, str(tmp_path))


def test_optimizer_state_in_its_own_shape_must_be_mapped_for_tp_ep_parameters():
    """State an optimizer places in its own global shape (a RaggedPiece, e.g. per-block scales)
    of a TP/EP parameter is written only when the optimizer mapped it through the pieces'
    index maps (AdamW8bit does); an unmapped one is one line, never written as if global."""
    from types import SimpleNamespace
    from torch.distributed.tensor import Shard
    from vescale_engine.checkpoint.dcp import CheckpointError
    from vescale_engine.shard.ragged_piece import RaggedPiece
    from vescale_engine.checkpoint.entries import optimizer_entries
    p = torch.zeros(4)
    p._vescale = SimpleNamespace(dtensor_spec=SimpleNamespace(placements=(Shard(0),)))
    state = {p: {"scales": RaggedPiece(torch.zeros(2), (4,), 0)}}
    with pytest.raises(CheckpointError, match=r"optimizer state optim.state.w.scales: state in "
                                              "the optimizer's own shape is not mapped"):
        optimizer_entries(None, {id(p): ["w"]}, state)
    mapped = {p: {"scales": RaggedPiece(torch.zeros(2), (4,), 0, local_shape=(2,),
                                        index_maps=[[2, 3]])}}
    entry = optimizer_entries(None, {id(p): ["w"]}, mapped)["optim.state.w.scales"]
    assert entry is mapped[p]["scales"] and [c.offsets for c in entry.chunks()] == [(2,)]
    del p._vescale  # a plain parameter: its own-shape state is written as it is
    assert optimizer_entries(None, {id(p): ["w"]}, state)["optim.state.w.scales"] is \
        state[p]["scales"]


# -- Hugging Face files and the 16-bit state dict: the global tensors, gathered to rank 0 ----------

def hf_files_at_tp_ep(rank, world, build, parallel, micro_rows, path):
    """save_hf_checkpoint and the 16-bit state dict at (dp, tp/ep) = `parallel`: right after
    initialize they must equal the one-process model bitwise; after a step, every rank's own
    pieces must be in the file (the module-level saver) bitwise, transformers' from_pretrained
    loads it, and a dp-4 engine without TP/EP loads it back bitwise. (max |errors|, facts)"""
    import torch.distributed as dist
    import vescale_engine
    from safetensors.torch import load_file
    from vescale_engine.fsdp.lookup import sharded_parameters
    reference = build().state_dict()
    keys = config(**parallel, zero_optimization={
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    engine, *_ = vescale_engine.initialize(model=build(), config=keys)
    engine.save_hf_checkpoint(f"{path}/init", dtype="fp32")
    state = engine._zero3_consolidated_16bit_state_dict()
    out = {}
    full = vescale_engine.full_state_dict(engine.module)  # the global tensors on every rank
    alone = vescale_engine.full_state_dict(engine.module, rank0_only=True, cpu_offload=True)
    out["full"] = (sorted(full) == sorted(reference),
                   max((full[k] - v).abs().max().item() for k, v in reference.items()),
                   sorted(alone) == (sorted(reference) if rank == 0 else []))
    if rank == 0:
        saved = load_file(f"{path}/init/model.safetensors")
        out["keys"] = (sorted(saved) == sorted(reference), sorted(state) == sorted(reference))
        out["init"] = max(max((saved[k] - v).abs().max().item(), (state[k] - v).abs().max().item())
                          for k, v in reference.items())
        out["shapes"] = all(saved[k].shape == v.shape for k, v in reference.items())
    else:
        out["state"] = state  # {} off rank 0
    _steps(engine, global_batch(), micro_rows, 1)
    vescale_engine.save_hf_checkpoint(engine.module, f"{path}/step", dtype="fp32")
    dist.barrier()
    stepped = load_file(f"{path}/step/model.safetensors")
    out["own"] = max((local_piece(sp, stepped[fqn]) - sp.sharded.detach()).abs().max().item()
                     for fqn, sp in sharded_parameters(engine.module) if sp.sharded.numel())
    engine.destroy()
    if rank == 0:
        hf = type(build()).from_pretrained(f"{path}/step", dtype=torch.float32)
        out["from_pretrained"] = max((v - stepped[k]).abs().max().item()
                                     for k, v in hf.state_dict().items())
    plain, *_ = vescale_engine.initialize(model=build(seed=7), config=config())
    plain.load_hf_checkpoint(f"{path}/step")
    out["dp4"] = max((local_piece(sp, stepped[fqn]) - sp.sharded.detach()).abs().max().item()
                     for fqn, sp in sharded_parameters(plain.module) if sp.sharded.numel())
    plain.destroy()
    return out


@pytest.mark.parametrize("build,parallel,micro_rows", [
    (tiny_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2}}, 1),
    (tiny_llama, {"tensor_parallel": {"autotp_size": 2}}, 2)], ids=["dp4_ep2", "dp2_tp2"])
def test_hf_files_and_16bit_state_dict_hold_the_global_tensors(pool, tmp_path, build, parallel,
                                                                 micro_rows):
    got = pool.run(hf_files_at_tp_ep, build, parallel, micro_rows, str(tmp_path))
    assert got[0]["keys"] == (True, True) and got[0]["shapes"], got[0]
    assert got[0]["init"] == 0.0, got[0]  # the one-process model, bitwise
    assert [r["full"] for r in got] == [(True, 0.0, True)] * WORLD  # full_state_dict too
    assert got[0]["from_pretrained"] == 0.0, got[0]
    for rank, out in enumerate(got):
        assert out["own"] == 0.0 and out["dp4"] == 0.0, (rank, out)
        if rank:
            assert out["state"] == {}


# --- precision, accumulation and offload under TP/EP (s4-compose)

FP16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}


def fp16_reference_run(model, ids, steps, scale, dtype=torch.float16):
    """One process in fp16 (or bf16: `dtype`, scale 1) as the engine computes it: fp32 master
    weights (torch's AdamW) cast to a 16-bit copy for forward and backward, the fp32 loss times
    the static `scale`, the 16-bit gradients unscaled in fp32. (losses, gradient norms)"""
    import copy
    half = copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for _ in range(steps):
        with torch.no_grad():
            for p, h in zip(model.parameters(), half.parameters()):
                h.copy_(p)
        loss = half(input_ids=ids, labels=ids).loss
        (loss.float() * scale).backward()
        for p, h in zip(model.parameters(), half.parameters()):
            p.grad = h.grad.float() / scale
            h.grad = None
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _poisoned_step(engine, ids, micro_rows, pick):
    """One step whose gradients hold an inf on rank 0 only, in the piece `pick` chooses (after
    backward, before step): (parameters unchanged, loss scale, skipped steps, overflow flag)."""
    import torch.distributed as dist
    from vescale_engine.fsdp.lookup import sharded_parameters
    before = [p.detach().clone() for p in engine.module.parameters()]
    mine = ids[engine.dp_rank * micro_rows:(engine.dp_rank + 1) * micro_rows]
    engine.backward(engine(input_ids=mine, labels=mine).loss)
    planted = None
    if dist.get_rank() == 0:
        fqn, sp = next((fqn, sp) for fqn, sp in sharded_parameters(engine.module)
                       if pick(sp) and sp.sharded.grad is not None and sp.sharded.numel())
        sp.sharded.grad[0] = float("inf")
        planted = fqn
    engine.step()
    unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, engine.module.parameters()))
    return dict(unchanged=unchanged, scale=engine.loss_scaler.loss_scale,
                skipped=engine.skipped_steps, overflow=engine.optimizer.overflow,
                planted=planted)


def fp16_against_one_process(rank, world, build, keys, micro_rows, pick):
    """3 fp16 steps at a TP/EP layout against one process's fp16 on the same global batch
    (max relative loss error, max relative gradient-norm error, skipped steps), then a step
    with an inf planted on rank 0's piece that `pick` chooses: skipped everywhere, the scale halved everywhere."""
    import torch.distributed as dist
    import vescale_engine
    ids = global_batch()
    want, want_norms = fp16_reference_run(build(), ids, 3, 2.0 ** FP16["initial_scale_power"])
    engine, *_ = vescale_engine.initialize(model=build(), config=config(fp16=FP16, **keys))
    got, norms = [], []
    for _ in range(3):
        got += _steps(engine, ids, micro_rows, 1)
        norms.append(engine.get_global_grad_norm())
    skipped = engine.skipped_steps
    poisoned = _poisoned_step(engine, ids, micro_rows, pick)
    engine.destroy()
    dist.barrier()
    return (max(abs(a - b) / b for a, b in zip(got, want)),
            max(abs(a - b) / b for a, b in zip(norms, want_norms)), skipped, poisoned)


def _tp_replicated(sp):
    return sp.dtensor_spec is None  # a TP peer holds the same tensor (the norms' weights)


def _expert_piece(sp):
    return sp.dtensor_spec is not None


@pytest.mark.parametrize("build,keys,micro_rows,pick", [
    (tiny_llama, {"tensor_parallel": {"autotp_size": 2}}, 2, _tp_replicated),
    (tiny_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2},
                    "vescale": {"hsdp_replicate_size": 2}}, 1, _expert_piece)],
    ids=["dp2_tp2_llama", "hsdp2x2_ep2_mixtral"])
def test_fp16_under_tp_ep_equals_one_process_and_overflow_is_agreed(pool, build, keys,
                                                                     micro_rows, pick):
    """An inf on one rank reaches every rank's decision: on a TP-replicated tensor the norm's
    all-reduces span only its data-parallel group, on an expert piece under HSDP only (efsdp 1,
    ep); the world-wide overflow flag makes all 4 ranks skip and halve the scale."""
    got = pool.run(fp16_against_one_process, build, keys, micro_rows, pick)
    for rank, (loss_err, norm_err, skipped, poisoned) in enumerate(got):
        assert skipped == 0, (rank, skipped)
        # The same fp16 model, its sums in another order (TP partial sums, the data-parallel
        # reduction in fp16): each gradient element is an fp16 value, off by at most a few
        # roundings of 2^-11, so the norm is within one fp16 ulp (2^-10 ~ 1e-3; measured 8.5e-5
        # TP, 3.0e-5 EP), and a wrong divisor (2x) or a lost piece fails it. AdamW's update is
        # normalized: the losses move far less (measured 4.2e-6 and 1.0e-6 relative).
        assert norm_err < 1e-3, (rank, norm_err)
        assert loss_err < 5e-5, (rank, loss_err)
        assert poisoned["unchanged"] and poisoned["overflow"], (rank, poisoned)
        assert (poisoned["scale"], poisoned["skipped"]) == (128.0, 1), (rank, poisoned)
    assert got[0][3]["planted"] is not None


def accumulation_and_bf16(rank, world, build, keys, dp):
    """Through initialize at a TP/EP layout, against one process on the same global batch:
    (a) fp32 with gradient_accumulation_steps 2 (a micro-batch of one row, 2 per data-parallel
    rank per step): max |loss error|, max |parameter error| after 3 steps, max relative norm
    error; (b) bf16, the same global batch in one micro-batch per rank: the same errors against
    one process's bf16."""
    import torch.distributed as dist
    import vescale_engine
    from vescale_engine.fsdp.lookup import sharded_parameters
    steps, gas = 3, 2
    ids = global_batch(rows=dp * gas)
    out = {}
    for name, extra in (("accumulate", {"gradient_accumulation_steps": gas,
                                        "train_micro_batch_size_per_gpu": 1}),
                        ("bf16", {"bf16": {"enabled": True}})):
        reference = build()
        if name == "bf16":
            want, want_norms = fp16_reference_run(reference, ids, steps, 1.0, torch.bfloat16)
        else:
            want, want_norms = reference_run(reference, ids, steps=steps)
        ref = dict(reference.named_parameters())
        engine, *_ = vescale_engine.initialize(
            model=build(), config=config(train_batch_size=dp * gas, **keys, **extra))
        micro = engine.train_micro_batch_size_per_gpu()
        mine = ids[engine.dp_rank * gas:(engine.dp_rank + 1) * gas]
        losses, norms = [], []
        for _ in range(steps):
            total = torch.zeros(())
            for k in range(engine.gradient_accumulation_steps()):
                rows = mine[k * micro:(k + 1) * micro]
                loss = engine(input_ids=rows, labels=rows).loss
                engine.backward(loss)
                engine.step()
                total += loss.detach().float()
            dist.all_reduce(total)  # TP peers add the same loss: the mean over dp ranks holds
            losses.append(total.item() / (world * engine.gradient_accumulation_steps()))
            norms.append(engine.get_global_grad_norm())
        params = max((local_piece(sp, ref[fqn]) - sp.sharded.detach()).abs().max().item()
                     for fqn, sp in sharded_parameters(engine.module) if sp.sharded.numel())
        out[name] = dict(loss=max(abs(a - b) for a, b in zip(losses, want)),
                         rel_loss=max(abs(a - b) / b for a, b in zip(losses, want)),
                         norm=max(abs(a - b) / b for a, b in zip(norms, want_norms)),
                         params=params, gas=engine.gradient_accumulation_steps(), micro=micro,
                         compute=engine.engine_config.precision.param_dtype)
        engine.destroy()
    acc, bf16 = out["accumulate"], out["bf16"]
    assert (acc["gas"], acc["micro"], bf16["gas"], bf16["micro"]) == (2, 1, 1, 2), out
    assert acc["loss"] < 1e-6 and acc["params"] < 1e-6, (rank, acc)
    assert acc["norm"] < 1e-5, (rank, acc)  # measured 1.1e-7 (TP), 7.8e-8 (EP)
    # bf16 against one process's bf16: each gradient element is a bf16 value, a few
    # roundings of 2^-8 off, so the norm is within one bf16 ulp (2^-7 ~ 7.8e-3; measured
    # 3.2e-4 TP, 2.3e-4 EP) and the losses within 1e-4 relative (measured 5.5e-6, 3.5e-6).
    # Parameters are not compared: AdamW's first steps move each by ~lr * sign(gradient),
    # and a near-zero gradient's sign differs by rounding (measured up to 2 lr).
    assert (acc["compute"], bf16["compute"]) == (None, "bfloat16"), out
    assert bf16["norm"] < 2.0 ** -7 and bf16["rel_loss"] < 1e-4, (rank, bf16)


LLAMA_TP2 = (tiny_llama, {"tensor_parallel": {"autotp_size": 2}})
MIXTRAL_EP2 = (tiny_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2}})


@pytest.mark.parametrize("build,keys,dp", [(*LLAMA_TP2, 2), (*MIXTRAL_EP2, 4)],
                         ids=["dp2_tp2_llama", "dp4_ep2_mixtral"])
def test_accumulation_and_bf16_under_tp_ep_equal_one_process(pool, build, keys, dp):
    pool.run(accumulation_and_bf16, build, keys, dp)


def offload_against_device(rank, world, build, keys, micro_rows):
    """The same 3 clipped steps without offload, with offload_optimizer (ratio 1) and with half
    the buffers offloaded (ratio 0.5: host and device buffers in one norm): per variant the
    losses, norms, final shards and how many buffers stepped on the host."""
    import vescale_engine
    ids = global_batch()
    out = {}
    for name, offload in (("device", None), ("host", {"ratio": 1.0}),
                          ("half", {"ratio": 0.5})):
        zero = {} if offload is None else {"zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", **offload}}}
        engine, *_ = vescale_engine.initialize(
            model=build(), config=config(gradient_clipping=0.05, **keys, **zero))
        losses, norms = [], []
        for _ in range(3):
            losses += _steps(engine, ids, micro_rows, 1)
            norms.append(engine.get_global_grad_norm())
        off = getattr(engine.optimizer, "offload", None)
        buffers = {id(p._vescale.buffer): p._vescale.buffer
                   for p in engine.module.parameters()}.values()
        out[name] = dict(losses=losses, norms=norms,
                         shards={n: p.detach().clone()
                                 for n, p in engine.module.named_parameters()},
                         host=None if off is None else sum(off.offloads(b) for b in buffers),
                         buffers=len(buffers), host_steps=None if off is None else
                         off.stats.host_steps)
        engine.destroy()
    want = out["device"]
    assert out["host"]["host"] == want["buffers"], (rank, out["host"]["host"])
    assert 0 < out["half"]["host"] < want["buffers"], (rank, out["half"]["host"])
    for variant in ("host", "half"):
        got_v = out[variant]
        assert got_v["losses"] == want["losses"], (rank, variant, got_v["losses"])
        assert got_v["norms"] == want["norms"], (rank, variant, got_v["norms"])
        assert got_v["host_steps"] == 3 * got_v["host"], (rank, variant)
        for n, v in want["shards"].items():
            assert torch.equal(got_v["shards"][n], v), (rank, variant, n)


@pytest.mark.parametrize("build,keys,micro_rows", [(*LLAMA_TP2, 2), (*MIXTRAL_EP2, 1)],
                         ids=["dp2_tp2_llama", "dp4_ep2_mixtral"])
def test_offload_under_tp_ep_matches_no_offload_bitwise(pool, build, keys, micro_rows):
    """ZeRO-Offload steps TP/EP pieces on the host with the device path's kernel, and the
    clipping norm reads host and device gradient shards over the same TP/EP-aware groups: the
    losses, norms and every parameter shard equal the run without offload bitwise."""
    pool.run(offload_against_device, build, keys, micro_rows)


class _LocalExperts(torch.nn.Module):
    """Fused experts that call to_local() on their DTensor weights at the top of forward, as
    transformers' EP kernels and torchtitan's grouped experts do; `note` hears when the
    gradient reaches the first matmul's output (after the second matmul's backward)."""

    def __init__(self, experts, note):
        super().__init__()
        torch.manual_seed(3)
        self.w1 = torch.nn.Parameter(torch.randn(experts, 8, 4))
        self.w2 = torch.nn.Parameter(torch.randn(experts, 4, 4))
        self.note = note

    def forward(self, x):
        w1, w2 = self.w1.to_local(), self.w2.to_local()
        h = torch.bmm(x, w1.transpose(1, 2))
        if h.requires_grad:
            h.register_hook(lambda g: self.note.append("gradient at h"))
        gate, up = h.chunk(2, dim=-1)
        return torch.bmm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2))


def expert_gradients_land_early(rank, world):
    """Experts Shard(0) over ep 2, fully_shard over efsdp 2: the order of events in backward
    (each weight's gradient landing in the buffer, the gradient reaching h) and the gradients
    against plain autograd on the same local experts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from vescale_engine.fsdp import fully_shard
    from vescale_engine.fsdp.lookup import sharded_parameters
    from vescale_engine.shard.ragged_dtensor import local_of
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    events = []
    model = _LocalExperts(4, events)
    plain = _LocalExperts(4, [])
    for m in (model, plain):
        for name in ("w1", "w2"):
            full = getattr(m, name).detach()
            setattr(m, name, torch.nn.Parameter(distribute_tensor(full, mesh["ep"], [Shard(0)])))
    fully_shard(model, mesh=mesh["efsdp"])
    for fqn, sp in sharded_parameters(model):
        real = sp.buffer.unreduced.grad_arrived

        def landed(i, t, *rest, _fqn=fqn, _real=real, _index=sp.index):
            if i == _index and _fqn not in events:
                events.append(_fqn)
            return _real(i, t, *rest)
        sp.buffer.unreduced.grad_arrived = landed
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(5 + rank))
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    errors = {}
    for fqn, sp in sharded_parameters(model):
        want = getattr(plain, fqn).grad.to_local()
        summed = want.clone()
        dist.all_reduce(summed, group=mesh["efsdp"].get_group())  # over efsdp, then / 2
        begin, end = sp.flat_range
        if end > begin:
            errors[fqn] = (local_of(sp.sharded.grad) - (summed / 2).reshape(-1)[begin:end]
                           ).abs().max().item()
    assert events == ["w2", "gradient at h", "w1"], (rank, events)
    assert errors and max(errors.values()) < 1e-6, (rank, errors)


def test_expert_gradients_land_in_the_buffer_before_the_next_is_computed(pool):
    """to_local() of a DTensor face hands out a leaf over the buffer view (fsdp/dtensor_params
    LocalLeafRoute): w2's gradient lands in the buffer before the first matmul's backward
    computes w1's, so the two never live at once beside the gathered experts (the memory
    benchmark's peak); with DTensor's own to_local both landed after the last matmul."""
    pool.run(expert_gradients_land_early)

# --- meta-device models and HF weights under TP/EP (s4-meta)

META_STEPS = 3


def on_meta(build, seed):
    """`build(seed)` on the meta device: no storage, no draws (the generator is left seeded)."""
    with torch.device("meta"):
        return build(seed)


def _piece_errors(engine, want):
    """(max |piece - want's local piece| over the engine's parameters, pieces compared, pieces
    of TP/EP-split tensors among them, this rank's own parameter bytes)."""
    from vescale_engine.fsdp.lookup import sharded_parameters
    worst, compared, split, own = 0.0, 0, 0, 0
    for fqn, sp in sharded_parameters(engine.module):
        own += sp.sharded.numel() * sp.sharded.element_size()
        if sp.sharded.numel():
            worst = max(worst, (local_piece(sp, want[fqn]) - sp.sharded.detach()).abs().max()
                        .item())
            compared += 1
            split += sp.dtensor_spec is not None
    return worst, compared, split, own


def _sent_to_rank0(fn):
    """Run `fn()` counting the tensor bytes this rank sends to rank 0 through dist.gather (its
    contribution) and dist.send: what gather_to_rank0 moves."""
    from unittest import mock
    import torch.distributed as dist
    sent = [0]
    gather, send = dist.gather, dist.send

    def counting_gather(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return gather(tensor, *args, **kwargs)

    def counting_send(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return send(tensor, *args, **kwargs)
    with mock.patch.object(dist, "gather", counting_gather), \
            mock.patch.object(dist, "send", counting_send):
        fn()
    return sent[0]


def meta_models_and_hf_weights(rank, world, build, parallel, micro_rows, path):
    """At (dp, tp/ep) = `parallel`, through initialize:
    - a model built on meta: every piece bitwise the one-process build's with the same seed,
      then META_STEPS steps against one process on the same global batch;
    - vescale.hf_checkpoint into a model built on meta (another seed), and from_pretrained under
      a vescale ZeRO-3 HfDeepSpeedConfig: bitwise the file, each rank reading its own bytes;
      from_config there: bitwise transformers' initialize_weights in one process;
    - save_hf_checkpoint with HSDP (replicate 2): the file bitwise the one-process model, and
      only one replica's bytes sent to rank 0."""
    from unittest import mock
    import torch.distributed as dist
    import vescale_engine
    from safetensors.torch import load_file
    from vescale_engine.engine import weights
    from vescale_engine.fsdp.lookup import units_under
    from test_hf_zero_init import hf_config, record_of
    out = {}
    ids = global_batch()
    reference = build(3)
    want = {k: v.detach().clone() for k, v in reference.named_parameters()}
    want_losses, _ = reference_run(reference, ids, steps=META_STEPS)
    trained = dict(reference.named_parameters())

    from vescale_engine.fsdp import materialize
    scratch, make = [], materialize._Initializer._make_scratch

    def recorded(self):  # the full-size tensors materialize inits into, one module at a time
        made = make(self)
        scratch.append(sum(t.numel() for t in made.values()))
        return made
    with mock.patch.object(materialize._Initializer, "_make_scratch", recorded):
        engine, *_ = vescale_engine.initialize(model=on_meta(build, 3),
                                               config=config(**parallel))
    out["init"] = _piece_errors(engine, want)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False))
                  for m in reference.modules())
    out["scratch"] = (scratch, largest, sum(p.numel() for p in reference.parameters()))
    losses = _steps(engine, ids, micro_rows, META_STEPS)
    out["train"] = (max(abs(a - b) for a, b in zip(losses, want_losses)),
                    _piece_errors(engine, trained)[0])
    engine.destroy()
    if build is tiny_llama:  # our own plan (torch's parallelize_module) on meta too
        torch.manual_seed(3)
        engine, *_ = vescale_engine.initialize(model=on_meta(build, 3), config=config(
            **parallel, vescale={"tensor_parallel": OUR_PLAN}))
        out["our_plan"] = _piece_errors(engine, want)
        engine.destroy()

    files = f"{path}/hf"
    if rank == 0:
        build(3).save_pretrained(files, save_original_format=False)
    dist.barrier()
    stored = load_file(f"{files}/model.safetensors")
    loads = []

    def spy(*args, **kwargs):
        loads.append(weights_load_into(*args, **kwargs))
        return loads[-1]
    weights_load_into = weights.load_into
    with mock.patch.object(weights, "load_into", spy):
        engine, *_ = vescale_engine.initialize(model=on_meta(build, 5), config=config(
            **parallel, vescale={"hf_checkpoint": files}))
    worst, compared, _, own = _piece_errors(engine, stored)
    out["hf_checkpoint"] = (worst, compared, loads[0].bytes_read, own)
    engine.destroy()

    vescale_engine.patch_deepspeed()
    zero3 = config(**parallel, zero_optimization={"stage": 3}, vescale={})
    with hf_config(zero3):
        model = type(reference).from_pretrained(files, dtype=torch.float32)
    on = {p.device.type for p in model.parameters()}
    engine, *_ = vescale_engine.initialize(model=model, config=zero3)
    worst, compared, _, own = _piece_errors(engine, stored)
    out["from_pretrained"] = (on, worst, compared,
                              record_of(engine.module).loaded.bytes_read, own)
    engine.destroy()
    # from_config: transformers' initialize_weights (DeepSpeed's from_config), one process
    from transformers import AutoModelForCausalLM, initialization
    torch.manual_seed(11)
    with torch.device("meta"), initialization.no_init_weights():
        one = type(reference)(reference.config)
    one.to_empty(device="cpu")
    one.initialize_weights()
    torch.manual_seed(11)
    with hf_config(zero3):
        model = AutoModelForCausalLM.from_config(reference.config)
    engine, *_ = vescale_engine.initialize(model=model, config=zero3)
    out["from_config"] = _piece_errors(engine, dict(one.named_parameters()))
    engine.destroy()

    hsdp = config(**parallel, vescale={"hsdp_replicate_size": 2})
    engine, *_ = vescale_engine.initialize(model=build(3), config=hsdp)
    sent = _sent_to_rank0(lambda: engine.save_hf_checkpoint(f"{path}/hsdp", dtype="fp32"))
    replica = engine.meshes.dense["dp_replicate"].get_local_rank()
    master = sum(b.master.numel() * b.master.element_size()
                 for u in units_under(engine.module) for b in u.buffers)
    engine.destroy()
    dist.barrier()
    saved = load_file(f"{path}/hsdp/model.safetensors")
    one_process = build(3).state_dict()
    out["hsdp"] = (sorted(saved) == sorted(one_process),
                   max((saved[k] - v).abs().max().item() for k, v in one_process.items()),
                   sent, master, replica)
    return out


@pytest.mark.parametrize("build,parallel,micro_rows", [
    (tiny_llama, {"tensor_parallel": {"autotp_size": 2}}, 2),
    (tiny_mixtral, {"expert_parallel": {"enabled": True, "autoep_size": 2}}, 1)],
    ids=["dp2_tp2_llama", "dp4_ep2_mixtral"])
def test_meta_models_random_init_hf_weights_and_hsdp_save_under_tp_ep(pool, tmp_path, build,
                                                                     parallel, micro_rows):
    got = pool.run(meta_models_and_hf_weights, build, parallel, micro_rows, str(tmp_path))
    # materialize: each tensor drawn at its global shape, this rank's TP/EP piece kept
    assert all(out["init"][0] == 0.0 and out["init"][1] >= 8 and out["init"][2] > 0
               for out in got), [out["init"] for out in got]
    for rank, out in enumerate(got):
        # peak: one module's own tensors at their global shape, never the model's
        scratch, largest, total = out["scratch"]
        assert scratch == [largest] and largest < total / 2, out["scratch"]
        assert out["train"][0] < 1e-6 and out["train"][1] < 1e-6, (rank, out["train"])
        if "our_plan" in out:
            assert out["our_plan"][0] == 0.0 and out["our_plan"][2] > 0, (rank, out["our_plan"])
        worst, compared, read, own = out["hf_checkpoint"]
        assert worst == 0.0 and compared >= 8 and read == own, (rank, out["hf_checkpoint"])
        on, worst, compared, read, own = out["from_pretrained"]
        assert on == {"meta"} and worst == 0.0 and compared >= 8 and read == own, (rank, out)
        worst, compared, split, _ = out["from_config"]
        assert worst == 0.0 and compared >= 8 and split > 0, (rank, out["from_config"])
        same_keys, err, *_ = out["hsdp"]
        assert same_keys and err == 0.0, (rank, out["hsdp"])
    # HSDP: the second replica sends nothing; the first sends at most its own shards
    replica0 = sum(out["hsdp"][3] for out in got[1:] if out["hsdp"][4] == 0)
    sent = [out["hsdp"][2] for out in got]
    assert all(s == 0 for out, s in zip(got, sent) if out["hsdp"][4] == 1), sent
    assert 0 < sum(sent[1:]) <= replica0, (sent, replica0)


def local_pieces_of_global(rank, world):
    """dtensor_params.local_of_global (what materialize keeps of a global init) against
    DTensor's own local tensors, for Shard on dims 0 and 1, _StridedShard (transformers' packed
    gate/up) and FSDP2's 2-D expert placement: each equal, and a view."""
    from torch.distributed.tensor import distribute_tensor
    from vescale_engine.fsdp.dtensor_params import local_of_global
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    out = []
    for sub, placements in tp_ep_placements():
        mine = local_of_global(full, distribute_tensor(full, sub, placements)._spec)
        out.append((str(placements), torch.equal(mine, distribute_tensor(
            full, sub, placements).to_local()),
            mine.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()))
    assert all(equal for _, equal, _ in out), out
    assert [view for *_, view in out][:4] == [True, True, False, False], out  # Shard:
    # a view of the global tensor; _StridedShard: a copy of its segments


def test_local_piece_of_a_global_tensor_is_dtensors_local_tensor(pool):
    pool.run(local_pieces_of_global)


def rank_seeded_meta(rank, world):
    """Meta models seeded per rank (seed + rank): with TP (replicated norms and biases drawn by
    each TP peer) initialize refuses on every rank; with data parallelism alone every element
    is drawn on one rank, so it goes on."""
    import vescale_engine
    from dist_harness import value_errors
    seeded = lambda: on_meta(tiny_llama, 100 + rank)  # noqa: E731
    errors = value_errors([lambda: vescale_engine.initialize(
        model=seeded(), config=config(tensor_parallel={"autotp_size": 2}))])
    engine, *_ = vescale_engine.initialize(model=seeded(), config=config())
    engine.destroy()
    assert errors[0].startswith("random init of a meta model with replicated tensors "
                                "(tensor_parallel.autotp_size 2"), errors
    assert "rank(s) [1, 2, 3] differ from rank 0" in errors[0], errors


def test_meta_init_with_replicas_needs_one_random_state(pool):
    pool.run(rank_seeded_meta)
