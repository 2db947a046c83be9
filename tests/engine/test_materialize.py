"""Deferred (meta-device) initialization on gloo: one pool of 3 ranks runs every check, at 1, 2
and 3 ranks through sub-groups (3 gives uneven splits). materialize must equal a one-process
build with the same seed bitwise (our GPT, a tiny transformers LlamaForCausalLM, tied and not),
keep its peak under shard + largest module (the build-whole control exceeds the cap), and turn
every silent meta-device failure into an error naming the parameter."""
import ctypes
import gc
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_models as fm
from dist_harness import engine_log_messages
import vescale_engine
from vescale_engine.fsdp import (full_state_dict, fully_shard, gathered_parameters, no_sync,
                                 sharded_parameters)
from vescale_engine.fsdp.guards import meta_leftovers
from vescale_engine.materialize import allocate_shards, init_unloaded, materialize
from vescale_engine.fsdp.faces import ZeRO3Pieces
from vescale_engine.fsdp.policy import ShardingPolicy

WORLD = 3
SEED = 1234


POOL_WORLD = WORLD


_GROUPS = {}


def subgroup(size):
    """The group of ranks [0, size) (every rank must ask for every group, in the same order)."""
    if not _GROUPS:
        for n in range(1, WORLD + 1):
            _GROUPS[n] = dist.new_group(list(range(n)))
        for r in range(WORLD):
            _GROUPS[("alone", r)] = dist.new_group([r])
    return _GROUPS[size] if dist.get_rank() < size else None


def own_group():
    """A group of this rank alone: a one-process materialize."""
    subgroup(1)
    return _GROUPS[("alone", dist.get_rank())]


def tiny_llama_config(tie):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tie)


def build(kind, device=None):
    """(model, its units innermost first) built on `device` (None: the default, CPU)."""
    from transformers import LlamaForCausalLM
    with torch.device(device) if device else torch.device("cpu"):
        if kind == "gpt":
            model = fm.GPT()
            return model, list(model.blocks)
        if kind == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel
            model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64,
                                               n_layer=2, n_head=4, eos_token_id=0,
                                               bos_token_id=0))
            return model, list(model.transformer.h)
        if kind == "encoder-layer":  # nn.MultiheadAttention inits through _reset_parameters
            return nn.TransformerEncoderLayer(32, 4, dim_feedforward=48), []
        model = LlamaForCausalLM(tiny_llama_config(tie=kind == "llama-tied"))
        return model, list(model.model.layers)


def shard(model, units, group):
    for unit in units:
        fully_shard(unit, mesh=group)
    return fully_shard(model, mesh=group)


# -- bitwise equality with the one-process build --------------------------------------------

KINDS = ("gpt", "llama", "llama-tied", "encoder-layer")


def bitwise_rank(rank, world):
    out = {}
    for kind in KINDS:
        torch.manual_seed(SEED)
        reference, _ = build(kind)
        ref = reference.state_dict()
        after_reference = torch.get_rng_state()
        for size in (1, 2, 3):
            group = subgroup(size)
            if group is None:
                continue
            torch.manual_seed(SEED)
            model, units = build(kind, "meta")
            shard(model, units, group)
            returned = materialize(model)
            rng_matches = torch.equal(torch.get_rng_state(), after_reference)
            pieces = [fqn for fqn, p in sharded_parameters(model)
                      if not torch.equal(p.sharded.to_local().detach(),
                                         ref[fqn].reshape(-1)[slice(*p.flat_range)])]
            full = full_state_dict(model)
            differ = sorted(k for k in ref if not torch.equal(full[k], ref[k]))
            buffers = sorted(n for n, b in model.named_buffers()
                             if not torch.equal(b, dict(reference.named_buffers())[n]))
            tied = kind != "llama-tied" or \
                model.lm_head.weight is model.model.embed_tokens.weight
            gpt_tied = kind != "gpt" or model.head.weight is model.wte.weight
            out[(kind, size)] = (returned is model, rng_matches, pieces, differ, buffers,
                                 sorted(set(ref) ^ set(full)), tied and gpt_tied)
    assert len(out) == len(KINDS) * (WORLD - rank)  # rank r: in the groups of size > r
    for key, value in out.items():
        assert value == (True, True, [], [], [], [], True), (rank, key, value)


