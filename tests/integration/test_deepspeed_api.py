"""What Hugging Face Trainer and Accelerate call on a DeepSpeed engine, called on ours (2 gloo
ranks; reference: the same global batch trained in one process without sharding):

- set_gradient_accumulation_boundary driven as Accelerate drives it (boundary set before each
  backward, step() only at boundaries) and as DeepSpeed documents it (step() after every
  micro-batch), both with the engine's gradient communication decided by the boundary given;
- an optimizer instance (Trainer's create_optimizer) with schedulers built on it, passed to
  initialize, stepped by the script or passed as a callable;
- model_parameters=model.parameters() with every optimizer we ship;
- engine.config as the config dict, the 16-bit state dict gathered to rank 0 one DBuffer at a
  time, save_16bit_model, attribute forwarding and accelerate's unwrap_model;
- resuming a real DeepSpeed ZeRO-3 checkpoint continues its WarmupLR warmup and counters.

Tolerances: as tests/engine/test_engine.py (fp32 round-off of sharded vs one-process sums, 1e-6).
"""
import json
import os
import weakref

import pytest
import torch

from compare import relative_state
import fsdp_models as fm
from vescale_engine import initialize
from vescale_engine.fsdp import full_state_dict

MICRO, ACCUM, STEPS = 3, 2, 3
CLIP = 0.5
OPT = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}
WARMUP = {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
          "warmup_type": "linear"}
VESCALE = {"wrap_policy": {"module_classes": ["Block"]}, "granularity": {"default": "rows:16"}}
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
          "gradient_clipping": CLIP, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": OPT},
          "scheduler": {"type": "WarmupLR", "params": WARMUP}, "vescale": VESCALE}
TOLERANCE = 1e-6


# DeepSpeed (the ZeRO-3 checkpoint below) picks its CPU accelerator from DS_ACCELERATOR.
POOL_ENV = {"DS_ACCELERATOR": "cpu"}


def _micro_batches(step, rank, world):
    return fm.rank_micro_batches("gpt", step, rank, world, MICRO, ACCUM)


def _reference(world, make_optimizer, make_scheduler, steps=STEPS):
    """One process, the whole global batch: (losses, pre-clip grad norms, lrs, parameters)."""
    model = fm.make("gpt")
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    losses, norms, lrs = [], [], []
    for step in range(steps):
        idx, tgt = fm.batch("gpt", step, MICRO * ACCUM * world)
        loss = model(idx, tgt)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        lrs.append([g["lr"] for g in opt.param_groups])
    return losses, norms, lrs, model.state_dict()


def _warmup_reference(world):
    from deepspeed.runtime.lr_schedules import WarmupLR
    return _reference(world, lambda m: torch.optim.AdamW(m.parameters(), **OPT),
                      lambda opt: WarmupLR(opt, **WARMUP))


def _flat(lists):
    return [x for inner in lists for x in inner]


def _global_mean(losses):
    total = torch.tensor(losses)
    torch.distributed.all_reduce(total)
    return (total / torch.distributed.get_world_size()).tolist()


# -- set_gradient_accumulation_boundary -----------------------------------------------------------

