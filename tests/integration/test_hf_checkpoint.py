"""Hugging Face checkpoints on gloo ranks: save_pretrained (fp32 and bf16, several files) loads
exactly at 2 and 3 ranks, each rank reading only its own bytes; save_hf_checkpoint gives
files from_pretrained loads with the same logits, and round-trips our GPT across world sizes;
bad input names the key, file or directory, identically on every rank."""
import json
import os
import shutil

import pytest
import torch

import fsdp_models as fm
from dist_harness import scratch_dir

SEED = 0


def llama_config(tied=True):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def make_llama(seed, tied=True):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tied)).eval()


def shard_llama(model, granularity):
    from vescale_engine import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, granularity=granularity)
    return fully_shard(model, granularity=granularity)


def make_gpt(seed):
    model = fm.make("gpt", seed=seed)
    # a persistent buffer: not sharded, every rank reads it whole
    model.register_buffer("position_scale", torch.arange(7, dtype=torch.float32) + seed)
    return model


def shard_gpt(model, granularity="rows:1"):
    from vescale_engine import fully_shard
    for block in model.blocks:
        fully_shard(block, granularity=granularity)
    return fully_shard(model, granularity=granularity)


def own_elements(model) -> int:
    from vescale_engine.fsdp import sharded_parameters
    return sum(p.local().numel() for _, p in sharded_parameters(model))  # this rank's pieces