def world_size_independence_rank(rank, world):
    """Hugging Face GPT-2: Conv1D draws in __init__ (lost on meta: not bitwise with a whole
    build), and GPT2Attention's init writes its child's c_proj.weight. Every world size must
    still give the same values as a one-process materialize, c_proj at the scaled std."""
    def run(group):
        torch.manual_seed(SEED)
        model, units = build("gpt2", "meta")
        shard(model, units, group)
        materialize(model)
        return full_state_dict(model)
    alone = run(own_group())
    out = {}
    for size in (1, 2, 3):
        group = subgroup(size)
        if group is not None:
            full = run(group)
            out[size] = sorted(k for k in alone if not torch.equal(full[k], alone[k]))
    std = float(alone["transformer.h.0.attn.c_proj.weight"].std())
    scaled = abs(std / (0.02 / math.sqrt(4)) - 1) < 0.1
    assert out == {size: [] for size in range(rank + 1, WORLD + 1)} and scaled, (rank, out)


def test_a_parent_writing_a_childs_parameter_gives_the_same_values_at_any_world_size(pool):
    pool.run(world_size_independence_rank)


def test_materialize_is_bitwise_a_one_process_build_at_1_2_3_ranks(pool):
    """Every rank of each group holds exactly its flat range of the one-process values, the
    gathered state dict (buffers included: Llama's rotary inv_freq) is bitwise equal, tied
    weights stay tied, and the generator ends where the one-process build left it."""
    pool.run(bitwise_rank)


# -- initialize with a meta model ------------------------------------------------------------

ENGINE_CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "seed": 99,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "vescale": {"wrap_policy": {"module_classes": ["Block", "LlamaDecoderLayer"]}},
}


def engine_rank(rank, world, kind, plain_parameters):
    """The same script twice: seed, build (whole / on meta), initialize, one step. The config's
    seed is different from the script's: materialize must draw from the state initialize was
    called with, as the whole build did, and leave the config's seed for training."""
    from vescale_engine import initialize
    results = []
    for device in ("cpu", "meta"):
        torch.manual_seed(SEED)
        model, _ = build(kind, device)
        params = model.parameters() if plain_parameters else \
            [{"params": [p for n, p in model.named_parameters() if "norm" not in n]},
             {"params": [p for n, p in model.named_parameters() if "norm" in n],
              "weight_decay": 0.0}]
        engine, opt, _, _ = initialize(model=model, config=ENGINE_CONFIG, model_parameters=params)
        initial = full_state_dict(engine.module)
        idx, tgt = fm.batch("gpt", rank, 2)
        if kind == "gpt":
            loss = engine(idx, tgt)
        else:
            loss = engine(input_ids=idx, labels=tgt).loss
        engine.backward(loss)
        engine.step()
        after = full_state_dict(engine.module)
        on_cpu = {str(p.device) for group in opt.param_groups for p in group["params"]}
        results.append((loss.item(), initial, after, torch.get_rng_state(), on_cpu))
        engine.destroy()
    (loss_w, init_w, after_w, rng_w, dev_w), (loss_m, init_m, after_m, rng_m, dev_m) = results
    out = (loss_w == loss_m, sorted(k for k in init_w if not torch.equal(init_w[k], init_m[k])),
           sorted(k for k in after_w if not torch.equal(after_w[k], after_m[k])),
           torch.equal(rng_w, rng_m), dev_m, math.isfinite(loss_m))
    assert out == (True, [], [], True, {"cpu"}, True), out


@pytest.mark.parametrize("kind,plain", [("gpt", True), ("llama", False)])
def test_initialize_a_meta_model_trains_as_the_whole_build(pool, kind, plain):
    pool.run(engine_rank, kind, plain)


# -- peak memory ---------------------------------------------------------------------------

