"""Quantized weight all-gathers (`zero_quantized_weights`, DeepSpeed ZeRO++'s qwZ): each rank
quantizes its own shard in int8 groups with one fp32 scale each, payload and scales are
all-gathered, every rank dequantizes every shard.

Checked: the dequantized values equal a one-process reference that quantizes each tensor by
its own groups, bit for bit, at several world sizes (so a group's scale never depends on where
a shard boundary falls); training the example GPT on Tiny Shakespeare for 300 steps on 2 gloo
ranks ends within 1%
of the unquantized run's loss with no step diverging; the all-gathers move at most 0.55x the
bytes of bf16; master weights and saved state stay exact; bad settings are one-line errors.
"""
import os

import pytest
import torch

import fsdp_models as fm
from dist_harness import rank_pools

GLOBAL = 8
STEPS = 300
SEQ = 16  # the example GPT's positions
TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                    "data", "tinyshakespeare.txt")


def shakespeare():
    """Tiny Shakespeare as character ids (65 of them: the GPT's 96-token vocabulary holds
    them): something the model learns, so that the loss curves say how training went."""
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def train_text(engine, rank, world, steps, data):
    """`steps` steps on global batches of GLOBAL sequences drawn by step; this rank takes its
    slice; the mean loss over ranks per step."""
    import torch.distributed as dist
    losses = []
    for step in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (GLOBAL,),
                               generator=torch.Generator().manual_seed(step))
        rows = torch.stack([data[s:s + SEQ + 1] for s in starts])
        mine = rows[rank * GLOBAL // world:(rank + 1) * GLOBAL // world]
        loss = engine(mine[:, :-1].contiguous(), mine[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def reference(tensor: torch.Tensor, block: int, group: int) -> torch.Tensor:
    """One process, one tensor: every block cut into groups of `group` elements from its
    start, each quantized on its own (scale = max|x| / 127), then dequantized."""
    flat = tensor.detach().float().flatten()
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), block):
        end = min(start + block, flat.numel())
        for a in range(start, end, group):
            chunk = flat[a:min(a + group, end)]
            amax = chunk.abs().max()
            scale = amax / 127.0 if amax > 0 else torch.tensor(1.0)
            q = torch.round(chunk / scale).clamp(-127, 127).to(torch.int8)
            out[a:a + chunk.numel()] = q * scale
    return out


def gathered_by_layout(tensors: dict, world: int, group: int, granularity: str):
    """Plan `tensors` for `world` ranks as a quantized unit does, quantize each rank's shard
    on its own, then dequantize every shard: {name: dequantized tensor} (no collectives: the
    shards are concatenated as the all-gather would)."""
    from vescale_engine.plan.granularity import parse_granularity
    from vescale_engine.plan.planner import TensorSpec, plan_unit
    from vescale_engine.plan.quantization import quantization_block
    from vescale_engine.shard.quantize import GroupLayout, dequantize, quantize
    policy = parse_granularity(granularity)
    specs = tuple(TensorSpec(n, tuple(t.shape), min(t.numel(), quantization_block(
        policy.block_size(t.shape), group))) for n, t in tensors.items())
    out, blocks = {}, {s.name: s.block for s in specs}
    for layout in plan_unit(specs, world, align=4).buffers:
        S = layout.shard_size
        flat = torch.zeros(world * S)
        for p in layout.placements:
            flat[p.offset:p.offset + p.numel] = tensors[p.name].flatten()
        groups = GroupLayout(layout, group)
        q_all, scales_all = zip(*(quantize(flat[r * S:(r + 1) * S], groups.lengths[r],
                                           groups.max_groups) for r in range(world)))
        full = torch.empty(world * S)
        dequantize(full, torch.cat(q_all), torch.cat(scales_all), groups.padded)
        for p in layout.placements:
            out[p.name] = full[p.offset:p.offset + p.numel]
    return out, blocks


@pytest.mark.parametrize("granularity,group", [("rows:1", 256), ("rows:1", 32),
                                               ("element", 64), ("tensor", 100)])
def test_dequantized_values_equal_a_one_process_reference_at_every_world_size(granularity,
                                                                              group):
    gen = torch.Generator().manual_seed(0)
    tensors = {"wte": torch.randn(96, 48, generator=gen),
               "fc": torch.randn(80, 48, generator=gen) * 0.02,
               "proj": torch.randn(48, 80, generator=gen),
               "bias": torch.randn(80, generator=gen),
               "norm": torch.ones(48),
               "zeros": torch.zeros(7, 5),
               "odd": torch.randn(13, 7, generator=gen) * 1e3}
    seen = None
    for world in (1, 2, 3, 5, 8):
        got, blocks = gathered_by_layout(tensors, world, group, granularity)
        for name, t in tensors.items():
            want = reference(t, blocks[name], group)
            assert torch.equal(got[name], want), (world, name)
            # a group's scale is its own: the error is at most half a step of its scale
            assert (got[name] - t.flatten()).abs().max() <= t.abs().max() / 254 * 1.0001
        if seen is not None:  # other shard boundaries, the same values
            assert all(torch.equal(got[n], seen[n]) for n in tensors)
        seen = got


WEIGHTS, GRADIENTS, BOTH = ("zero_quantized_weights",), ("zero_quantized_gradients",), \
    ("zero_quantized_weights", "zero_quantized_gradients")


def test_runs_of_groups_give_the_whole_buffers_values():
    """The loops work through runs of whole groups (bounded temporaries): any run length gives
    the same bits as one run, zero-length and over-long groups included."""
    from vescale_engine.shard.quantize import _chunks, dequantize, dequantize_sum, quantize
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([256] * 40 + [0, 5, 300, 0, 17])
    x = torch.randn(int(lengths.sum()), generator=gen)
    whole = quantize(x, lengths, 60)
    runs = _chunks(lengths, 700)
    assert len(runs) > 10 and quantize(x, lengths, 60, runs)[0].equal(whole[0])
    out, chunked = torch.empty_like(x), torch.empty_like(x)
    dequantize(out, *whole, lengths)
    dequantize(chunked, *whole, lengths, runs)
    assert torch.equal(out, chunked)
    senders = torch.cat([whole[0]] * 3), torch.cat([whole[1]] * 3)
    total, total_chunked = torch.empty_like(x), torch.empty_like(x)
    dequantize_sum(total, *senders, lengths, 60)
    dequantize_sum(total_chunked, *senders, lengths, 60, runs)
    assert torch.equal(total, chunked * 3) and torch.equal(total_chunked, total)


def config(quantized: tuple, group=None, bf16=True):
    """The example GPT's config with the ZeRO++ keys in `quantized` set."""
    cfg = {"train_batch_size": GLOBAL, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "bf16": {"enabled": bf16}, "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": 3, **{key: True for key in quantized}},
           "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}
    if group is not None:
        cfg["vescale"]["quantization_group_size"] = group
    return cfg


def train_run(rank, world, quantized, steps, lr=1e-3, bf16=True):
    """Losses per step, bytes all-gathered and reduce-scattered per step, and the state dict
    before and after, for the example GPT on `world` ranks."""
    from vescale_engine import initialize
    from vescale_engine.fsdp import full_state_dict
    from vescale_engine.shard.dbuffer import STATS
    cfg = config(quantized, bf16=bf16)
    cfg["optimizer"]["params"].update(lr=lr, weight_decay=0.0)
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    before = full_state_dict(engine.module)
    STATS.reset()
    losses = train_text(engine, rank, world, steps, shakespeare())
    gathered, reduced = STATS.bytes_gathered / steps, STATS.bytes_reduced / steps
    after = full_state_dict(engine.module)
    engine.destroy()
    return {"losses": losses, "gathered": gathered, "reduced": reduced, "before": before,
            "after": after}


@pytest.fixture(scope="module")
def pools():
    with rank_pools() as get:
        yield get


@pytest.fixture(scope="module")
def plain(pools):
    return pools(2).run(train_run, (), STEPS)[0]


@pytest.mark.parametrize("quantized", [WEIGHTS, GRADIENTS, BOTH],
                         ids=["weights", "gradients", "both"])
def test_training_with_quantized_communication_ends_within_one_percent(pools, plain,
                                                                       quantized):
    quant = pools(2).run(train_run, quantized, STEPS)[0]
    final = lambda r: sum(r["losses"][-20:]) / 20  # noqa: E731
    assert final(plain) < 0.75 * plain["losses"][0]  # it learned: the comparison means something
    assert abs(final(quant) - final(plain)) <= 0.01 * final(plain), (final(quant), final(plain))
    worst = max(abs(a - b) / b for a, b in zip(quant["losses"], plain["losses"]))
    assert worst < 0.05, worst  # no step diverges
    assert quant["losses"] != plain["losses"]  # the quantized collectives were used
    weights = quant["gathered"] / plain["gathered"]  # against bf16 all-gathers
    grads = quant["reduced"] / plain["reduced"]  # and bf16 reduce-scatters
    assert weights <= 0.55 if "zero_quantized_weights" in quantized else weights == 1.0
    assert grads <= 0.55 if "zero_quantized_gradients" in quantized else grads == 1.0


def test_master_weights_and_saved_state_never_see_quantized_values(pools):
    """lr 0: the steps change nothing, so the exact initial weights must come back (fp32:
    the losses show the quantized forward, which bf16's rounding of the loss may hide)."""
    run = pools(2).run(train_run, BOTH, 2, 0.0, False)[0]
    assert run["before"].keys() == run["after"].keys()
    for name, value in run["before"].items():
        assert torch.equal(run["after"][name], value), name
    plain = pools(2).run(train_run, (), 2, 0.0, False)[0]
    assert run["losses"] != plain["losses"]  # while the forward did compute quantized


def test_the_benchmark_runs_and_reports_bytes_and_losses(tmp_path):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "quantized_comm.md"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "quantized_comm.py"),
                    "--layers", "1", "--dim", "64", "--seq", "16", "--rounds", "1", "--steps",
                    "3", "--out", str(out)], check=True, capture_output=True, timeout=600)
    report = out.read_text()
    rows = {line.split(" | ")[0]: line for line in report.splitlines() if line.startswith("| ")}
    assert "(0.5" in rows["| zero_quantized_weights"].split(" | ")[2]  # about half the bytes
    assert "(0.5" in rows["| zero_quantized_gradients"].split(" | ")[3]


