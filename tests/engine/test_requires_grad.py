"""requires_grad as a user or a library sets it, on whichever Parameter object the module holds
(sharded between steps, full-shape while unsharded), trains as it would on an unsharded model:
PEFT's disable_adapter reference pass between forward and backward, layers frozen and unfrozen
mid-training, a flag toggled between forward and backward, extra forwards (no_grad,
inference_mode, eval) while a backward is pending. 2 gloo ranks, each against one process
without sharding doing the same thing with torch.optim.AdamW."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from compare import relative
from vescale_engine import optim as vopt
from vescale_engine.optim.clip import global_grad_norm
from vescale_engine.fsdp import (full_state_dict, fully_shard, no_sync, sharded_parameters,
                                 unit_of)

GLOBAL_BATCH = 4
SEQ = 12
VOCAB = 96
OPT = dict(lr=1e-2, eps=1e-6, weight_decay=0.05)
TOL = 1e-5


def tiny_llama(layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager"))


def lora_llama():
    from peft import LoraConfig, get_peft_model
    model = tiny_llama()
    # init_lora_weights=False: B is not zero, so A and B both get gradients from step 0.
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))


def layers_of(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def shard(model):
    for layer in layers_of(model):
        fully_shard(layer)
    return fully_shard(model)


def batch(step, rank=None, world=1):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    if rank is None:
        return ids
    per = GLOBAL_BATCH // world
    return ids[rank * per:(rank + 1) * per]


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def grad_errors(model, reference):
    """Per managed parameter: does it have a gradient where the reference has one, and how far
    is this rank's piece of it from the reference's."""
    ref = dict(reference.named_parameters())
    worst, missing = 0.0, []
    for fqn, sp in sharded_parameters(model):
        want = ref[fqn].grad
        got = sp.sharded.grad  # a RaggedDTensor over this rank's piece
        got = None if got is None else got.to_local()
        if (want is None) != (got is None):
            missing.append((fqn, "reference" if want is None else "sharded"))
            continue
        if want is not None:
            begin, end = sp.flat_range
            piece = want.reshape(-1)[begin:end]
            worst = max(worst, (got - piece).abs().max().item() / max(want.abs().max().item(),
                                                                      1e-30) if end > begin
                        else 0.0)
    return worst, missing


def norm_error(model, reference):
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    want = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) if grads else \
        torch.zeros(())
    # Over the sharded faces, as the engine's clipping does (what the optimizer holds): after a
    # forward without backward the root unit's module holds its full-shape faces.
    got = global_grad_norm([sp.sharded for _, sp in sharded_parameters(model)])
    return abs(got.item() - want.item()) / max(want.item(), 1e-30)


def param_error(model, reference):
    full = full_state_dict(model)
    ref = reference.state_dict()
    per = {k: relative(full[k], ref[k]) for k in ref}
    worst = max(per, key=per.get)
    return per[worst], worst


def optimizers(model, reference, kind):
    ours = [p for p in model.parameters() if p.requires_grad]
    theirs = [p for p in reference.parameters() if p.requires_grad]
    cls = torch.optim.AdamW if kind == "torch" else vopt.AdamW
    return cls(ours, **OPT), torch.optim.AdamW(theirs, **OPT)


def train(rank, world, build, steps, kind, step_fn, first=None):
    """`step_fn(model, ids, step, sharded)` runs forward and backward; both sides run it, then
    AdamW steps. `first(model, ids)` runs once on each before training. Returns the worst
    gradient, norm and parameter errors and what went missing."""
    reference, model = build(), shard(build())
    if first is not None:
        first(reference, batch(0))
        first(model, batch(0, rank, world))
    opt, ref_opt = optimizers(model, reference, kind)
    grads, norms, missing = 0.0, 0.0, []
    for step in range(steps):
        step_fn(reference, batch(step), step, False)
        step_fn(model, batch(step, rank, world), step, True)
        g, m = grad_errors(model, reference)
        grads, missing = max(grads, g), missing + [(step, *x) for x in m]
        norms = max(norms, norm_error(model, reference))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    return grads, norms, missing, param_error(model, reference)


def check(result):
    grads, norms, missing, (params, name) = result
    assert not missing, missing
    assert grads < TOL and norms < TOL, (grads, norms)
    assert params < TOL, (params, name)


# -- (a) PEFT LoRA: the adapter-off reference pass between forward and backward -------------

def dpo_like_step(model, ids, step, sharded):
    logits = model(input_ids=ids).logits
    with torch.no_grad(), model.disable_adapter():  # TRL's DPO reference pass with LoRA
        ref = model(input_ids=ids).logits
    (lm_loss(logits, ids) + (logits - ref).pow(2).mean()).backward()


def peft_rank(rank, world, kind):
    check(train(rank, world, lora_llama, 3, kind, dpo_like_step))


@pytest.mark.parametrize("kind", ["torch", "vescale"])
def test_peft_disable_adapter_reference_pass_between_forward_and_backward(pool, kind):
    pool.run(peft_rank, kind)


# -- (b) freezing and unfreezing mid-training ----------------------------------------------

def frozen_at_build():
    """layer 2's up_proj frozen before wrapping: its full-shape face is made frozen."""
    model = tiny_llama()
    model.model.layers[2].mlp.up_proj.weight.requires_grad_(False)
    return model


