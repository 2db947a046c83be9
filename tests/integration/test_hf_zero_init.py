"""Models built inside `deepspeed.zero.Init` under a vescale config, on 2 gloo ranks.

Transformers builds every model inside `deepspeed.zero.Init` when the config it holds
(HfDeepSpeedConfig, as TrainingArguments(deepspeed=...) makes it) says stage 3. With a vescale
section and `patch_deepspeed()` the model is built on meta, `from_pretrained` reads only the
safetensors headers, and `initialize` loads each rank's bytes: the engine must then hold and
train exactly what the same model loaded in one process holds (fp32 and bf16, tied and
untied, one file and an index of several); keys the file lacks must get transformers' own init
(a new classification head, a base-model checkpoint); `from_config` must give DeepSpeed's
values; the plain `with deepspeed.zero.Init(config_dict_or_path=cfg)` script form equals the
whole build; without a vescale section DeepSpeed's own partitioned model comes back; every
misuse is an error that names it (and the conversion a Mixtral checkpoint's error asks for
then loads exactly).
"""
import contextlib
import json
import os

import pytest
import torch

from compare import relative_state
import fsdp_models as fm
from dist_harness import scratch_dir

MICRO, SEQ, STEPS, SEED = 2, 12, 3, 7
TOLERANCE = 1e-5  # fp32 round-off of sharded vs one-process AdamW (see test_deepspeed_parity)
OPT = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01}
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
          "gradient_clipping": 0.0,  # the one-process reference does not clip
          "optimizer": {"type": "AdamW", "params": OPT},
          "zero_optimization": {"stage": 3}, "vescale": {}}
DEEPSPEED_ONLY = {key: value for key, value in CONFIG.items() if key != "vescale"}


# DeepSpeed's own zero.Init runs too (the baseline): its CPU accelerator and LOCAL_RANK
POOL_ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.fixture(scope="module")
def checkpoints(pool):
    directory = scratch_dir()
    pool.run(save_checkpoints, directory)
    return directory


# -- helpers run on the ranks ---------------------------------------------------------------

def llama_config(tied=True, **overrides):
    from transformers import LlamaConfig
    return LlamaConfig(**{**dict(vocab_size=96, hidden_size=48, intermediate_size=80,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=tied), **overrides})


def save_checkpoints(rank, world, directory):
    """Rank 0 writes every checkpoint the checks load (the others wait)."""
    from safetensors.torch import load_file, save_file
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, LlamaModel,
                              MixtralConfig, MixtralForCausalLM)
    if rank == 0:
        torch.manual_seed(SEED)
        LlamaForCausalLM(llama_config(tied=True)).save_pretrained(f"{directory}/tied")
        torch.manual_seed(SEED + 1)  # several files and an index
        LlamaForCausalLM(llama_config(tied=False)).save_pretrained(
            f"{directory}/untied", max_shard_size="20KB")
        torch.manual_seed(SEED + 2)
        LlamaModel(llama_config(tied=False)).save_pretrained(f"{directory}/base")
        torch.manual_seed(SEED + 3)  # lm_head dropped from the file: a missing key
        LlamaForCausalLM(llama_config(tied=False)).save_pretrained(f"{directory}/no_head")
        tensors = load_file(f"{directory}/no_head/model.safetensors")
        del tensors["lm_head.weight"]
        save_file(tensors, f"{directory}/no_head/model.safetensors", metadata={"format": "pt"})
        torch.manual_seed(SEED + 4)  # the classic format, which needs converting
        model = LlamaForCausalLM(llama_config(tied=True))
        model.config.save_pretrained(f"{directory}/bin")
        torch.save(model.state_dict(), f"{directory}/bin/pytorch_model.bin")
        torch.manual_seed(SEED + 5)  # a checkpoint of another shape
        LlamaForCausalLM(llama_config(intermediate_size=64)).save_pretrained(f"{directory}/wide")
        with open(f"{directory}/wide/config.json") as f:
            saved = json.load(f)
        with open(f"{directory}/wide/config.json", "w") as f:  # claims the shapes we build
            json.dump({**saved, "intermediate_size": 80}, f)
        tensors = load_file(f"{directory}/tied/model.safetensors")  # two keys for one name
        os.makedirs(f"{directory}/twice")
        twice = {**tensors, "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
        save_file(twice, f"{directory}/twice/model.safetensors", metadata={"format": "pt"})
        llama_config().save_pretrained(f"{directory}/twice")
        MixtralForCausalLM(MixtralConfig(  # per-expert tensors, merged as the model loads them
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
            num_experts_per_tok=1, max_position_embeddings=32)).save_pretrained(
                f"{directory}/mixtral")
        torch.manual_seed(SEED + 6)  # GPT-2's attention re-initializes its child c_proj;
        GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=48, n_layer=2,
                                   n_head=4)).save_pretrained(f"{directory}/gpt2")
        tensors = load_file(f"{directory}/gpt2/model.safetensors")
        del tensors["transformer.h.0.attn.c_attn.bias"]  # its loaded weight must draw nothing
        del tensors["transformer.h.0.attn.c_proj.weight"]
        save_file(tensors, f"{directory}/gpt2/model.safetensors", metadata={"format": "pt"})
    torch.distributed.barrier()