MEMORY_MODEL = dict(vocab=2048, dim=384, heads=4, layers=16, seq=16)


def _status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _growth(fn):
    """Peak resident growth while fn runs: VmHWM reset right before (as
    benchmarks/fake_pg_memory.py does), so earlier checks in this rank do not count."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    kept = fn()
    return _status_bytes("VmHWM") - before, kept


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def memory_rank(rank, world):
    group = subgroup(2)
    if group is None:
        return None
    # Every allocation of 1 MiB or more gets its own mapping, returned when freed: resident
    # memory then follows the live tensors, not glibc's heap heuristics (its threshold otherwise
    # moves with what earlier checks in this process freed).
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)

    def deferred(size=MEMORY_MODEL):
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = fm.GPT(**size)
        shard(model, list(model.blocks), group)
        return materialize(model)

    def whole(size=MEMORY_MODEL):
        torch.manual_seed(SEED)
        model = fm.GPT(**size)
        return shard(model, list(model.blocks), group)

    # Code pages a first call touches count as resident too: run both paths once, small.
    deferred({})
    whole({})
    meta_growth, model = _growth(deferred)
    shard_bytes = sum(b.master.untyped_storage().nbytes()
                      for u in _units_of(model) for b in u.buffers)
    largest = max(sum(math.prod(sp.shape) * 4 for sp in _own(m)) for m in model.modules())
    del model
    whole_growth, model = _growth(whole)
    del model
    out = meta_growth, whole_growth, shard_bytes, largest
    cap = 1.1 * shard_bytes + largest + 16 * 2**20
    assert meta_growth <= cap < whole_growth, (rank, out, cap)


def _units_of(model):
    from vescale_engine.fsdp import unit_of
    return [u for u in (unit_of(m) for m in model.modules()) if u is not None]


def _own(module):
    return [p._vescale for p in module._parameters.values() if getattr(p, "_vescale", None)]


def test_peak_memory_is_shard_plus_the_largest_module(pool):
    """Cap: 1.1 x shard + the largest module's own parameters + 16 MiB (allocator slack; the
    shard is 55.6 MiB per rank, the model 111 MiB; measured about 65 MiB of growth against a
    cap of 80). The control (build whole, then shard: about 118) must exceed it, so the check
    can fail."""
    pool.run(memory_rank)


# -- every silent failure is an error naming the parameter -----------------------------------

class NoInit(nn.Module):
    """A parameter made with torch.empty and no reset_parameters: nothing initializes it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))


class HalfInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def reset_parameters(self):
        with torch.no_grad():
            self.w[:2].zero_()