def freeze_schedule_step(model, ids, step, sharded):
    """Layer 1 frozen for steps 1-2 (a whole unit), one projection of layer 0 frozen for steps
    2-3 (part of a buffer), the embedding frozen for step 1 through module.requires_grad_,
    layer 2's up_proj (frozen at build) unfrozen from step 2; each set between steps, while
    the module holds the sharded parameters."""
    layers = layers_of(model)
    if step == 2:
        layers[2].mlp.up_proj.weight.requires_grad_(True)
    if step == 1:
        layers[1].requires_grad_(False)
        model.model.embed_tokens.requires_grad_(False)
    if step == 2:
        layers[0].mlp.down_proj.weight.requires_grad = False
        model.model.embed_tokens.requires_grad_(True)
    if step == 3:
        layers[1].requires_grad_(True)
    if step == 4:
        layers[0].mlp.down_proj.weight.requires_grad = True
    lm_loss(model(input_ids=ids).logits, ids).backward()


def freeze_rank(rank, world, kind):
    check(train(rank, world, frozen_at_build, 6, kind, freeze_schedule_step))


@pytest.mark.parametrize("kind", ["torch", "vescale"])
def test_freezing_and_unfreezing_layers_mid_training(pool, kind):
    pool.run(freeze_rank, kind)


# -- (c) toggled between forward and backward ----------------------------------------------

def toggle_step(model, ids, step, sharded):
    """After forward: the last layer (kept unsharded for backward: the module holds its
    full-shape parameters) and layer 0 (resharded) get flags flipped before backward; some
    are flipped back after backward. Frozen-at-forward then unfrozen-before-backward gets no
    gradient, as autograd never saw it."""
    layers = layers_of(model)
    last, first = layers[-1], layers[0]
    if step == 2:
        first.self_attn.k_proj.weight.requires_grad_(False)
        last.self_attn.k_proj.weight.requires_grad_(False)
    loss = lm_loss(model(input_ids=ids).logits, ids)
    if sharded and step > 0:  # what the module holds now (from the 2nd forward on)
        assert unit_of(last).is_unsharded and not unit_of(first).is_unsharded
    if step == 1:
        last.self_attn.q_proj.weight.requires_grad_(False)
        first.self_attn.q_proj.weight.requires_grad_(False)
        last.mlp.requires_grad_(False)
    if step == 2:
        first.self_attn.k_proj.weight.requires_grad_(True)
        last.self_attn.k_proj.weight.requires_grad_(True)
    loss.backward()
    if step == 1:
        last.self_attn.q_proj.weight.requires_grad_(True)
        first.self_attn.q_proj.weight.requires_grad_(True)
        last.mlp.requires_grad_(True)


def toggle_rank(rank, world, kind):
    check(train(rank, world, tiny_llama, 4, kind, toggle_step))


@pytest.mark.parametrize("kind", ["torch", "vescale"])
def test_requires_grad_toggled_between_forward_and_backward(pool, kind):
    pool.run(toggle_rank, kind)


# -- (d, e) extra forwards while a backward is pending --------------------------------------