def assert_equal_state(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


# -- checks run on every rank ----------------------------------------------------------------------

def load_pretrained(rank, world, path, reference, granularity, tied, staging_bytes):
    """Load a save_pretrained directory into a differently seeded sharded Llama (through a
    staging buffer of `staging_bytes`, so that a piece takes several reads): the full state
    equals the reference exactly. Returns this rank's byte counters."""
    from vescale_engine import full_state_dict, load_hf_checkpoint
    from vescale_engine.checkpoint import hf as hf_checkpoint
    model = shard_llama(make_llama(SEED + 1, tied), granularity)
    default, hf_checkpoint.STAGING_BYTES = hf_checkpoint.STAGING_BYTES, staging_bytes
    try:
        result = load_hf_checkpoint(model, path)
    finally:
        hf_checkpoint.STAGING_BYTES = default
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_equal_state(full_state_dict(model), torch.load(reference))
    return {"bytes_read": result.bytes_read, "whole": result.whole_bytes_read,
            "headers": result.header_bytes, "own": own_elements(model), "files": result.files,
            "staging": result.staging_bytes}


def gpt_save(rank, world, path, dtype, max_shard_size):
    """Save, recording on rank 0 how many buffers were gathered when each file was written and
    how many bytes it held: files go out as they fill, not after the whole model is in memory."""
    from vescale_engine import save_hf_checkpoint
    from vescale_engine.fsdp import state_dict as fsdp
    from vescale_engine.checkpoint import hf as hf_checkpoint
    model = shard_gpt(make_gpt(SEED), "element")
    gathered, written = [0], []
    gather, write = fsdp.all_gather_master, hf_checkpoint.save_file

    def counting_gather(full, buf):
        gathered[0] += 1
        return gather(full, buf)

    def recording_write(tensors, file, metadata=None):
        written.append((gathered[0], len(tensors),
                        sum(t.numel() * t.element_size() for t in tensors.values())))
        return write(tensors, file, metadata)
    fsdp.all_gather_master, hf_checkpoint.save_file = counting_gather, recording_write
    try:
        save_hf_checkpoint(model, path, dtype=dtype, max_shard_size=max_shard_size)
    finally:
        fsdp.all_gather_master, hf_checkpoint.save_file = gather, write
    return gathered[0], written


def gpt_load(rank, world, path, reference):
    from vescale_engine import full_state_dict, load_hf_checkpoint
    model = shard_gpt(make_gpt(SEED + 5))
    result = load_hf_checkpoint(model, path)
    assert_equal_state(full_state_dict(model), torch.load(reference))
    return {"bytes_read": result.bytes_read, "whole": result.whole_bytes_read,
            "own": own_elements(model)}


def llama_save(rank, world, path, dtype, tied):
    """A sharded Llama holding the reference weights (seed SEED), saved in HF format."""
    from vescale_engine import save_hf_checkpoint
    model = shard_llama(make_llama(SEED, tied), "rows:1")
    save_hf_checkpoint(model, path, dtype=dtype, max_shard_size="20KB")


def load_errors(rank, world, root, reference):
    """Every bad checkpoint raises the same one-line error on every rank, before writing a
    byte; key_map (dict and callable) and strict=False load what they should."""
    from dist_harness import value_errors
    from vescale_engine import full_state_dict, load_hf_checkpoint
    ref = torch.load(reference)
    model = shard_llama(make_llama(SEED + 1), "rows:1")
    initial = full_state_dict(model)
    errors = value_errors([lambda name=name: load_hf_checkpoint(model, os.path.join(root, name))
                           for name in ("missing", "unexpected", "mismatch", "renamed", "empty")])
    assert_equal_state(full_state_dict(model), initial)  # the failures wrote nothing

    renamed = os.path.join(root, "renamed")
    load_hf_checkpoint(model, renamed, key_map={"transformer." + k[len("model."):]: k
                                                for k in ref if k.startswith("model.")})
    assert_equal_state(full_state_dict(model), ref)
    fresh = shard_llama(make_llama(SEED + 2), "rows:1")
    load_hf_checkpoint(fresh, os.path.join(renamed, "model.safetensors"),
                       key_map=lambda k: k.replace("transformer.", "model.", 1))
    assert_equal_state(full_state_dict(fresh), ref)

    partial = shard_llama(make_llama(SEED + 3), "rows:1")
    before = full_state_dict(partial)
    result = load_hf_checkpoint(partial, os.path.join(root, "both"), strict=False)
    got = full_state_dict(partial)
    for key in ref:  # the missing key keeps its value, the rest is loaded
        want = before if key == "model.norm.weight" else ref
        assert torch.equal(got[key], want[key]), key
    return errors, result.missing_keys, result.unexpected_keys


def engine_hf(rank, world, pretrained, reference):
    """initialize with vescale.hf_checkpoint loads the file before the optimizer is built;
    engine.load_hf_checkpoint loads again; engine.load_checkpoint on it says to use it."""
    from vescale_engine import full_state_dict, initialize
    cfg = {"train_batch_size": world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "vescale": {"wrap_policy": {"module_classes": ["LlamaDecoderLayer"]},
                       "hf_checkpoint": pretrained}}
    engine, *_ = initialize(model=make_llama(SEED + 1), config=cfg)
    ref = torch.load(reference)
    assert_equal_state(full_state_dict(engine.module), ref)
    ids = torch.arange(8).view(1, 8) + rank
    engine(input_ids=ids, labels=ids).loss.backward()
    engine.step()  # the optimizer holds the loaded shards: the weights move
    assert not torch.equal(full_state_dict(engine.module)["model.norm.weight"],
                           ref["model.norm.weight"])
    result = engine.load_hf_checkpoint(pretrained)
    assert_equal_state(full_state_dict(engine.module), ref)
    try:
        engine.load_checkpoint(pretrained)
    except ValueError as err:
        return str(err), result.bytes_read
    raise AssertionError("load_checkpoint on a Hugging Face directory did not raise")


def engine_hf_meta(rank, world, pretrained, reference, strict_path):
    """A model built on meta and initialize with vescale.hf_checkpoint: the shards are allocated
    and filled from the file, the rotary inv_freq (a non-persistent buffer no file holds) is
    made by its module, and the logits equal the source model's. A file lacking a key is named
    before the optimizer exists."""
    from transformers import LlamaForCausalLM
    from vescale_engine import full_state_dict, initialize
    cfg = {"train_batch_size": world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "vescale": {"hf_checkpoint": pretrained}}
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(True)).eval()
    engine, *_ = initialize(model=model, config=cfg)
    assert_equal_state(full_state_dict(engine.module), torch.load(reference))
    source = make_llama(SEED)
    for name, buf in source.named_buffers():
        assert torch.equal(dict(engine.module.named_buffers())[name], buf), name
    ids = torch.arange(8).view(1, 8) + rank
    with torch.no_grad():
        same = torch.equal(engine(input_ids=ids).logits, source(input_ids=ids).logits)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(True))
    cfg["vescale"]["hf_checkpoint"] = strict_path
    try:
        initialize(model=model, config=cfg)
    except ValueError as err:
        return same, str(err)
    raise AssertionError("a checkpoint lacking a key loaded into a meta model")