def boundary_rank(rank, world, style, local):
    """Accumulation 2 driven by the boundary the caller sets. "accelerate": set before each
    backward (after the forward), step() only at boundaries (Accelerate's
    DeepSpeedEngineWrapper.backward). "deepspeed": set before each micro-batch, step() after
    every one (DeepSpeed's documented use)."""
    ref_losses, ref_norms, ref_lrs, ref_state = _warmup_reference(world)
    engine, *_ = initialize(model=fm.make("gpt"), config={
        **CONFIG, "vescale": {**VESCALE, "local_grad_accumulation": local}})
    losses, norms, lrs, seen = [], [], [], []
    for step in range(STEPS):
        window = 0.0
        for k, (idx, tgt) in enumerate(_micro_batches(step, rank, world)):
            last = k == ACCUM - 1
            if style == "deepspeed":
                engine.set_gradient_accumulation_boundary(last)
            loss = engine(idx, tgt)
            if style == "accelerate":
                engine.set_gradient_accumulation_boundary(last)
            seen.append(engine.is_gradient_accumulation_boundary())
            engine.backward(loss)
            if style == "deepspeed" or last:
                engine.step()
            window += loss.item() / ACCUM
        losses.append(window)
        norms.append(engine.get_global_grad_norm())
        lrs.append(engine.get_lr())
    losses = _global_mean(losses)
    params = relative_state(full_state_dict(engine.module), ref_state)
    assert seen == [False, True] * STEPS
    steps, micro_steps, samples = engine.global_steps, engine.micro_steps, engine.global_samples
    # DeepSpeed's counters: micro_steps counts step() calls, samples a batch per step
    assert steps == STEPS and samples == STEPS * MICRO * ACCUM * world
    assert micro_steps == (STEPS if style == "accelerate" else STEPS * ACCUM)
    assert params < TOLERANCE, params
    for ours, ref in zip(losses, ref_losses, strict=True):
        assert abs(ours - ref) <= TOLERANCE * ref, (losses, ref_losses)
    for ours, ref in zip(norms, ref_norms, strict=True):
        assert abs(ours - ref) <= 1e-5 * ref, (norms, ref_norms)
    assert _flat(lrs) == pytest.approx(_flat(ref_lrs), rel=1e-12)
    assert lrs[0] < lrs[-1]  # warming up


@pytest.mark.parametrize("style,local", [("accelerate", False), ("accelerate", True),
                                         ("deepspeed", False)],
                         ids=["accelerate", "accelerate-local_grad_accumulation", "deepspeed"])
def test_accumulation_boundary_given_by_the_caller(pool, style, local):
    """The engine takes the boundary it is given: a no-op would take an optimizer step only
    every second window under Accelerate's loop (half the steps, wrong parameters)."""
    pool.run(boundary_rank, style, local)


# -- an optimizer instance, schedulers built on it ------------------------------------------------

def _decayed(name):
    return not (name.endswith("bias") or name.startswith("ln") or ".ln" in name)