class MaskBuffer(nn.Module):
    """A buffer computed in __init__: on meta its value is lost and no init recomputes it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))


def _message(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as err:
        return str(err)
    return "no error"


def errors_rank(rank, world):
    out = {}
    with torch.device("meta"):
        gpt = fm.GPT()
    for block in gpt.blocks:
        fully_shard(block)
    fully_shard(gpt)
    idx, tgt = fm.batch("gpt", 0, 2)
    out["forward"] = _message(lambda: gpt(idx, tgt))
    out["full_state_dict"] = _message(lambda: full_state_dict(gpt))
    out["half"] = _message(lambda: gpt.half())
    out["to"] = _message(lambda: gpt.to("cpu"))
    with no_sync(gpt):  # a context made before the first forward must not skip the check
        out["forward in no_sync"] = _message(lambda: gpt(idx, tgt))

    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    out["mixed"] = _message(lambda: fully_shard(mixed))

    for name, cls in (("no_init", NoInit), ("half_init", HalfInit), ("mask", MaskBuffer)):
        with torch.device("meta"):
            model = cls()
        fully_shard(model)
        out[name] = _message(lambda: materialize(model))

    unsharded = nn.Sequential(nn.Linear(2, 2, device="meta"))
    out["unmanaged"] = _message(lambda: allocate_shards(unsharded))

    # FSDP2's meta init, step one: to_empty gives the shards storage (test_fsdp_module.py
    # checks the values reset_parameters then writes); before it, reset_parameters is an error
    with torch.device("meta"):
        empty = fm.GPT()
    for block in empty.blocks:
        fully_shard(block)
    fully_shard(empty)
    out["reset on meta"] = _message(lambda: empty.blocks[0].fc.reset_parameters())
    out["to_empty"] = _message(lambda: empty.to_empty(device="cpu"))
    out["left on meta"] = meta_leftovers(empty)

    # the same modules with an init_fn that sets what their own init leaves alone
    def init_fn(module):
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.fill_(0.5)
    for cls in (NoInit, HalfInit, MaskBuffer):
        with torch.device("meta"):
            model = cls()
        fully_shard(model)
        materialize(model, init_fn=init_fn)
        values = full_state_dict(model)
        out[f"init_fn {cls.__name__}"] = all(bool((v == 0.5).all()) for v in values.values())

    # reset_parameters between steps: a clear error on flat pieces, works at full shape
    torch.manual_seed(0)
    real = fm.GPT()
    for block in real.blocks:
        fully_shard(block)
    fully_shard(real)
    torch.manual_seed(7)
    real.blocks[0].fc.reset_parameters()  # flat pieces between steps: run at full shape
    torch.manual_seed(7)
    expected = nn.Linear(64, 256)
    fc = full_state_dict(real)
    out["reset"] = torch.equal(fc["blocks.0.fc.weight"], expected.weight.detach()) and \
        torch.equal(fc["blocks.0.fc.bias"], expected.bias.detach())
    torch.manual_seed(5)
    with gathered_parameters(real, writeback=True):
        real.blocks[0].fc.reset_parameters()
    torch.manual_seed(5)
    expected = nn.Linear(64, 256)
    fc = full_state_dict(real)
    out["reset_gathered"] = torch.equal(fc["blocks.0.fc.weight"], expected.weight.detach())
    assert out["forward"].startswith("wte.weight (and ") and \
        "still on the meta device at forward" in out["forward"], out["forward"]
    assert "at gathering full parameters" in out["full_state_dict"]
    assert out["reset on meta"].startswith("Linear.reset_parameters(): its shards are "
                                           "still on the meta device; call model.to_empty"), \
        out["reset on meta"]
    assert out["to_empty"] == "no error" and out["left on meta"] == [], \
        (out["to_empty"], out["left on meta"])
    assert "GPT.half(...)" in out["half"], out["half"]
    assert out["to"].startswith("GPT.to(...) on a module sharded by fully_shard") and \
        "vescale_engine.materialize(model)" in out["to"], out["to"]
    assert out["forward in no_sync"] == out["forward"]
    assert "1.weight is on the meta device but 0.weight is on cpu" in out["mixed"]
    assert out["no_init"].startswith("scale (NoInit) was not initialized"), out["no_init"]
    assert out["half_init"].startswith("w (HalfInit): the init wrote only part of it"), \
        out["half_init"]
    assert out["mask"].startswith("mask (MaskBuffer) is a buffer that was on the meta "
                                  "device and no init wrote it"), out["mask"]
    assert out["unmanaged"].startswith("allocate_shards: 0.weight is on the meta device but "
                                       "no fully_shard unit manages it"), out["unmanaged"]
    assert out["init_fn NoInit"] and out["init_fn HalfInit"] and out["init_fn MaskBuffer"]
    assert out["reset"] is True
    assert out["reset_gathered"]


def test_meta_failures_are_errors_that_name_the_parameter(pool):
    pool.run(errors_rank)


# -- constructors that initialize beyond reset_parameters --------------------------------------

class NanoGPTLike(nn.Module):
    """nanoGPT's pattern: `self.apply(self._init_weights)` at the end of `__init__`, a tied head."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
                                    for _ in range(2))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