def llama_names(rank, world, path):
    """What transformers reads off a model fully_shard wrapped: class names (Trainer's label
    shift for causal LMs, _no_split_modules, the architectures save_pretrained writes), and
    `generate` once registered as a forward method, against the unwrapped model."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_MAPPING_NAMES)
    from transformers.trainer_pt_utils import get_module_class_from_name
    from vescale_engine.fsdp import full_state_dict, register_fsdp_forward_method
    reference = make_llama(SEED)
    model = shard_llama(make_llama(SEED), "rows:1")
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    register_fsdp_forward_method(model, "generate")
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    generated = model.generate(ids, **kwargs)
    out = {"fsdp module": isinstance(model, FSDPModule) and
           isinstance(model.model.layers[0], FSDPModule),
           "name": type(model).__name__, "causal lm": model._get_name() in
           MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(),
           "base model name": model.__class__.__name__ in MODEL_MAPPING_NAMES,
           "no split found": set(model._no_split_modules) <=
           {type(m).__name__ for m in model.modules()},
           "class from name": get_module_class_from_name(model, "LlamaDecoderLayer") is
           type(model.model.layers[0]),
           "generate": torch.equal(generated, reference.generate(ids, **kwargs))}
    state = full_state_dict(model)
    if rank == 0:
        model.save_pretrained(path, state_dict=state)
    return out


# -- the tests -------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def root():
    path = scratch_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tensor_bytes(path) -> int:
    """Tensor bytes in a checkpoint's files, counted by the safetensors package."""
    from safetensors import safe_open
    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    total += t.numel() * t.element_size()
    return total


@pytest.fixture(scope="module")
def pretrained(root):
    """save_pretrained directories: fp32 tied and bf16 untied, several files each, and the
    reference state dicts (bf16: the source cast to bf16)."""
    out = {}
    for dtype, tied in ((torch.float32, True), (torch.bfloat16, False)):
        name = f"pretrained-{str(dtype)[6:]}"
        model = make_llama(SEED, tied)
        ref = {k: v.to(dtype).float() for k, v in model.state_dict().items()}
        model.to(dtype).save_pretrained(os.path.join(root, name), max_shard_size="20KB")
        torch.save(ref, os.path.join(root, name + ".pt"))
        out[dtype] = (os.path.join(root, name), os.path.join(root, name + ".pt"), tied)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype,granularity", [(torch.float32, "rows:1"),
                                               (torch.bfloat16, "element")])
def test_load_save_pretrained_exact_and_reads_only_own_bytes(pools, pretrained, world, dtype,
                                                             granularity):
    path, reference, tied = pretrained[dtype]
    files = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(files) > 2  # the index path, not one file
    staging = 100  # bytes: the bf16 pieces are read (and cast) in several chunks each
    stats = pools(world).run(load_pretrained, path, reference, granularity, tied, staging)
    itemsize = dtype.itemsize
    # each rank read exactly its own pieces, every byte of the files was read by one rank
    assert [s["bytes_read"] for s in stats] == [s["own"] * itemsize for s in stats]
    assert sum(s["bytes_read"] for s in stats) == tensor_bytes(path)
    assert all(s["whole"] == 0 and s["files"] == len(files) for s in stats)
    assert all(s["headers"] > 0 for s in stats)
    # fp32 file into the fp32 master: read in place; bf16: through the bounded staging buffer
    assert all(s["staging"] == (0 if dtype == torch.float32 else staging) for s in stats)


def test_save_hf_checkpoint_round_trip_across_world_sizes(pools, root):
    """Our GPT (tied head, a persistent buffer) saved at 2 ranks in fp32 loads exactly at 3;
    its files hold the tied weight once and match what the safetensors package reads."""
    from safetensors import safe_open
    path, reference = os.path.join(root, "gpt-fp32"), os.path.join(root, "gpt.pt")
    torch.save(make_gpt(SEED).state_dict(), reference)
    (gathers, written), (_, nothing) = pools(2).run(gpt_save, path, "fp32", "30KB")
    assert nothing == [] and len(written) > 2  # only rank 0 writes
    assert written[0][0] < gathers  # the first file was out before the last buffer came in
    # a file stays within max_shard_size unless one tensor alone is larger (as in HF)
    assert all(nbytes <= 30_000 or count == 1 for _, count, nbytes in written)
    assert any(count > 1 for _, count, _ in written)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    assert "head.weight" not in index["weight_map"] and "wte.weight" in index["weight_map"]
    ref = torch.load(reference)
    for key, name in index["weight_map"].items():
        with safe_open(os.path.join(path, name), "pt") as f:
            assert torch.equal(f.get_tensor(key), ref[key]), key
    stats = pools(3).run(gpt_load, path, reference)
    assert [s["bytes_read"] for s in stats] == [s["own"] * 4 for s in stats]
    assert sum(s["bytes_read"] + s["whole"] for s in stats) - 2 * 7 * 4 == tensor_bytes(path)
    assert all(s["whole"] == 7 * 4 for s in stats)  # the buffer, read whole by every rank
    assert sorted(os.listdir(path)) == sorted(set(index["weight_map"].values()) |
                                              {"model.safetensors.index.json"})