@contextlib.contextmanager
def hf_config(config):
    """What TrainingArguments(deepspeed=config) sets up for from_pretrained/from_config."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    held = HfDeepSpeedConfig(config)
    try:
        yield held
    finally:
        unset_hf_deepspeed_config()
        del held


def patched():
    import vescale_engine
    vescale_engine.patch_deepspeed()


def batches(step, world):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 96, (MICRO * world, SEQ), generator=generator)


def state(module) -> dict:
    """Parameters and persistent buffers (state_dict names, gathered when sharded) plus every
    buffer, non-persistent ones (rotary inv_freq) included."""
    from vescale_engine import full_state_dict
    sharded = any(hasattr(p, "_vescale") for p in module.parameters())
    out = full_state_dict(module) if sharded else \
        {k: v.detach().clone() for k, v in module.state_dict().items()}
    out.update({f"buffer:{k}": b.clone() for k, b in module.named_buffers()})
    return out


def record_of(model):
    from vescale_engine.fsdp.deferred import MARK
    return next(m.__dict__[MARK] for m in model.modules() if MARK in m.__dict__)


def deepspeed_gathered(model) -> dict:
    """DeepSpeed's partitioned model's state_dict, gathered one parameter at a time: DeepSpeed
    0.19.3's multi-parameter gather waits only its last all-gather (`launch_handles[-1].wait()`,
    fixed in 0.19.8), so on gloo's threads an earlier parameter can come back unfilled."""
    import deepspeed
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in names:
            with deepspeed.zero.GatheredParameters([tensor]):
                out[name] = tensor.detach().clone()
        else:
            out[name] = tensor.detach().clone()
    return out


def differing(got, want) -> list:
    return sorted(k for k in set(got) | set(want)
                  if k not in got or k not in want or got[k].dtype != want[k].dtype
                  or not torch.equal(got[k], want[k]))


def described(got, want, names) -> list:
    """The differing names with what differs (shape, first values), so that a failure says how."""
    def show(t):
        return "missing" if t is None else f"{tuple(t.shape)} {t.flatten()[:3].tolist()}"
    return [f"{k}: {show(got.get(k))} vs {show(want.get(k))}" for k in names]


def relative(got, want) -> float:
    """Over the parameters (not the "buffer:" entries)."""
    return relative_state(got, want, [k for k in want if not k.startswith("buffer:")])