class TitanLike(nn.Module):
    """torchtitan's pattern: the constructor leaves torch's defaults, `init_weights()` is called
    after the model is sharded."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 32, bias=False)

    def init_weights(self):
        nn.init.normal_(self.tok.weight)
        for k, layer in enumerate(self.layers):
            nn.init.trunc_normal_(layer.weight, std=0.02 / math.sqrt(2 * (k + 1)))
            nn.init.zeros_(layer.bias)
        nn.init.trunc_normal_(self.out.weight, std=16 ** -0.5)


def constructor_init_rank(rank, world):
    """A meta build whose constructor wrote more than reset_parameters is refused (the example
    GPT, nanoGPT's pattern; also through initialize), `init_fn` gives it the init at every world
    size; torchtitan's `init_weights()` gives an unsharded model's values on RaggedDTensor
    parameters and at full shape, and is refused on flat pieces (the DeepSpeed face)."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"))
    from gpt_model import GPT, GPTConfig
    out = {}
    group = subgroup(2)
    cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=16)
    with torch.device("meta"):
        example = GPT(cfg)
    out["example"] = _message(lambda: materialize(shard(example, list(example.blocks),
                                                        group or own_group())))
    with torch.device("meta"):
        example = GPT(cfg)
    out["initialize"] = _message(lambda: vescale_engine.initialize(model=example,
                                                                   config=ENGINE_CONFIG))
    torch.manual_seed(SEED)
    with torch.device("meta"):
        example = vescale_engine.materialize.use_init_fn(GPT(cfg), GPT._init)
    engine, *_ = vescale_engine.initialize(model=example, config=ENGINE_CONFIG)
    full = full_state_dict(engine.module)
    out["use_init_fn"] = (abs(float(full["wte.weight"].std()) / 0.02 - 1) < 0.15,
                          bool((full["blocks.0.ln_1.weight"] == 1).all()))
    engine.destroy()
    sizes = {}
    for size in ("alone", 2, 3):
        g = own_group() if size == "alone" else subgroup(size)
        if g is None:
            continue
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = NanoGPTLike()
        shard(model, list(model.blocks), g)
        if size == "alone":
            out["nanogpt"] = _message(lambda: materialize(model))
        materialize(model, init_fn=NanoGPTLike._init_weights)
        sizes[size] = full_state_dict(model)
    first = sizes["alone"]
    out["init_fn sizes"] = [sorted(k for k in first if not torch.equal(full[k], first[k]))
                            for full in sizes.values()]
    out["init_fn values"] = (
        abs(float(first["wte.weight"].std()) / 0.02 - 1) < 0.15,
        abs(float(first["blocks.0.1.weight"].std()) / 0.02 - 1) < 0.3,
        bool((first["blocks.0.1.bias"] == 0).all()),
        bool((first["blocks.0.0.weight"] == 1).all()),  # LayerNorm: init_fn left it to reset
        torch.equal(first["head.weight"], first["wte.weight"]))
    if group is not None:
        torch.manual_seed(SEED)
        reference = TitanLike()
        torch.manual_seed(SEED + 1)
        reference.init_weights()
        torch.manual_seed(SEED)
        with torch.device("meta"):
            titan = TitanLike()
        shard(titan, list(titan.layers), group)
        materialize(titan)
        torch.manual_seed(SEED + 1)
        titan.init_weights()  # on the RaggedDTensor parameters themselves
        full = full_state_dict(titan)
        out["titan direct"] = sorted(k for k, v in reference.state_dict().items()
                                     if not torch.equal(full[k], v))
        torch.manual_seed(SEED + 1)
        with gathered_parameters(titan, writeback=True):
            titan.init_weights()
        full = full_state_dict(titan)
        out["titan gathered"] = sorted(k for k, v in reference.state_dict().items()
                                       if not torch.equal(full[k], v))
        torch.manual_seed(SEED)
        with torch.device("meta"):
            flat = TitanLike()
        for module in list(flat.layers) + [flat]:
            fully_shard(module, mesh=group, sharding=ShardingPolicy(face=ZeRO3Pieces()))
        materialize(flat)
        out["titan flat"] = _message(flat.init_weights)
    assert out["example"].startswith(
        "wte.weight (Embedding) was written 3 time(s) while the model was built on the meta "
        "device, but its reset_parameters writes it 2 time(s)"), out["example"]
    assert "materialize(model, init_fn=...)" in out["example"]
    assert out["initialize"] == out["example"], out["initialize"]
    assert all(out["use_init_fn"]), out["use_init_fn"]
    assert out["nanogpt"].startswith("wte.weight (Embedding) was written 3 time(s)"), \
        out["nanogpt"]
    assert out["init_fn sizes"] in ([[], []], [[], [], []]), out["init_fn sizes"]
    assert all(out["init_fn values"]), out["init_fn values"]
    if rank < 2:
        assert out["titan flat"].startswith("TitanLike.init_weights(): tok.weight is a flat "
                                            "piece"), out["titan flat"]
        assert out["titan gathered"] == [], out["titan gathered"]
        assert out["titan direct"] == [], out["titan direct"]