def test_settings_that_cannot_act_are_one_line_errors():
    from config_schemas.validate import ConfigError
    from vescale_engine.engine.config import build_config
    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="zero_quantized_weights acts at stage 3 only "
                                          r"\(DeepSpeed ignores it at stage 2\)"):
        build_config({**base, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
                     2)
    with pytest.raises(ConfigError, match="zero_quantized_gradients acts at stage 3 only"):
        build_config({**base, "zero_optimization": {"stage": 1,
                                                    "zero_quantized_gradients": True}}, 2)
    with pytest.raises(ConfigError, match="quantization_group_size"):
        build_config({**base, "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
                      "vescale": {"quantization_group_size": 0}}, 2)
    got = build_config({**base, "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
                        "vescale": {"quantization_group_size": 64}}, 2)
    assert got.quantized_weights and got.quantization_group == 64 and not got.not_acted_on
    with pytest.raises(ConfigError, match="zero_quantized_gradients with tensor parallelism "
                                          "is not supported yet"):
        build_config({**base, "zero_optimization": {"stage": 3,
                                                    "zero_quantized_gradients": True},
                      "tensor_parallel": {"autotp_size": 2}}, 4)
    hpz = {"stage": 3, "zero_hpz_partition_size": 2}
    with pytest.raises(ConfigError, match="zero_hpz_partition_size 2 with "
                                          "vescale.hsdp_replicate_size is not supported yet"):
        build_config({**base, "zero_optimization": hpz,
                      "vescale": {"hsdp_replicate_size": 2}}, 4)
    with pytest.raises(ConfigError, match="zero_hpz_partition_size 4 does not divide the 6"):
        build_config({**base, "zero_optimization": {**hpz, "zero_hpz_partition_size": 4}}, 6)
    assert build_config({**base, "zero_optimization": hpz}, 4).hpz_partition_size == 2
    assert build_config({**base, "zero_optimization": {**hpz, "zero_hpz_partition_size": 0}},
                        4).hpz_partition_size == 1  # DeepSpeed's off


def hpz_run(rank, world, hpz, quantized, steps=4):
    """Losses, the final weights (rank 0), the hpZ all-gathers and their group's ranks."""
    import torch.distributed as dist
    from vescale_engine import initialize
    from vescale_engine.fsdp import full_state_dict
    from vescale_engine.fsdp.lookup import units_under
    from vescale_engine.shard.dbuffer import STATS
    cfg = config(quantized, bf16=False)
    cfg["zero_optimization"]["zero_hpz_partition_size"] = hpz
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    STATS.reset()
    STATS.record = True
    try:
        losses = train_text(engine, rank, world, steps, shakespeare())
    finally:
        STATS.record = False
    kinds = [event[0] for event in STATS.events if event[0].startswith("all_gather")]
    groups = {tuple(dist.get_process_group_ranks(b.hpz_group))
              for u in units_under(engine.module) for b in u.buffers if b.hpz_group is not None}
    # the secondary copies: 1/N of each full buffer that backward gathers again (not the root's)
    copies = {"root": [], "others": []}
    for u in units_under(engine.module):
        for b in u.buffers:
            copies["root" if u.is_root else "others"].append(
                None if b.secondary is None else b.secondary.numel() * hpz == b.full.numel())
    weights = full_state_dict(engine.module)
    engine.destroy()
    return {"losses": losses, "weights": weights if rank == 0 else None, "groups": groups,
            "hpz": kinds.count("all_gather_hpz"), "all": len(kinds), "copies": copies}


@pytest.mark.parametrize("quantized", [(), WEIGHTS], ids=["fp32", "quantized_weights"])
def test_hpz_backward_gathers_stay_in_the_group_and_train_the_same(pools, quantized):
    plain = pools(4).run(hpz_run, 1, quantized)
    hpz = pools(4).run(hpz_run, 2, quantized)
    assert hpz[0]["losses"] == plain[0]["losses"]  # the same values, bit for bit
    for name, value in plain[0]["weights"].items():
        assert torch.equal(hpz[0]["weights"][name], value), name
    for rank, run in enumerate(hpz):  # every backward re-gather: inside the pair of ranks
        assert run["groups"] == {(0, 1)} if rank < 2 else {(2, 3)}, run["groups"]
        # as many all-gathers as without hpZ; the backward's (all but the root's) from the copies
        assert run["all"] == plain[rank]["all"] and 0 < run["hpz"] < run["all"], run
    assert plain[0]["hpz"] == 0
    copies = hpz[0]["copies"]  # 1/N of each full buffer backward gathers again; the root: none
    assert set(copies["root"]) == {None} and set(copies["others"]) == {True}, copies


def combo_run(rank, world, quantized, extra, steps=20):
    """Losses of `steps` steps with the config's `extra` sections merged in."""
    from vescale_engine import initialize
    cfg = config(quantized)
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    losses = train_text(engine, rank, world, steps, shakespeare())
    engine.destroy()
    return losses


COMBOS = {  # world size, config sections
    "hsdp": (4, {"vescale": {"hsdp_replicate_size": 2}}),
    "accumulation": (2, {"gradient_accumulation_steps": 2, "train_batch_size": GLOBAL * 2}),
    "offload": (2, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
    "fp16": (2, {"bf16": {"enabled": False}, "fp16": {"enabled": True,
                                                      "initial_scale_power": 8}}),
}


@pytest.mark.parametrize("name", sorted(COMBOS))
def test_quantized_communication_composes(pools, name):
    """HSDP (the replicas' all-reduce after the all-to-all), accumulation, optimizer offload
    (the compute shard quantized) and fp16 (its pre-divide and loss scale): the same run
    without quantization within 2% over 20 steps."""
    world, extra = COMBOS[name]
    plain = pools(world).run(combo_run, (), extra)[0]
    quant = pools(world).run(combo_run, BOTH, extra)[0]
    assert quant != plain
    tail = lambda losses: sum(losses[-5:]) / 5  # noqa: E731
    assert abs(tail(quant) - tail(plain)) <= 0.02 * tail(plain), (tail(quant), tail(plain))
    assert max(abs(a - b) / b for a, b in zip(quant, plain)) < 0.05