def train_engine(engine, rank, world, steps):
    """Global mean loss per step (each rank trains its MICRO rows of the global batch)."""
    losses = []
    for step in range(steps):
        ids = batches(step, world)[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def train_reference(model, world, steps):
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses = []
    for step in range(steps):
        ids = batches(step, world)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- from_pretrained ------------------------------------------------------------------------

def pretrained_rank(rank, world, path, dtype_name, name):
    """One-process from_pretrained vs from_pretrained under the vescale config + the
    DeepSpeed call form of initialize: the same initial values (parameters and rotary
    buffers), the same first loss bit for bit, and (fp32) the same training."""
    import deepspeed
    from transformers import LlamaForCausalLM
    from vescale_engine.fsdp import sharded_parameters
    from vescale_engine.fsdp.deferred import deferred_record
    patched()
    dtype = getattr(torch, dtype_name)
    reference = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    want = state(reference)
    with hf_config(CONFIG):
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    on_meta = {p.device.type for p in model.parameters()}
    recorded = deferred_record(model).pretrained
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=CONFIG)
    got = state(engine.module)
    ids = batches(0, world)[rank * MICRO:(rank + 1) * MICRO]
    first = (engine(input_ids=ids, labels=ids).loss.item(),
             reference(input_ids=ids, labels=ids).loss.item())
    steps = 0 if dtype_name == "bfloat16" else STEPS
    losses = (train_engine(engine, rank, world, steps), train_reference(reference, world, steps))
    trained = relative(state(engine.module), state(reference)) if steps else 0.0
    result = record_of(engine.module).loaded
    own = sum(p.sharded.numel() for _, p in sharded_parameters(engine.module))
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    left = deferred_record(engine.module)
    engine.destroy()
    out = dict(on_meta=on_meta, files=(len(recorded.files), len(files)),
               dtype=str(recorded.dtype), initial=differing(got, want), first=first,
               losses=losses, trained=trained, left=left,
               read=(result.bytes_read, own * 4, sum(os.path.getsize(f) for f in recorded.files)))
    assert out["on_meta"] == {"meta"} and out["dtype"] == f"torch.{dtype_name}", out
    recorded_files, on_disk = out["files"]
    assert recorded_files == on_disk and (recorded_files == 1) == (name == "tied"), out
    read, own_fp32, total = out["read"]  # this rank's pieces only, from fp32 files
    assert read == own_fp32 < total / 1.5, out
    assert out["initial"] == [], out
    assert out["first"][0] == out["first"][1], out
    ours, ref = out["losses"]
    assert len(ours) == len(ref) and all(abs(a - b) <= TOLERANCE * abs(b)
                                         for a, b in zip(ours, ref)), out
    assert out["trained"] <= TOLERANCE, out
    assert out["left"] is None, out  # nothing left on meta


@pytest.mark.parametrize("name,dtype", [("tied", "float32"), ("untied", "float32"),
                                        ("tied", "bfloat16"), ("untied", "bfloat16")])
def test_from_pretrained_trains_as_the_model_loaded_in_one_process(pool, checkpoints, name,
                                                                  dtype):
    pool.run(pretrained_rank, f"{checkpoints}/{name}", dtype, name)


def missing_rank(rank, world, directory):
    """Keys the checkpoint lacks get transformers' own init, from the generator state
    from_pretrained started with (a draw in between does not matter): a new classification
    head on a causal-LM checkpoint, a base-model checkpoint (no "model." prefix) under a
    causal-LM head, a file without lm_head, tensors of the wrong shape with
    ignore_mismatched_sizes=True, and in GPT-2 a bias whose module's weight is loaded (its
    init must skip that weight, drawing nothing) and a projection its parent's init rewrites
    after its own. Each case: the missing keys expected, and no value differs."""
    import vescale_engine
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, LlamaForSequenceClassification
    patched()
    cases = [(LlamaForSequenceClassification, "untied", dict(num_labels=3)),
             (LlamaForCausalLM, "base", {}), (LlamaForCausalLM, "no_head", {}),
             (LlamaForCausalLM, "wide", dict(ignore_mismatched_sizes=True)),
             (GPT2LMHeadModel, "gpt2", {})]
    out = []
    for cls, name, kwargs in cases:
        torch.manual_seed(SEED)
        want = state(cls.from_pretrained(f"{directory}/{name}", **kwargs))
        torch.manual_seed(SEED)
        with hf_config(CONFIG):
            model, info = cls.from_pretrained(f"{directory}/{name}", output_loading_info=True,
                                              **kwargs)
        torch.rand(100)  # the script draws before initialize
        engine, *_ = vescale_engine.initialize(model=model, config=CONFIG)
        out.append((name, sorted(info["missing_keys"]), differing(state(engine.module), want)))
        engine.destroy()
    assert out == [("untied", ["score.weight"], []), ("base", ["lm_head.weight"], []),
                   ("no_head", ["lm_head.weight"], []), ("wide", [], []),
                   ("gpt2", ["transformer.h.0.attn.c_attn.bias",
                             "transformer.h.0.attn.c_proj.weight"], [])], out


def test_missing_keys_get_the_init_transformers_gives_them(pool, checkpoints):
    pool.run(missing_rank, checkpoints)


# -- from_config, the plain script form, DeepSpeed's own ------------------------------------

def transformers_init(config):
    """What DeepSpeed's from_config gives under ZeRO-3, in one process: the build without
    init, then transformers' initialize_weights, then the ties."""
    from transformers import LlamaForCausalLM
    from transformers import initialization
    with torch.device("meta"), initialization.no_init_weights():
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.initialize_weights()
    model.tie_weights()
    return model