def test_a_constructor_init_materialize_cannot_replay_is_refused(pool):
    pool.run(constructor_init_rank)


# -- allocate_shards: the loader's primitive ---------------------------------------------------

def allocate_rank(rank, world):
    """allocate_shards keeps the Parameter objects, points them at real storage; writing each
    rank's `flat_range` of a full value through `p.sharded` (as the HF loader does) gives that
    value back from full_state_dict, and materialize afterwards has nothing left to do."""
    torch.manual_seed(SEED)
    reference = fm.GPT().state_dict()
    with torch.device("meta"):
        model = fm.GPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    before = {name: p for name, p in model.named_parameters()}
    model.wte.weight.no_decay = True  # an attribute a user set on the meta parameter
    allocate_shards(model)
    same_objects = all(p is before[name] for name, p in model.named_parameters()) and \
        getattr(model.wte.weight, "no_decay", False) and \
        model.wte.weight._vescale.sharded is model.wte.weight
    on_cpu = {str(p.device) for p in model.parameters()}
    with torch.no_grad():
        for fqn, p in sharded_parameters(model):
            p.sharded.to_local().copy_(reference[fqn].reshape(-1)[slice(*p.flat_range)])
    full = full_state_dict(model)
    rng = torch.get_rng_state()
    materialize(model)  # nothing on meta: a no-op, no draws
    no_draws = torch.equal(rng, torch.get_rng_state())
    # Part loaded, part on meta: materialize keeps the load and initializes only the modules
    # that own meta tensors: up to the loaded block, the whole build's values; after it the
    # draws differ (the loaded block's init did not run), every value is still written.
    torch.manual_seed(SEED)
    with torch.device("meta"):
        mixed = fm.GPT()
    for block in mixed.blocks:
        fully_shard(block)
    fully_shard(mixed)
    allocate_shards(mixed.blocks[1])
    with torch.no_grad():
        for fqn, p in sharded_parameters(mixed.blocks[1]):
            p.sharded.to_local().copy_(reference[f"blocks.1.{fqn}"].reshape(-1)[slice(*p.flat_range)] + 1)
    materialize(mixed)
    values = full_state_dict(mixed)
    before = ("wte.", "wpe.", "blocks.0.", "head.")  # head.weight is wte.weight
    partial = ([k for k in reference if k.startswith("blocks.1.")
                and not torch.equal(values[k], reference[k] + 1)] +
               [k for k in reference if k.startswith(before)
                and not torch.equal(values[k], reference[k])] +
               [k for k in reference if not bool(torch.isfinite(values[k]).all())])
    torch.manual_seed(SEED)
    with torch.device("meta"):
        logged = fm.GPT()
    fully_shard(logged)
    with engine_log_messages() as lines:
        materialize(logged)
    progress = [line for line in lines if line.startswith("materialize: ")]
    again = full_state_dict(model)
    out = (same_objects, on_cpu, [k for k in reference if not torch.equal(full[k], reference[k])],
           [k for k in reference if not torch.equal(again[k], reference[k])], progress,
           no_draws, partial)
    assert out[:4] == (True, {"cpu"}, [], []) and out[5:] == (True, []), out
    # progress: rank 0 only, a line per 10% of the 28 modules with own parameters (every
    # 3rd) and one at the end
    assert len(progress) == (10 if rank == 0 else 0), progress
    if rank == 0:
        assert progress[0].startswith("materialize: 3/28 modules initialized"), progress
        assert progress[-1].startswith("materialize: 28/28 modules initialized"), progress