def _groups(model):
    """As Trainer's create_optimizer: weight decay but for biases and norms (by name: the
    wrapped model's parameters are flat pieces), here with its own lr too."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if _decayed(n)], "weight_decay": 0.1},
            {"params": [p for n, p in named if not _decayed(n)], "weight_decay": 0.0,
             "lr": 5e-4}]


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def instance_rank(rank, world, scheduler):
    """An AdamW instance over the unwrapped model's parameter groups (with a hook on it), and
    its LambdaLR warmup: "script" steps the scheduler itself after each optimizer step
    (Accelerate does that with a scheduler it does not pass on), "passed" gives it to
    initialize, "callable" gives initialize a callable(optimizer) (Accelerate's
    lr_scheduler_callable)."""
    def adamw(m):
        return torch.optim.AdamW(_groups(m), lr=1e-3, eps=1e-6)
    ref_losses, _, ref_lrs, ref_state = _reference(world, adamw, _warmup)
    model = fm.make("gpt")
    instance = adamw(model)
    hook_calls = []
    instance.register_step_post_hook(lambda *_: hook_calls.append(1))
    sched = _warmup(instance) if scheduler != "callable" else None
    passed = {"script": None, "passed": sched, "callable": _warmup}[scheduler]
    config = {k: v for k, v in CONFIG.items() if k not in ("optimizer", "scheduler")}
    engine, opt, _, engine_sched = initialize(model=model, optimizer=instance,
                                              lr_scheduler=passed, config=config)
    same_params = [id(p) for g in opt.param_groups for p in g["params"]] == \
        [id(p) for g in _groups(engine.module) for p in g["params"]]
    losses, lrs = [], []
    for step in range(STEPS):
        window = 0.0
        for idx, tgt in _micro_batches(step, rank, world):
            loss = engine(idx, tgt)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary and scheduler == "script":
                sched.step()
            window += loss.item() / ACCUM
        losses.append(window)
        lrs.append([g["lr"] for g in opt.param_groups])
    losses = _global_mean(losses)
    params = relative_state(full_state_dict(engine.module), ref_state)
    identity = (opt is instance, engine.optimizer is instance,
                scheduler == "script" or engine_sched is engine.lr_scheduler)
    assert identity == (True, True, True)  # the same object, rebuilt in place
    assert same_params and len(hook_calls) == STEPS and opt.overflow is False
    assert params < TOLERANCE, params
    for ours, ref in zip(losses, ref_losses, strict=True):
        assert abs(ours - ref) <= TOLERANCE * ref, (losses, ref_losses)
    assert _flat(lrs) == pytest.approx(_flat(ref_lrs), rel=1e-12)
    assert lrs[0] != lrs[-1]  # the warmup reached the engine's optimizer


@pytest.mark.parametrize("scheduler", ["script", "passed", "callable"])
def test_optimizer_instance_is_rebuilt_over_the_shards(pool, scheduler):
    pool.run(instance_rank, scheduler)


# -- model_parameters with every optimizer we ship ------------------------------------------------

SHIPPED = {"AdamW": {"type": "AdamW", "params": OPT},
           "AdamW8bit": {"type": "AdamW8bit", "params": {**OPT, "block": "block:64"}},
           "Muon": {"type": "Muon", "params": {"lr": 0.02, "ns_dtype": "fp32"}},
           "SGD": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}


def model_parameters_rank(rank, world, kind):
    """initialize(model=m, model_parameters=m.parameters(), config=...) trains exactly as
    initialize(model=m, config=...) with the same optimizer."""
    out = []
    for pass_parameters in (True, False):
        model = fm.make("gpt")
        config = {**CONFIG, "optimizer": SHIPPED[kind]}
        del config["scheduler"]
        extra = {"model_parameters": model.parameters()} if pass_parameters else {}
        engine, opt, _, _ = initialize(model=model, config=config, **extra)
        for step in range(2):
            for idx, tgt in _micro_batches(step, rank, world):
                engine.backward(engine(idx, tgt))
                engine.step()
        out.append((type(opt).__name__, opt.overflow, full_state_dict(engine.module)))
    (name, overflow, with_params), (name_without, _, without) = out
    same = all(torch.equal(with_params[k], without[k]) for k in without)
    assert name == name_without == kind and overflow is False and same


@pytest.mark.parametrize("kind", list(SHIPPED))
def test_model_parameters_with_every_optimizer(pool, kind):
    pool.run(model_parameters_rank, kind)


# -- engine.config, the 16-bit state dict, forwarding, unwrap -------------------------------------

def consolidated_rank(rank, world, out_dir):
    """bf16 with stage3_gather_16bit_weights_on_model_save: the state dict of the model in bf16
    on rank 0, {} elsewhere; every all-gather starts with no earlier gathered buffer alive."""
    from vescale_engine.fsdp import state_dict as fsdp
    from vescale_engine.fsdp.lookup import units_under
    from vescale_engine.fsdp.state_dict import all_gather_master
    config = {**CONFIG, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3,
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    model = fm.make("gpt")
    model.wpe.weight.requires_grad_(False)
    engine, *_ = initialize(model=model, config=config)
    alive_at_gather, gathered = [], []

    def spy(full, buf):
        alive_at_gather.append(sum(ref() is not None for ref in gathered))
        gathered.append(weakref.ref(full))
        all_gather_master(full, buf)
    fsdp.all_gather_master = spy
    try:
        sd = engine._zero3_consolidated_16bit_state_dict()
        unfrozen = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    finally:
        fsdp.all_gather_master = all_gather_master
    buffers = sum(len(u.buffers) for u in units_under(engine.module))
    masters = full_state_dict(engine.module)
    saved = engine.save_16bit_model(out_dir)
    file = os.path.join(out_dir, "pytorch_model.bin")
    on_disk = torch.load(file, weights_only=True) if rank == 0 else None

    plain, *_ = initialize(model=fm.make("gpt"), config=CONFIG)  # fp32, the default: no gather
    fp32 = plain._zero3_consolidated_16bit_state_dict()
    not_saved = plain.save_16bit_model(os.path.join(out_dir, "plain"))
    result = dict(
        config=(engine.config is engine.engine_config.raw,
                engine.config.get("zero_optimization", {}).get("stage"),  # Trainer's save_model
                engine.zero_optimization_stage(), engine.zero_gather_16bit_weights_on_model_save(),
                plain.zero_gather_16bit_weights_on_model_save()),
        gathers=(alive_at_gather, 2 * buffers), saved=saved, not_saved=not_saved,
        plain_dir=os.path.exists(os.path.join(out_dir, "plain")), empty=(sd == {}, fp32 == {}))
    if rank == 0:
        result.update(
            keys=(list(sd), list(unfrozen)), dtypes={str(v.dtype) for v in sd.values()},
            values=all(torch.equal(sd[k], masters[k].to(torch.bfloat16)) for k in masters),
            tied=sd["head.weight"] is sd["wte.weight"],
            on_disk=list(on_disk) == list(sd) and all(torch.equal(on_disk[k], sd[k]) for k in sd),
            fp32=({str(v.dtype) for v in fp32.values()},
                  all(torch.equal(fp32[k], v) for k, v in full_state_dict(plain.module).items())))
    else:
        full_state_dict(plain.module)  # collective: rank 0 gathers
    return result


def test_16bit_state_dict_gathered_to_rank0_one_buffer_at_a_time(pool, tmp_path):
    results = pool.run(consolidated_rank, str(tmp_path))
    expected_keys = list(fm.make("gpt").state_dict())
    for rank, r in enumerate(results):
        assert r["config"] == (True, 3, 3, True, False)
        alive, gathers = r["gathers"]
        assert alive == [0] * gathers, alive  # one DBuffer held at a time, on every rank
        assert r["saved"] is True and r["not_saved"] is False and not r["plain_dir"]
        assert r["empty"] == ((False, False) if rank == 0 else (True, True))
    r = results[0]
    assert sorted(r["keys"][0]) == sorted(expected_keys)
    assert sorted(r["keys"][1]) == sorted(k for k in expected_keys if k != "wpe.weight")
    assert r["dtypes"] == {"torch.bfloat16"} and r["values"] and r["tied"] and r["on_disk"]
    assert r["fp32"] == ({"torch.float32"}, True)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def forwarding_rank(rank, world):
    import deepspeed
    import vescale_engine
    from accelerate import Accelerator
    from transformers.modeling_utils import unwrap_model
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    model = tiny_llama()
    model.custom_tag = "kept"
    engine, *_ = initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                 "steps_per_print": 1000, "vescale": {}})
    forwarded = (engine.custom_tag, engine.get_input_embeddings() is model.get_input_embeddings(),
                 engine.generation_config is model.generation_config,
                 isinstance(engine.config, dict))  # the engine's own attributes come first
    try:
        engine.no_such_attribute
        missing = None
    except AttributeError as err:
        missing = str(err)
    try:  # the model's own save_pretrained would write flat shard pieces
        engine.save_pretrained("unused-dir")
        unguarded = True
    except ValueError as err:
        unguarded = str(err)
    before = Accelerator.unwrap_model(None, engine) is engine  # accelerate alone: not unwrapped
    original = deepspeed.initialize
    vescale_engine.patch_deepspeed()
    vescale_engine.patch_deepspeed()  # idempotent
    deepspeed.initialize = original
    from accelerate.utils import extract_model_from_parallel, other  # imported after the patch
    unwrapped = (Accelerator.unwrap_model(None, engine), extract_model_from_parallel(engine),
                 unwrap_model(engine))
    original_extract = other.extract_model_from_parallel.__vescale_original__
    assert forwarded == ("kept", True, True, True)
    assert missing == ("'VeScaleEngine' object has no attribute 'no_such_attribute', "
                       "and neither has its module (LlamaForCausalLM)")
    assert hasattr(engine, "nope") is False
    assert "save_pretrained without state_dict=" in unguarded, unguarded
    # Trainer's label smoothing asks the unwrapped model's class
    label_smoothing = unwrapped[0]._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    once = not hasattr(original_extract, "__vescale_original__")
    assert before and all(m is engine.module for m in unwrapped) and label_smoothing and once


def test_attributes_forward_to_the_model_and_accelerate_unwraps_the_engine(pool):
    pool.run(forwarding_rank)


def test_unwrap_patch_names_the_version_when_accelerate_moved_its_function(monkeypatch):
    import accelerate
    import accelerate.utils.other as other
    from vescale_engine.integrations.accelerate import patch_accelerate_unwrap
    monkeypatch.delattr(other, "extract_model_from_parallel")
    with pytest.raises(ImportError, match=f"accelerate {accelerate.__version__} has no "
                       "accelerate.utils.other.extract_model_from_parallel"):
        patch_accelerate_unwrap()


def test_gather_16bit_flag_under_every_name_deepspeed_accepts():
    from types import SimpleNamespace
    from vescale_engine.engine.config import build_config
    from vescale_engine.engine.surface import DeepSpeedSurface

    def answer(zero):
        cfg = build_config({"train_batch_size": 2, "zero_optimization": zero}, 2)
        return DeepSpeedSurface.zero_gather_16bit_weights_on_model_save(
            SimpleNamespace(engine_config=cfg))
    assert answer({"stage": 3}) is False  # DeepSpeed's default
    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):
        assert answer({key: True}) is True, key


# -- resuming DeepSpeed's ZeRO-3 checkpoint continues its warmup -----------------------------------

DS_WARMUP = {**WARMUP, "warmup_num_steps": 10}  # still warming up at the save


def zero3_warmup_rank(rank, world, ds_dir):
    import deepspeed
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    config = {**CONFIG, "optimizer": {"type": "AdamW", "params": {**OPT, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": DS_WARMUP},
              "zero_optimization": {"stage": 3}}
    ds_config = {k: v for k, v in config.items() if k != "vescale"}

    def run(engine, first):
        losses, lrs = [], []
        for step in range(first, first + STEPS):
            for idx, tgt in _micro_batches(step, rank, world):
                loss = engine(idx, tgt)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            lrs.append(engine.get_lr()[0])
        return losses, lrs

    model = fm.make("gpt")
    ds, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=ds_config)
    run(ds, 0)
    ds.save_checkpoint(ds_dir, client_state={"epoch": 3, "note": "hi"})  # tag global_step3
    saved = (ds.global_steps, ds.global_samples, ds.skipped_steps,
             ds.lr_scheduler.last_batch_iteration)
    ds_losses, ds_lrs = run(ds, STEPS)
    ds.destroy()

    engine, *_ = initialize(model=fm.make("gpt", seed=1), config=config)
    deepspeed_load_checkpoint(engine, ds_dir)  # what Trainer's resume calls
    loaded = (engine.global_steps, engine.global_samples, engine.skipped_steps,
              engine.lr_scheduler.last_batch_iteration)
    with open(os.path.join(ds_dir, ".global_step3.vescale", "global_step3",
                           "vescale_state.json")) as f:
        client = json.load(f)["client_state"]
    losses, lrs = run(engine, STEPS)
    assert loaded == saved and saved[0] == STEPS and saved[3] >= 0
    assert client == {"epoch": 3, "note": "hi"}
    assert lrs == pytest.approx(ds_lrs, rel=1e-12)
    assert lrs[0] < lrs[-1] < DS_WARMUP["warmup_max_lr"]  # still warming up
    for ours, theirs in zip(losses, ds_losses, strict=True):
        assert abs(ours - theirs) <= 1e-5 * theirs, (losses, ds_losses)


def test_deepspeed_zero3_checkpoint_resumes_its_warmup_and_counters(pool, tmp_path):
    pool.run(zero3_warmup_rank, str(tmp_path / "ds"), timeout=600)


def stage2_state_dict_rank(rank, world):
    """Accelerate reads the unwrapped model's state_dict() below stage 3; our parameters are
    sharded at every stage, so the patched get_state_dict gathers the full model to rank 0."""
    import deepspeed
    import vescale_engine
    from accelerate import Accelerator
    model = fm.make("gpt")
    engine, *_ = initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": 2}})
    original = deepspeed.initialize
    vescale_engine.patch_deepspeed()
    deepspeed.initialize = original
    sd = Accelerator.get_state_dict(None, engine)  # stage < 3: Accelerate's self is not read
    full = full_state_dict(engine.module)
    if rank:
        assert sd == {}
    else:
        assert sorted(sd) == sorted(full) and all(torch.equal(sd[k], full[k]) for k in full)


def test_accelerate_state_dict_below_stage3_is_the_full_model_on_rank0(pool):
    pool.run(stage2_state_dict_rank)