def from_config_rank(rank, world):
    """from_config under the vescale config + initialize (with a draw in between) equals
    DeepSpeed's from_config (gathered), for tied and untied embeddings."""
    import deepspeed
    import vescale_engine
    from transformers import AutoModelForCausalLM
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")  # the pool's group: reused
    patched()
    out = []
    for tied in (True, False):
        config = llama_config(tied=tied)
        torch.manual_seed(SEED)
        want = state(transformers_init(config))
        torch.manual_seed(SEED)
        with hf_config(CONFIG):
            model = AutoModelForCausalLM.from_config(config)
        torch.rand(100)
        engine, *_ = vescale_engine.initialize(model=model, config=CONFIG)
        ours = differing(state(engine.module), want)
        engine.destroy()
        torch.manual_seed(SEED)
        with hf_config(DEEPSPEED_ONLY):
            theirs = AutoModelForCausalLM.from_config(config)
        partitioned = all(hasattr(p, "ds_id") for p in theirs.parameters())
        deepspeed_values = deepspeed_gathered(theirs)
        want_params = {k: v for k, v in want.items() if not k.startswith("buffer:")}
        out.append((tied, ours, partitioned, described(deepspeed_values, want_params,
                                           differing(deepspeed_values, want_params))))
    assert out == [(True, [], True, []), (False, [], True, [])], out


def test_from_config_gives_deepspeeds_values(pool):
    pool.run(from_config_rank)


def deepspeed_pretrained_rank(rank, world, path):
    """Without a vescale section DeepSpeed's own zero.Init and loader run: partitions whose
    gathered values are the checkpoint's."""
    import deepspeed
    from transformers import LlamaForCausalLM
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    patched()
    want = LlamaForCausalLM.from_pretrained(path).state_dict()
    with hf_config(DEEPSPEED_ONLY):
        model = LlamaForCausalLM.from_pretrained(path)
    shapes = {tuple(p.shape) for p in model.parameters()}
    got = deepspeed_gathered(model)
    diff = differing(got, want)
    assert shapes == {(0,)} and diff == [], (shapes, diff)


def test_without_a_vescale_section_deepspeed_partitions_as_before(pool, checkpoints):
    pool.run(deepspeed_pretrained_rank, f"{checkpoints}/tied")