def extra_forward_step(model, ids, step, sharded):
    """A no_grad forward, an inference_mode forward and an eval-mode forward between forward
    and backward, and an eval forward after backward (inside the step): each returns the
    logits a fresh forward gives, and the pending backward's gradients are unchanged."""
    logits = model(input_ids=ids).logits
    with torch.no_grad():
        again = model(input_ids=ids).logits
    with torch.inference_mode():
        inferred = model(input_ids=ids).logits
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=ids).logits
    model.train()
    for other in (again, inferred, evaluated):
        assert torch.equal(other, logits.detach()), (other - logits).abs().max()
    lm_loss(logits, ids).backward()
    model.eval()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    model.train()
    assert after.shape == logits.shape


def inference_first(model, ids):
    """The very first forward under inference_mode: the full buffers and full-shape faces it
    makes must serve training afterwards."""
    with torch.inference_mode():
        model(input_ids=ids)


def extra_forward_rank(rank, world):
    check(train(rank, world, tiny_llama, 3, "vescale", extra_forward_step, inference_first))


def test_extra_forwards_between_forward_and_backward(pool):
    pool.run(extra_forward_rank)


def two_forwards_step(model, ids, step, sharded):
    """Two forwards with gradients, then one backward of both losses (a second forward of
    every unit while the first one's backward is pending), then a forward with gradients
    whose graph is dropped unused (a metric computed without no_grad) before the next step."""
    half = ids.shape[0] // 2
    first = lm_loss(model(input_ids=ids[:half]).logits, ids[:half])
    second = lm_loss(model(input_ids=ids[half:]).logits, ids[half:])
    ((first + second) / 2).backward()
    model(input_ids=ids).logits.sum().item()  # graph dropped: no backward comes for it


def two_forwards_rank(rank, world):
    check(train(rank, world, tiny_llama, 3, "vescale", two_forwards_step))


def test_two_forwards_then_one_backward(pool):
    pool.run(two_forwards_rank)


# -- gradient accumulation: a flag changed between micro-steps ------------------------------

def accumulation_step(model, ids, step, sharded):
    """Two micro-steps, the first without communication (no_sync) at step 0 and with it at
    step 1: between them layer 0's q_proj is frozen (its first micro-step's gradient stays, as
    torch keeps .grad) and layer 1's k_proj unfrozen (it gets the second's only)."""
    layers = layers_of(model)
    if step == 0:
        layers[1].self_attn.k_proj.weight.requires_grad_(False)
    # Micro-batch k: row k of each rank's share (rows k, k + 2 of the global batch).
    with no_sync(model) if sharded and step == 0 else contextlib.nullcontext():
        (lm_loss(model(input_ids=ids[0::2]).logits, ids[0::2]) / 2).backward()
    layers[0].self_attn.q_proj.weight.requires_grad_(False)
    layers[1].self_attn.k_proj.weight.requires_grad_(True)
    (lm_loss(model(input_ids=ids[1::2]).logits, ids[1::2]) / 2).backward()
    layers[0].self_attn.q_proj.weight.requires_grad_(True)
    layers[1].self_attn.k_proj.weight.requires_grad_(False)


def accumulation_rank(rank, world, kind):
    check(train(rank, world, tiny_llama, 2, kind, accumulation_step))


@pytest.mark.parametrize("kind", ["torch", "vescale"])
def test_flags_changed_between_accumulation_micro_steps(pool, kind):
    pool.run(accumulation_rank, kind)


# -- a flag changed while its unit's backward runs: an error naming it -----------------------

def changed_in_backward_rank(rank, world):
    model = shard(tiny_llama())
    ids = batch(0, rank, world)
    last = layers_of(model)[-1]

    def toggle_later(module, args, output):  # attention's output gradient comes after the MLP's
        output[0].register_hook(lambda g: setattr(last.mlp.down_proj.weight, "requires_grad",
                                                  False))
    last.self_attn.register_forward_hook(toggle_later)
    message = None
    try:
        lm_loss(model(input_ids=ids).logits, ids).backward()
    except RuntimeError as err:
        message = str(err)
    assert message is not None and "mlp.down_proj.weight" in message and \
        "while the backward" in message, message


def test_a_flag_changed_during_its_units_backward_is_an_error(pool):
    pool.run(changed_in_backward_rank)
