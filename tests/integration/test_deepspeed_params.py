"""DeepSpeed's per-parameter ZeRO-3 surface on vescale-sharded parameters, on 2 gloo ranks, as
TRL 1.16, PEFT 0.21 and transformers 5.24 read it (vescale_engine/integrations/deepspeed/params.py):
`ds_status` / `ds_shape`, `deepspeed.zero.GatheredParameters` (read, `modifier_rank` write,
mixed lists, nesting, inside forward), TRL's fused LM head and TRL's own
`_unwrap_model_for_generation` (greedy ids, then training still equal to one process).

The reference is one process: the same tiny LlamaForCausalLM (copied before initialize) trained
with torch's AdamW on the same batch, which both ranks see (so the averaged gradient is the
batch's)."""
import contextlib
import copy
import types

import pytest
import torch


SEQ, SEED = 10, 3
TOLERANCE = 1e-5  # fp32 round-off of sharded vs one-process AdamW
OPT = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01}
CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": OPT},
          "zero_optimization": {"stage": 3}, "vescale": {}}


POOL_ENV = {"DS_ACCELERATOR": "cpu"}


def llama(tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(SEED)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def tokens(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, 64, (2, SEQ), generator=g)


def pair(config=CONFIG, tied=False):
    """(engine, one-process reference model, its optimizer), both from the same init."""
    import vescale_engine
    vescale_engine.patch_deepspeed()
    model = llama(tied)
    reference = copy.deepcopy(model)
    engine, *_ = vescale_engine.initialize(model=model, config=config)
    opt = torch.optim.AdamW(reference.parameters(), lr=OPT["lr"], betas=OPT["betas"],
                            eps=OPT["eps"], weight_decay=OPT["weight_decay"])
    return engine, reference, opt


def train_both(engine, reference, opt, step, engine_context=contextlib.nullcontext, **forward):
    """One step on each; the two losses."""
    ids = tokens(step)
    with engine_context():
        loss = engine(ids, labels=ids, **forward).loss
        engine.backward(loss)
        engine.step()
    ref = reference(ids, labels=ids, **forward).loss
    ref.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), ref.item()


def full_state(engine):
    from vescale_engine import full_state_dict
    return full_state_dict(engine.module)


def max_difference(engine, reference) -> float:
    ours, theirs = full_state(engine), reference.state_dict()
    assert ours.keys() == theirs.keys()
    return max((ours[k] - theirs[k]).abs().max().item() for k in ours)