def script_rank(rank, world, directory):
    """A plain DeepSpeed script: `with deepspeed.zero.Init(config_dict_or_path=...)` (a dict,
    and a JSON file), model.to(device) and a draw before deepspeed.initialize: the weights and
    the losses of the whole build, bit for bit."""
    import deepspeed
    config = {**CONFIG, "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}
    path = f"{directory}/script_config.json"
    if rank == 0:
        with open(path, "w") as f:
            json.dump(config, f)
    torch.distributed.barrier()
    patched()

    def run(build):
        torch.manual_seed(SEED)
        model = build()
        model.to("cpu")  # scripts do; under vescale it waits for initialize
        torch.rand(100)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        initial = state(engine.module)
        losses = []
        for step in range(2):
            idx, tgt = fm.batch("gpt", step, MICRO * world)
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = engine(idx[mine], tgt[mine])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        after = state(engine.module)
        engine.destroy()
        return initial, losses, after

    def inside(source):
        def build():
            with deepspeed.zero.Init(config_dict_or_path=source):
                model = fm.GPT()
            assert {p.device.type for p in model.parameters()} == {"meta"}
            return model
        return build
    whole = run(fm.GPT)
    out = []
    for source in (config, path):
        initial, losses, after = run(inside(source))
        out.append((differing(initial, whole[0]), losses == whole[1], differing(after, whole[2])))
    assert out == [([], True, []), ([], True, [])], out


def test_the_plain_zero_init_script_form_equals_the_whole_build(pool, checkpoints):
    pool.run(script_rank, checkpoints)


# -- every misuse names itself --------------------------------------------------------------

class GathersWhileBuilt(torch.nn.Module):
    """As wav2vec2's positional convolution under ZeRO-3: GatheredParameters in __init__."""

    def __init__(self):
        import deepspeed
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        with deepspeed.zero.GatheredParameters(self.linear.weight, modifier_rank=0):
            self.scale = torch.nn.Parameter(self.linear.weight.norm(dim=1))


def _error(fn, kinds=(ValueError, RuntimeError)):
    try:
        fn()
    except kinds as err:
        return f"{type(err).__name__}: {err}"
    return None


def errors_rank(rank, world, directory):
    import deepspeed
    import vescale_engine
    from transformers import LlamaForCausalLM
    from vescale_engine.fsdp.deferred import deferred_record
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    patched()
    out = {}

    def pretrained(name="tied", **kwargs):
        with hf_config(CONFIG):
            return LlamaForCausalLM.from_pretrained(f"{directory}/{name}", **kwargs)
    out["bin"] = _error(lambda: pretrained("bin"))
    out["twice"] = _error(lambda: pretrained("twice"))
    from transformers import MixtralForCausalLM
    with hf_config(CONFIG):
        out["conversion"] = _error(lambda: MixtralForCausalLM.from_pretrained(
            f"{directory}/mixtral"))
    reference = MixtralForCausalLM.from_pretrained(f"{directory}/mixtral")  # the advice:
    if rank == 0:
        reference.save_pretrained(f"{directory}/mixtral_merged", save_original_format=False)
    torch.distributed.barrier()
    with hf_config(CONFIG):
        merged = MixtralForCausalLM.from_pretrained(f"{directory}/mixtral_merged")
    engine, *_ = vescale_engine.initialize(model=merged, config=CONFIG)
    out["converted"] = differing(state(engine.module), state(reference))
    engine.destroy()
    out["wide"] = _error(lambda: pretrained("wide"))
    with hf_config(CONFIG):
        out["state_dict"] = _error(lambda: LlamaForCausalLM.from_pretrained(
            None, config=llama_config(), state_dict=fm.GPT().state_dict()))

    with hf_config(CONFIG):  # as in a Trainer script, the config stays in play
        model = LlamaForCausalLM.from_pretrained(f"{directory}/tied")
        out["resize"] = _error(lambda: model.resize_token_embeddings(100))
    out["gathered"] = _error(lambda: deepspeed.zero.GatheredParameters(
        model.lm_head.weight, modifier_rank=0).__enter__())
    out["to_empty"] = _error(lambda: model.to_empty(device="cpu"))
    out["no_such_device"] = _error(lambda: model.to("cuda:99"))  # a move that cannot happen
    model.half()  # a cast applies on meta: the load then casts into float16
    out["half"] = {p.dtype for p in model.parameters()}
    engine, *_ = vescale_engine.initialize(model=model, config=CONFIG)
    out["half_loaded"] = {p.dtype for p in engine.module.parameters()}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # it gathers
        out["sharded"] = {tuple(p.shape) == tuple(p.ds_shape)
                          for p in engine.module.parameters()}
    engine.destroy()

    def init(**kwargs):
        with deepspeed.zero.Init(**{"config_dict_or_path": CONFIG, **kwargs}):
            return fm.GPT()
    out["remote_device"] = _error(lambda: init(remote_device="cpu"))
    out["offload"] = _error(lambda: init(config_dict_or_path={
        **CONFIG, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    out["dtype"] = _error(lambda: init(dtype=torch.float16))
    out["module"] = _error(lambda: init(module=fm.GPT()))
    out["mpu"] = _error(lambda: init(mpu=object()))
    out["quantized"] = _error(lambda: init(zero_quantized_weights=True))
    out["same_dtype"] = {p.device.type for p in init(dtype=torch.float32).parameters()}
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        built = GathersWhileBuilt()  # gathering during the build passes
    out["gathered_later"] = _error(lambda: deepspeed.zero.GatheredParameters(
        built.linear.weight).__enter__())
    out["disabled"] = {p.device.type for p in init(enabled=False).parameters()}

    with deepspeed.zero.Init(config_dict_or_path=DEEPSPEED_ONLY):  # DeepSpeed's own
        partitioned = fm.GPT()
    out["partitioned"] = _error(lambda: deepspeed.initialize(model=partitioned, config=CONFIG))

    model = pretrained()  # initialize wraps it before it finds out
    out["part"] = _error(lambda: vescale_engine.initialize(model=model.model, config=CONFIG))

    from vescale_engine.integrations.transformers import check_transformers
    check_transformers()  # this transformers has every name the steps rely on
    out["transformers"] = _error(lambda: check_transformers(
        [("transformers.modeling_utils", "PreTrainedModel.renamed_away")]), ImportError)

    model = pretrained()  # transformers loaded it another way: nothing may train
    record = deferred_record(model)
    record.root = record.pretrained = None
    out["unrecorded"] = _error(lambda: vescale_engine.initialize(model=model, config=CONFIG))
    return out


def test_misuse_is_an_error_that_names_it(pool, checkpoints):
    out = pool.run(errors_rank, checkpoints)
    assert out[0].keys() == out[1].keys()
    for rank, errors in enumerate(out):
        assert "pytorch_model.bin is not a safetensors file" in errors["bin"], errors
        assert "convert the checkpoint once" in errors["bin"], errors
        assert "ignore_mismatched_sizes" in errors["wide"], errors  # transformers' report
        assert "checkpoint keys embed_tokens.weight and model.embed_tokens.weight both give " \
            "model.embed_tokens.weight" in errors["twice"], errors
        assert "checkpoint key model.layers.0.block_sparse_moe.experts.0.w1.weight" in \
            errors["conversion"] and "needs one of transformers' weight conversions into " \
            "model.layers.0.mlp.experts.gate_up_proj" in errors["conversion"], errors
        assert errors["converted"] == [], errors  # the conversion the message says loads
        assert errors["state_dict"].startswith("ValueError: from_pretrained(") and \
            "state_dict= is not supported" in errors["state_dict"], errors
        assert "GatheredParameters (called from" in errors["resize"] and \
            "resize_token_embeddings" in errors["resize"], errors["resize"]
        assert "no values until initialize" in errors["gathered"], errors
        assert "to_empty(...)" in errors["to_empty"], errors
        assert "Embedding.to(...) on a model built under deepspeed.zero.Init with a vescale " \
            "config: " in errors["no_such_device"], errors
        assert "a part of the LlamaForCausalLM" in errors["part"], errors
        assert errors["half"] == {torch.float16} and errors["half_loaded"] == {torch.float16}
        assert errors["sharded"] == {True}, errors  # after initialize (test_deepspeed_params)
        assert "remote_device='cpu' keeps parameters off the accelerator" in \
            errors["remote_device"], errors
        assert "offload_param.device='nvme'" in errors["offload"], errors
        assert "dtype=torch.float16 is not the config's precision" in errors["dtype"], errors
        assert "module= partitions a model that is already built" in errors["module"], errors
        assert "mpu= (model parallelism)" in errors["mpu"], errors
        assert "ZeRO++ quantized" in errors["quantized"], errors
        assert errors["same_dtype"] == {"meta"} and errors["disabled"] == {"cpu"}, errors
        assert "no values until initialize" in errors["gathered_later"], errors
        assert "is a DeepSpeed ZeRO-3 partition" in errors["partitioned"], errors
        assert "did not call _load_pretrained_model" in errors["unrecorded"], errors
        assert "needs transformers.modeling_utils.PreTrainedModel.renamed_away, which " \
            "transformers 5." in errors["transformers"], errors
        for key, message in errors.items():
            if isinstance(message, str):
                assert "\n" not in message.split(": ", 1)[1] or key == "wide", (key, message)


# -- without ranks ---------------------------------------------------------------------------

def test_the_build_records_the_cuda_generator_only_when_cuda_is_in_use(monkeypatch):
    from vescale_engine.integrations.deepspeed import zero_init
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert zero_init._generator_devices() == {torch.device("cpu")}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert zero_init._generator_devices() == {torch.device("cpu"), torch.device("cuda", 3)}


def test_the_config_precision_decides_which_dtype_zero_init_accepts():
    from vescale_engine.integrations.deepspeed.zero_init import (config_dtype,
                                                                 refuse_changed_meaning)
    assert config_dtype({}) == torch.float32
    assert config_dtype({"bf16": {"enabled": True}}) == torch.bfloat16
    assert config_dtype({"fp16": {"enabled": True}}) == torch.float16
    assert config_dtype({"bf16": {"enabled": "auto"}}) is None
    refuse_changed_meaning({"bf16": {"enabled": True}}, {"dtype": torch.bfloat16})
    refuse_changed_meaning({"bf16": {"enabled": "auto"}}, {"dtype": torch.float16})
    with pytest.raises(ValueError, match="data_parallel_group= partitions over a subgroup"):
        refuse_changed_meaning({}, {"data_parallel_group": object()})