def test_allocate_shards_is_what_a_loader_fills(pool):
    pool.run(allocate_rank)


def test_vescale_engine_materialize_is_callable_and_a_module():
    """`vescale_engine.materialize(model)` calls; `.allocate_shards` is the loader's entry."""
    assert callable(vescale_engine.materialize)
    assert vescale_engine.materialize.allocate_shards is allocate_shards
    assert vescale_engine.allocate_shards is allocate_shards


def test_default_device_follows_the_backend_that_serves_cuda(monkeypatch):
    """materialize(device=None) outside the engine: the current CUDA device when NCCL serves
    CUDA tensors in the group, else the CPU (the GPU branch through a seam: no GPU here)."""
    from vescale_engine.shard import collectives
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for config, expected in (("cpu:gloo,cuda:nccl", torch.device("cuda", 3)),
                             ("nccl", torch.device("cuda", 3)),
                             ("gloo", torch.device("cpu")), ("cpu:gloo", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend_config", lambda group, c=config: c)
        assert collectives.default_device(object()) == expected, config


def test_the_rewind_restores_every_generator_the_init_draws_from(monkeypatch):
    """An init rerun (a parent wrote a child's parameter) rewinds the CPU generator and, for
    temporaries on a GPU, that GPU's (through a seam: no GPU here)."""
    from vescale_engine import materialize as mat
    cuda_states = {0: torch.tensor([1]), 1: torch.tensor([2])}
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda d: cuda_states[torch.device(d).index].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda value, d: cuda_states.__setitem__(torch.device(d).index, value))
    torch.manual_seed(0)
    state = mat.rng_state({torch.device("cpu"), torch.device("cuda", 1)})
    expected = torch.rand(3)
    cuda_states[1] = torch.tensor([9])
    mat.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
    assert cuda_states == {0: torch.tensor([1]), 1: torch.tensor([2])}


def loader_flow_rank(rank, world):
    """What the Hugging Face loader does: allocate_shards, write each rank's pieces of the
    checkpoint's tensors, then init_unloaded for what the checkpoint lacks: the rotary
    inv_freq buffers (non-persistent) and, as with strict=False, lm_head.weight."""
    torch.manual_seed(SEED)
    reference, _ = build("llama")
    ref = reference.state_dict()
    ref_buffers = dict(reference.named_buffers())
    with torch.device("meta"):
        model, units = build("llama", "meta")
    shard(model, units, None)
    allocate_shards(model)
    with torch.no_grad():
        for fqn, p in sharded_parameters(model):
            if fqn != "lm_head.weight":
                p.sharded.to_local().copy_(ref[fqn].reshape(-1)[slice(*p.flat_range)])
    rotary = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    init_unloaded(model, rotary + ["lm_head.weight"])
    full = full_state_dict(model)
    loaded = [k for k in ref if k != "lm_head.weight" and not torch.equal(full[k], ref[k])]
    buffers = [n for n in rotary if not torch.equal(dict(model.named_buffers())[n],
                                                    ref_buffers[n])]
    head = full["lm_head.weight"]
    head_ok = bool(torch.isfinite(head).all()) and abs(float(head.std()) / 0.02 - 1) < 0.1
    errors = [_message(lambda: init_unloaded(model, ["model.nope"])),
              _message(lambda: init_unloaded(model, ["model.norm.weight"]))]
    unknown, fine = errors
    out = loaded, buffers, head_ok, unknown, fine
    assert (loaded, buffers, head_ok) == ([], [], True), out
    assert unknown == "init_unloaded: model.nope is not a parameter or buffer of " \
                      "LlamaForCausalLM", unknown
    assert fine == "no error", fine


def test_a_loader_initializes_only_what_the_checkpoint_lacks(pool):
    pool.run(loader_flow_rank)
