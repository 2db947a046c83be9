"""Block-wise 8-bit AdamW on gloo: 1, 2 and 4 ranks give bit-identical parameters, scales and
moments after k steps (quantization blocks are RaggedShard blocks, never cut by a shard), state
memory is under 0.3x fp32 AdamW's, it trains like fp32 AdamW, the engine picks its granularity,
and a block that does not fit is an error naming the parameter."""
import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_models as fm
from dist_harness import value_errors
from vescale_engine import initialize
from vescale_engine.fsdp import full_state_dict, fully_shard, sharded_parameters
from vescale_engine.optim import AdamW8bit, sharding_granularity
from vescale_engine.optim.adamw8bit import fp32_adamw_state_bytes
from vescale_engine.optim.quantize import BlockQuantizer, code_table
from vescale_engine.shard.ragged import RaggedShard, ragged_to_replicate

STEPS = 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


POOL_WORLDS = [2, 4]  # (conftest.py's `pool`, once per size)


def shard(model, granularity, group=None):
    policy = sharding_granularity({"type": "AdamW8bit", "params": {"block": granularity}},
                                  {"default": "rows:1"}, model)
    for unit in fm.units_of(model):
        fully_shard(unit, granularity=policy, mesh=group)
    return fully_shard(model, granularity=policy, mesh=group)