@contextlib.contextmanager
def zero3_enabled():
    """What TrainingArguments(deepspeed=...) holds: is_deepspeed_zero3_enabled() is true."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    held = HfDeepSpeedConfig(CONFIG)
    try:
        yield held
    finally:
        unset_hf_deepspeed_config()
        del held


# -- the attributes, as the libraries read them ---------------------------------------------------

def attributes_rank(rank, world):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as S
    from peft.tuners.tuners_utils import _get_in_out_features
    from transformers.pytorch_utils import Conv1D
    engine, reference, _ = pair()
    shapes = {n: p.shape for n, p in reference.named_parameters()}
    out = {"plain": [hasattr(torch.nn.Parameter(torch.ones(1)), a)
                     for a in ("ds_status", "ds_shape")]}
    named = dict(engine.module.named_parameters())
    out["shape"] = all(p.ds_shape == shapes[n] for n, p in named.items())
    out["status"] = {p.ds_status for p in named.values()} == {S.NOT_AVAILABLE}
    out["left_out"] = [a for a in ("ds_numel", "ds_id", "ds_tensor")
                       if any(hasattr(p, a) for p in named.values())]
    # DeepSpeed's own parameters keep what DeepSpeed stores on them
    theirs = torch.nn.Parameter(torch.ones(2))
    theirs.ds_status, theirs.ds_shape = S.INFLIGHT, torch.Size([4, 4])
    out["deepspeed_own"] = (theirs.ds_status, theirs.ds_shape) == (S.INFLIGHT, (4, 4))
    del theirs.ds_status
    out["deleted"] = hasattr(theirs, "ds_status")
    # PEFT sizes a Conv1D adapter from ds_shape (peft/tuners/tuners_utils.py)
    conv = Conv1D(24, 16)
    from vescale_engine import fully_shard
    fully_shard(conv)
    out["peft_features"] = _get_in_out_features(conv)
    # inside the unit's forward the module holds the full-shape parameter: AVAILABLE
    seen = []
    head = engine.module.lm_head
    hook = engine.module.model.register_forward_hook(
        lambda *a: seen.append((head.weight.ds_status, tuple(head.weight.shape))))
    with torch.no_grad():
        engine(tokens(0))
    hook.remove()
    out["in_forward"] = seen == [(S.AVAILABLE, (64, 32))]
    out["after"] = head.weight.ds_status == S.NOT_AVAILABLE
    engine.destroy()
    assert out["plain"] == [False, False], out      # other parameters: as before
    assert out["shape"] and out["status"], out
    assert out["left_out"] == [], out
    assert out["deepspeed_own"] and not out["deleted"], out
    assert out["peft_features"] == (16, 24), out    # (in, out), not the flat piece's
    assert out["in_forward"] and out["after"], out


def test_ds_attributes_are_what_trl_and_peft_read(pool):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: F401
    pool.run(attributes_rank)


# -- GatheredParameters ---------------------------------------------------------------------------

def gathered_rank(rank, world):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as S
    engine, reference, opt = pair()
    out = {}
    model = engine.module
    held = list(model.parameters())  # references taken before, as TRL takes them
    with deepspeed.zero.GatheredParameters(model.parameters()):
        ours = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["held_full"] = all(tuple(p.shape) == tuple(p.ds_shape) and p.ds_status == S.AVAILABLE
                               for p in held)
        with deepspeed.zero.GatheredParameters([model.lm_head.weight]):  # nested: held already
            out["nested"] = tuple(model.lm_head.weight.shape)
        with torch.no_grad():
            logits = model(tokens(0)).logits  # a forward inside computes with them
        model.lm_head.weight.data.zero_()  # dropped on exit: no modifier_rank
    theirs = dict(reference.named_parameters())
    out["read"] = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
    out["logits"] = (logits - reference(tokens(0)).logits).abs().max().item()
    out["restored"] = all(p.dim() == 1 and p.ds_status == S.NOT_AVAILABLE for p in held)
    out["dropped"] = max_difference(engine, reference)

    # modifier_rank=0: rank 0's change reaches every rank's shard; rank 1's is overwritten
    plain = torch.nn.Parameter(torch.ones(3))  # a mixed list: the rest goes to DeepSpeed's
    embed = model.model.embed_tokens.weight
    with deepspeed.zero.GatheredParameters([embed, model.lm_head.weight, plain],
                                           modifier_rank=0):
        with torch.no_grad():
            embed.mul_(0.5 if rank == 0 else 7.0)
            model.lm_head.weight[3].fill_(0.25 if rank == 0 else -1.0)
    with torch.no_grad():
        reference.model.embed_tokens.weight.mul_(0.5)
        reference.lm_head.weight[3].fill_(0.25)
    out["written"] = max_difference(engine, reference)
    out["train"] = [train_both(engine, reference, opt, step) for step in range(3)]
    out["trained"] = max_difference(engine, reference)

    # a change of shape under modifier_rank is refused on every rank, shards untouched
    try:
        with deepspeed.zero.GatheredParameters([embed], modifier_rank=0):
            if rank == 0:
                embed.data = torch.zeros(3, 3)
        out["shape_change"] = None
    except RuntimeError as err:
        out["shape_change"] = str(err)
    out["after_refusal"] = max_difference(engine, reference)
    try:
        with deepspeed.zero.GatheredParameters(model.lm_head.weight, fwd_module=model):
            pass
        out["fwd_module"] = None
    except NotImplementedError as err:
        out["fwd_module"] = str(err)
    engine.destroy()

    # bf16 compute: a read holds what forward computes with (DeepSpeed's bf16 parameters), a
    # write the fp32 master
    engine, reference, _ = pair({**CONFIG, "bf16": {"enabled": True}})
    master = full_state(engine)["lm_head.weight"]
    weight = engine.module.lm_head.weight
    with deepspeed.zero.GatheredParameters([weight]):
        out["bf16_read"] = (weight.dtype, torch.equal(weight, master.to(torch.bfloat16)))
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        out["bf16_write"] = (weight.dtype, torch.equal(weight, master))
    out["bf16_kept"] = torch.equal(full_state(engine)["lm_head.weight"], master)
    engine.destroy()
    assert out["held_full"] and out["nested"] == (64, 32), out
    assert out["read"] == 0.0 and out["logits"] < 1e-5, out
    assert out["restored"] and out["dropped"] == 0.0, out
    assert out["written"] == 0.0, out
    for loss, ref in out["train"]:
        assert abs(loss - ref) <= TOLERANCE * abs(ref), out["train"]
    assert out["trained"] < 1e-4, out
    changed = "model.embed_tokens.weight of LlamaForCausalLM has shape [3, 3], not [64, 32]" \
        if rank == 0 else "another rank changed a shape"  # rank 1 learns of it and stops too
    assert changed in (out["shape_change"] or ""), out
    assert out["after_refusal"] == out["trained"], out
    assert "fwd_module=" in (out["fwd_module"] or ""), out
    assert out["bf16_read"] == (torch.bfloat16, True), out
    assert out["bf16_write"] == (torch.float32, True) and out["bf16_kept"], out


def test_gathered_parameters_reads_and_writes_back(pool):
    pool.run(gathered_rank)


# -- TRL ------------------------------------------------------------------------------------------

def fused_head_rank(rank, world):
    from trl.trainer.utils import add_fused_lm_head, maybe_gather_lm_head_ctx
    engine, reference, opt = pair()
    for model in (engine.module, reference):
        add_fused_lm_head(model)
    # inside forward (the root unit holds lm_head, gathered): TRL gathers nothing. (The one-
    # process reference runs without the ZeRO-3 config: its parameters are not ZeRO's.)
    out = {"train": [train_both(engine, reference, opt, step, zero3_enabled, fused_lm_head=True)
                     for step in range(3)]}
    out["trained"] = max_difference(engine, reference)
    with zero3_enabled():
        # outside forward TRL's helper gathers the sharded head it was given
        weight = engine.module.lm_head.weight
        expected = full_state(engine)["lm_head.weight"]
        with torch.no_grad(), maybe_gather_lm_head_ctx(weight, None):
            out["head"] = (weight - expected).abs().max().item()
        out["head_after"] = weight.dim()
        # with gradients, a computation outside forward through the gathered head is stopped
        try:
            with maybe_gather_lm_head_ctx(weight):
                loss = (weight * 2).sum()
            loss.backward()
            out["gradient"] = None
        except RuntimeError as err:
            out["gradient"] = str(err)
    engine.destroy()

    # lm_head its own unit: the root's forward reads it sharded, which gathers it (as
    # DeepSpeed's ZeROOrderedDict does): trainable it trains as one process; frozen (LoRA),
    # it reads the gathered head.
    config = {**CONFIG, "vescale": {"wrap_policy": {"module_classes": ["LlamaDecoderLayer",
                                                                       "Linear"]}}}
    engine, reference, opt = pair(config)
    for model in (engine.module, reference):
        add_fused_lm_head(model)
    ids = tokens(0)
    out["own_unit"] = [train_both(engine, reference, opt, step, zero3_enabled,
                                  fused_lm_head=True) for step in range(2)]
    out["own_unit_trained"] = max_difference(engine, reference)
    with zero3_enabled():
        engine.module.lm_head.weight.requires_grad_(False)
        reference.lm_head.weight.requires_grad_(False)
        with torch.no_grad():
            loss = engine(ids, labels=ids, fused_lm_head=True).loss
    out["frozen_read"] = abs(loss.item() - reference(ids, labels=ids, fused_lm_head=True).loss.item())
    engine.destroy()
    return out


def test_trl_fused_lm_head_trains_as_one_process(pool):
    import trl
    import trl.trainer.utils
    if not hasattr(trl.trainer.utils, "add_fused_lm_head"):  # a TRL before its fused LM head
        pytest.skip(f"trl {trl.__version__} has no fused LM head (add_fused_lm_head)")
    for out in pool.run(fused_head_rank):
        for loss, ref in out["train"]:
            assert abs(loss - ref) <= TOLERANCE * abs(ref), out["train"]
        assert out["trained"] < 1e-4, out
        assert out["head"] == 0.0 and out["head_after"] == 1, out
        assert "lm_head.weight of LlamaForCausalLM was computed with its full value" in (out["gradient"] or ""), out
        for loss, ref in out["own_unit"]:
            assert abs(loss - ref) <= TOLERANCE * abs(ref), out["own_unit"]
        assert out["own_unit_trained"] < 1e-4, out
        assert out["frozen_read"] < 1e-5, out


class _Accelerator:
    """What `_unwrap_model_for_generation` asks of Accelerate: unwrap_model and the ZeRO
    stage (accelerate.Accelerator under a stage-3 DeepSpeed plugin answers the same)."""
    state = types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3))

    def unwrap_model(self, model):
        from accelerate.utils import extract_model_from_parallel
        return extract_model_from_parallel(model)


def generation_rank(rank, world):
    from trl.models import utils
    # TRL 1.x's private context manager; before it (trl 0.24) the public one did the same
    _unwrap_model_for_generation = getattr(utils, "_unwrap_model_for_generation", None) or \
        utils.unwrap_model_for_generation
    from vescale_engine.shard.stats import STATS
    engine, reference, opt = pair()
    out = {"before": [train_both(engine, reference, opt, 0)]}
    prompt = tokens(9)[:, :4]
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    gathers = STATS.all_gathers
    with torch.no_grad(), _unwrap_model_for_generation(engine, _Accelerator()) as unwrapped:
        out["unwrapped"] = unwrapped is engine.module
        ids = unwrapped.generate(prompt, **settings)
    out["unit_gathers"] = STATS.all_gathers - gathers  # hooks suspended: none
    with torch.no_grad():
        out["ids"] = torch.equal(ids, reference.generate(prompt, **settings))
    out["after"] = [train_both(engine, reference, opt, step) for step in range(1, 3)]
    out["unit_gathers_after"] = STATS.all_gathers - gathers  # hooks back
    out["trained"] = max_difference(engine, reference)
    engine.destroy()
    assert out["unwrapped"] and out["ids"], out
    assert out["unit_gathers"] == 0 and out["unit_gathers_after"] > 0, out
    for loss, ref in out["before"] + out["after"]:
        assert abs(loss - ref) <= TOLERANCE * abs(ref), out
    assert out["trained"] < 1e-4, out


def test_trl_unwrap_model_for_generation(pool):
    pool.run(generation_rank)