@pytest.mark.parametrize("dtype,tied", [("bf16", True), ("fp32", False)])
def test_save_hf_checkpoint_loads_in_from_pretrained_with_same_logits(pools, root, dtype, tied):
    from transformers import AutoModelForCausalLM
    path = os.path.join(root, f"saved-{dtype}-{tied}")
    pools(3).run(llama_save, path, dtype, tied)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    assert os.path.isfile(os.path.join(path, "generation_config.json"))
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = make_llama(SEED, tied)
    if dtype == "bf16":
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_bad_checkpoints_name_the_problem_on_every_rank(pools, root):
    from vescale_engine.checkpoint.safetensors_format import save_file
    ref = {k: v for k, v in make_llama(SEED).state_dict().items() if k != "lm_head.weight"}
    reference = os.path.join(root, "errors.pt")
    torch.save(make_llama(SEED).state_dict(), reference)
    cases = {
        "missing": {k: v for k, v in ref.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "unexpected": {**ref, "model.extra_gate.weight": torch.zeros(3)},
        "mismatch": {**ref, "model.norm.weight": torch.zeros(47)},
        "renamed": {k.replace("model.", "transformer.", 1): v for k, v in ref.items()},
        "both": {**{k: v for k, v in ref.items() if k != "model.norm.weight"},
                 "model.extra_gate.weight": torch.zeros(3)},
    }
    for name, tensors in cases.items():
        os.makedirs(os.path.join(root, name))
        save_file(tensors, os.path.join(root, name, "model.safetensors"))
    os.makedirs(os.path.join(root, "empty"))
    results = pools(2).run(load_errors, root, reference)
    assert results[0] == results[1]  # the same message on every rank
    (missing, unexpected, mismatch, renamed, empty), skipped, ignored = results[0]
    assert "missing keys: model.layers.1.mlp.up_proj.weight" in missing
    assert "unexpected keys: model.extra_gate.weight" in unexpected
    assert "model.norm.weight (file [47], model [48])" in mismatch
    assert "missing keys: model.embed_tokens.weight" in renamed and \
        "unexpected keys: transformer.embed_tokens.weight" in renamed
    assert os.path.join(root, "empty") in empty and "model.safetensors.index.json" in empty
    assert all("\n" not in e for e in (missing, unexpected, mismatch, renamed, empty))
    assert skipped == ["model.norm.weight"] and ignored == ["model.extra_gate.weight"]


def test_engine_loads_hf_checkpoint_from_config_and_load_checkpoint_points_to_it(pools,
                                                                                   pretrained):
    path, reference, _ = pretrained[torch.float32]
    results = pools(2).run(engine_hf, path, reference)
    assert results[0][0] == results[1][0]
    assert path in results[0][0] and "load_hf_checkpoint" in results[0][0]
    assert all(bytes_read > 0 for _, bytes_read in results)


def test_save_arguments_and_damaged_files_are_named(tmp_path):
    """max_shard_size and dtype as HF writes them, checked before any collective; a file whose
    header lies about its data is named with the tensor."""
    from vescale_engine.checkpoint.hf import HFCheckpointError, _save_dtype, parse_size, read_stored
    from vescale_engine.checkpoint.safetensors_format import save_file
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2**31 and parse_size("20KB") == 20000
    assert parse_size(1234) == 1234
    for bad in ("5 parsecs", "0", -1, True, "GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    assert _save_dtype("bf16") is torch.bfloat16 and _save_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="int8"):
        _save_dtype("int8")
    good = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6.0).view(2, 3)}, str(good))
    good.write_bytes(good.read_bytes()[:-4])  # truncated: the header says 24 data bytes
    with pytest.raises(ValueError, match=r"tensor w has bytes \[0, 24\)"):
        read_stored(tmp_path)
    with pytest.raises(HFCheckpointError, match="not a .safetensors file"):
        read_stored(__file__)


def test_initialize_meta_model_from_hf_checkpoint(pools, pretrained, root):
    path, reference, _ = pretrained[torch.float32]
    lacking = os.path.join(root, "lacking-norm")
    if not os.path.exists(lacking):
        model = make_llama(SEED)
        sd = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
        model.save_pretrained(lacking, state_dict=sd)
    results = pools(2).run(engine_hf_meta, path, reference, lacking)
    for same, err in results:
        assert same, "logits differ from the source model's"
        assert "model.norm.weight" in err and lacking in err, err


def test_a_sharded_model_keeps_the_class_names_transformers_reads(pools, root):
    path = os.path.join(root, "names")
    for out in pools(2).run(llama_names, path):
        assert out == {"fsdp module": True, "name": "LlamaForCausalLM", "causal lm": True,
                       "base model name": False, "no split found": True,
                       "class from name": True, "generate": True}, out
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"]