def synthetic_gradient(fqn, shape, step):
    """The same full gradient on every mesh (a function of the name and the step only), with
    magnitudes spread over decades so that the moments exercise the whole code table."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fqn}/{step}".encode()))
    return torch.randn(shape, generator=gen) * torch.logspace(-4, 0, shape[-1])


def spec_of(sp):
    return RaggedShard(sp.shape, sp.block,
                       sp.buffer.layout.placements[sp.index].local_units(sp.buffer.world_size))


def run(granularity, quant_map, group):
    """k steps on synthetic gradients; every tensor's parameters, moments and per-block scales,
    gathered whole (in the tensor's own block order) on every rank."""
    model = shard(fm.make("gpt"), granularity, group)
    opt = AdamW8bit(model.parameters(), **HYPER, block=granularity, quant_map=quant_map)
    named = list(sharded_parameters(model))
    for step in range(STEPS):
        idx, tgt = fm.batch("gpt", step, 4)
        model(idx, tgt).backward()  # gradient storage; the values are replaced just below
        for fqn, sp in named:
            start, end = spec_of(sp).local_range(sp.buffer.rank)
            sp.sharded.grad.to_local().copy_(synthetic_gradient(fqn, sp.shape, step).reshape(-1)[start:end])
        opt.step()
        opt.zero_grad()
    out = {"param." + k: v for k, v in full_state_dict(model).items()}
    for fqn, sp in named:
        buf = sp.buffer
        exp_avg, exp_avg_sq = opt.moments(buf)
        start, end = buf.local_ranges[sp.index]
        spec = spec_of(sp)
        pg = buf.shard_group
        out["exp_avg." + fqn] = ragged_to_replicate(exp_avg[start:end].contiguous(), spec, pg)
        out["exp_avg_sq." + fqn] = ragged_to_replicate(exp_avg_sq[start:end].contiguous(), spec,
                                                       pg)
        state = opt.state[buf.master]
        for key in ("exp_avg_scales", "exp_avg_sq_scales"):
            out[f"{key}.{fqn}"] = ragged_to_replicate(
                tensor_scales(opt, buf, sp, state[key]),
                RaggedShard((spec.num_blocks,), 1, spec.local_units), pg)
    return out, opt


def tensor_scales(opt, buf, sp, scales):
    """This rank's scales of tensor `sp`'s blocks (segments are in flat order)."""
    quantizer = next(q for b, *_, q in opt._buffers if b is buf)
    starts = torch.cumsum(quantizer.lengths, 0) - quantizer.lengths
    start, end = buf.local_ranges[sp.index]
    return scales[(starts >= start) & (starts < end)].contiguous()


def mesh_rank(rank, world):
    groups = [dist.new_group([r]) for r in range(world)]  # every rank builds every group
    for granularity, quant_map in (("block:256", "dynamic"), ("tile:32x32", "linear"),
                                   ("rows:3", "dynamic")):
        alone, _ = run(granularity, quant_map, groups[rank])
        together, opt = run(granularity, quant_map, None)
        assert alone.keys() == together.keys()
        differ = [k for k in alone if not torch.equal(alone[k], together[k])]
        moved = (together["param.blocks.0.fc.weight"]
                 - fm.make("gpt").blocks[0].fc.weight).abs().max().item()
        compared, blocks = len(alone), together["exp_avg_scales.blocks.0.fc.weight"].numel()
        assert differ == [], (granularity, differ)
        assert compared > 100 and moved > 1e-3  # many tensors compared; the step did move
        fc = 256 * 64  # blocks of blocks.0.fc.weight (256 x 64)
        assert blocks == {"block:256": fc // 256, "tile:32x32": 256 // 32,
                          "rows:3": -(-256 // 3)}[granularity]


def test_identical_states_and_parameters_on_1_2_and_4_ranks(pool):
    pool.run(mesh_rank, timeout=600)


# ------------------------------------------------------------------ memory and training

def memory_rank(rank, world):
    out = []
    for granularity in ("block:256", "tile:32x32"):
        model = shard(fm.make("gpt"), granularity)
        opt = AdamW8bit(model.parameters(), **HYPER, block=granularity)
        idx, tgt = fm.batch("gpt", 0, 4)
        model(idx, tgt).backward()
        opt.step()
        fp32 = sum(fp32_adamw_state_bytes(buf.shard_size) for buf, *_ in opt._buffers)
        out.append((granularity, opt.state_bytes(), fp32))
    # torch's AdamW on the whole unsharded model, for scale: all ranks together hold no more.
    reference = fm.make("gpt")
    torch_opt = torch.optim.AdamW(reference.parameters())
    reference(*fm.batch("gpt", 0, 4)).backward()
    torch_opt.step()
    torch_bytes = sum(t.numel() * t.element_size() for s in torch_opt.state.values()
                      for t in s.values())
    return out, torch_bytes


def test_state_memory_under_three_tenths_of_fp32_adamw(pool):
    results = pool.run(memory_rank)
    torch_bytes = results[0][1]
    for per_granularity in zip(*(r[0] for r in results)):
        mine = sum(b for _, b, _ in per_granularity)
        fp32 = sum(f for _, _, f in per_granularity)
        assert mine <= 0.3 * fp32, (per_granularity[0][0], mine / fp32)
        assert mine <= 0.3 * torch_bytes * 1.1, (mine, torch_bytes)  # padding: a few percent


def pattern_batch(step, size=8, seq=16, vocab=96):
    """Learnable sequences: arithmetic progressions of tokens modulo the vocabulary."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    idx = (start + stride * torch.arange(seq + 1)) % vocab
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def training_rank(rank, world, steps=40):
    losses = {}
    for name in ("fp32", "8bit"):
        torch.manual_seed(0)
        model = shard(fm.make("gpt"), "block:256")
        opt = AdamW8bit(model.parameters(), lr=3e-3) if name == "8bit" else \
            torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for step in range(steps):
            idx, tgt = pattern_batch(step, 8 * world)
            per = idx.shape[0] // world
            loss = model(idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            curve.append(total.item() / world)
        losses[name] = curve
    return losses


def test_trains_like_fp32_adamw(pool):
    losses = pool.run(training_rank)[0]
    fp32, q8 = losses["fp32"], losses["8bit"]
    assert q8[-1] < 0.6 * q8[0], q8  # it learns
    tail = lambda c: sum(c[-5:]) / 5  # noqa: E731
    assert abs(tail(q8) - tail(fp32)) / tail(fp32) < 0.05, (tail(q8), tail(fp32))


# ------------------------------------------------------------------ engine and bad input

def engine_rank(rank, world):
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW8bit", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                            "block": "tile:32x32"}},
              "vescale": {"wrap_policy": {"module_classes": ["Block"]},
                          "granularity": {"default": "rows:1"}}}
    engine, opt, _, _ = initialize(model=fm.make("gpt"), config=config)
    blocks = {fqn: sp.block for fqn, sp in sharded_parameters(engine.module)}
    losses = []
    for step in range(15):
        idx, tgt = pattern_batch(step, 4 * world)
        loss = engine(idx[rank * 4:(rank + 1) * 4], tgt[rank * 4:(rank + 1) * 4])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return type(opt).__name__, opt.betas if hasattr(opt, "betas") else \
        opt.param_groups[0]["betas"], blocks, losses


def test_engine_shards_with_the_quantization_block(pool):
    name, betas, blocks, losses = pool.run(engine_rank)[0]
    assert name == "AdamW8bit" and tuple(betas) == (0.9, 0.95)
    assert blocks["blocks.0.fc.weight"] == 32 * 64 and blocks["blocks.0.out.weight"] == 32 * 256
    assert blocks["blocks.0.ln1.weight"] == 64  # 1-D: min(32 x 32, numel)
    assert losses[-1] < losses[0]


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fine = nn.Linear(64, 64)
        self.odd_proj = nn.Linear(64, 50)  # weight 50 x 64: fine for tiles of 32 columns
        self.narrow = nn.Linear(30, 64)    # weight 64 x 30: 30 columns do not hold a 32 tile


def bad_input_rank(rank, world):
    return value_errors((
        lambda: sharding_granularity({"type": "AdamW8bit", "params": {"block": "tile:32x32"}},
                                     {"default": "rows:1"}, Odd()),
        lambda: initialize(model=Odd(), config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW8bit", "params": {"block": "tile:32x32"}}}),
        lambda: AdamW8bit(fully_shard(fm.make("gpt"), granularity="rows:1").parameters(),
                          block="block:256"),
        lambda: AdamW8bit(fully_shard(fm.make("gpt"), granularity="block:256").parameters(),
                          block="tensor"),
        lambda: AdamW8bit(fully_shard(fm.make("gpt"), granularity="block:256").parameters(),
                          quant_map="log"),
        lambda: initialize(model=fm.make("gpt"), config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW8bit", "params": {"block": "tile:32"}}})))


def test_bad_input_names_the_parameter(pool):
    errors = pool.run(bad_input_rank)[0]
    assert all(e is not None for e in errors), errors
    tile, engine_tile, mismatch, whole, quant_map, schema = errors
    assert "narrow.weight" in tile and "30" in tile and "narrow.weight" in engine_tile
    assert "parameter wte.weight" in mismatch and "block:256" in mismatch
    assert "tensor" in whole and "log" in quant_map
    assert "optimizer.params.block" in schema and "tile:32" in schema


# ------------------------------------------------------------------ the quantizer alone

@pytest.mark.parametrize("kind", ["dynamic", "linear"])
def test_quantizer_round_trip(kind):
    for signed in (True, False):
        table = code_table(kind, signed)
        assert table.numel() == (255 if signed else 256)
        assert 0.0 in table.tolist() and table[-1] == 1 and bool((table[1:] > table[:-1]).all())
    lengths = torch.tensor([256, 7, 256, 40])  # blocks, a short last block, a padding run
    x = torch.randn(int(lengths.sum())) * torch.logspace(-3, 1, int(lengths.sum()))
    x[263:263 + 256] = 0  # a block of zeros stays exactly zero
    q = BlockQuantizer(lengths, kind)
    for signed, value in ((True, x), (False, x.abs())):
        codes = torch.empty(x.numel(), dtype=torch.int8 if signed else torch.uint8)
        scales = torch.empty(q.num_blocks)
        q.quantize(value, signed, codes, scales)
        back = q.dequantize(codes, scales, signed)
        assert torch.equal(back[263:263 + 256], torch.zeros(256))
        starts = torch.cumsum(lengths, 0) - lengths
        for s, n, scale in zip(starts.tolist(), lengths.tolist(), scales.tolist()):
            block, restored = value[s:s + n], back[s:s + n]
            assert scale == block.abs().max().item()
            assert restored.abs().max().item() == scale  # the largest element is exact
            assert (restored - block).abs().max().item() <= 0.02 * scale + 1e-12, (kind, signed)


def test_chunked_quantizer_is_bit_identical_and_tables_are_cached_per_device():
    """Chunks of whole segments (smaller than one tensor, smaller than one block, one chunk for
    everything) give the same codes, scales and restored values; a device's tables are made
    once and live there (meta stands in for a GPU: no host copy per call)."""
    lengths = [256] * 9 + [7, 13] + [100] * 5 + [256] * 3 + [40]
    x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(5))
    outs = []
    for chunk in (1 << 22, 1000, 256, 100):
        q = BlockQuantizer(lengths, "dynamic", chunk_elements=chunk)
        assert len(q.chunks) > 1 or chunk == 1 << 22
        codes, scales = torch.empty(x.numel(), dtype=torch.int8), torch.empty(q.num_blocks)
        q.quantize(x, True, codes, scales)
        outs.append((codes, scales, q.dequantize(codes, scales, True)))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    table = code_table("linear", False, torch.device("meta"))
    assert table.is_meta and code_table("linear", False, "meta") is table
    assert q.segment_range(256 * 9, 256 * 9 + 20) == (9, 11)  # host bisect over the starts


# ------------------------------------------------------------------ checkpoints

def checkpoint_rank(rank, world, directory):
    """Save after 2 steps, train 2 more; a fresh engine loading the checkpoint and training the
    same 2 steps ends bit-identical (the checkpoint holds the codes and scales themselves)."""
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW8bit", "params": {"lr": 3e-3, "block": "block:256"}},
              "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}

    def train(engine, steps):
        for step in steps:
            idx, tgt = pattern_batch(step, 4 * world)
            loss = engine(idx[rank * 4:(rank + 1) * 4], tgt[rank * 4:(rank + 1) * 4])
            engine.backward(loss)
            engine.step()

    engine, opt, _, _ = initialize(model=fm.make("gpt"), config=config)
    train(engine, range(2))
    engine.save_checkpoint(directory, tag="two")
    saved = [t.clone() for s in opt.state.values() for t in s.values()]
    train(engine, range(2, 4))
    want = full_state_dict(engine.module)
    again, opt2, _, _ = initialize(model=fm.make("gpt", seed=7), config=config)
    again.load_checkpoint(directory, tag="two")
    loaded = [t.clone() for s in opt2.state.values() for t in s.values()]
    train(again, range(2, 4))
    got = full_state_dict(again.module)
    same_state = len(saved) == len(loaded) and all(torch.equal(a, b)
                                                   for a, b in zip(saved, loaded))
    return same_state, [k for k in want if not torch.equal(want[k], got[k])]


def test_checkpoint_round_trip_is_exact(pool):
    from dist_harness import scratch_dir
    same_state, differ = pool.run(checkpoint_rank, scratch_dir())[0]
    assert same_state and differ == [], differ


@pytest.mark.parametrize("kind", ["dynamic", "linear"])
@pytest.mark.parametrize("signed", [True, False])
def test_nearest_code_lookup_equals_bucketize(kind, signed):
    """The flat-pass nearest-code search agrees with a binary search everywhere, including on
    every midpoint and its neighbouring floats (where a rounding could go either way)."""
    from vescale_engine.optim.quantize import _midpoints, nearest_codes
    mid = _midpoints(kind, signed)
    low = -1.0 if signed else 0.0
    x = torch.cat([torch.rand(100000, generator=torch.Generator().manual_seed(3)) * (1 - low)
                   + low, mid, torch.nextafter(mid, torch.tensor(2.0)),
                   torch.nextafter(mid, torch.tensor(-2.0)), torch.tensor([0.0, -0.0, 1.0, low]),
                   torch.logspace(-30, 0, 1000) * (-1 if signed else 1)]).clamp(low, 1.0)
    assert torch.equal(nearest_codes(x, kind, signed), torch.bucketize(x, mid))
