"""The autograd features recipes turn on, under `fully_shard` on 2 gloo ranks: each equals one
unsharded process on the same global batch (gradient norms 1e-6 relative, parameters after 3
AdamW steps 1e-5).

Reentrant activation checkpointing around a unit's whole call is what Hugging Face's
`GradientCheckpointingLayer` does with `use_reentrant=True` (LLaMA-Factory's and axolotl's
default): the unit's forward hooks run under no_grad in forward and again, with gradients,
inside backward's recomputation, whose gradients come from a nested backward."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fsdp_models as fm
from dist_harness import RankPool
from vescale_engine.fsdp import full_state_dict, fully_shard
from vescale_engine.optim.clip import clip_grad_norm_

GLOBAL_BATCH, STEPS = 8, 3
LR = dict(lr=1e-3, eps=1e-6, weight_decay=0.01)


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2)
    yield pool
    pool.close()


def _mlp_checkpointed_inside(block, x):
    """Block.forward with its MLP under a reentrant checkpoint inside the unit."""
    B, T, C = x.shape
    q, k, v = block.qkv(block.ln1(x)).split(C, dim=-1)
    q, k, v = (t.view(B, T, block.heads, C // block.heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + block.proj(y.transpose(1, 2).reshape(B, T, C))
    return x + checkpoint(lambda h: block.out(F.gelu(block.fc(block.ln2(h)))), x,
                          use_reentrant=True)


def _deepspeed_checkpoint(block, x):
    import deepspeed
    return deepspeed.checkpointing.checkpoint(block, x)


# How each block is called: with its hooks inside the checkpointed region or not.
BLOCK_CALLS = {
    "reentrant": lambda i, block, x: checkpoint(block.__call__, x, use_reentrant=True),
    "non_reentrant": lambda i, block, x: checkpoint(block.__call__, x, use_reentrant=False),
    "every_2nd_layer": lambda i, block, x: (checkpoint(block.__call__, x, use_reentrant=True)
                                            if i % 2 == 0 else block(x)),
    "inside_the_unit": lambda i, block, x: block(x),  # its forward checkpoints the MLP
    "deepspeed": lambda i, block, x: _deepspeed_checkpoint(block, x),
}


class Recipe(torch.nn.Module):
    """The tests' GPT (tied embeddings), its blocks called as `feature` says.
    `frozen_embedding`: the embeddings are frozen and their output made to require grad, as
    transformers' `enable_input_require_grads` does for LoRA."""

    def __init__(self, feature, frozen_embedding=False):
        super().__init__()
        self.gpt = fm.make("gpt")
        self.feature = feature
        if feature == "inside_the_unit":
            for block in self.gpt.blocks:
                block.forward = functools.partial(_mlp_checkpointed_inside, block)
        if frozen_embedding:
            self.gpt.wte.weight.requires_grad_(False)
            self.gpt.wpe.weight.requires_grad_(False)
            self.gpt.wte.register_forward_hook(lambda m, i, out: out.requires_grad_(True))

    def embed(self, idx):
        g = self.gpt
        return g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))

    def head(self, x, tgt):
        g = self.gpt
        logits = g.head(g.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())

    def forward(self, idx, tgt):
        x = self.embed(idx)
        blocks = list(self.gpt.blocks)
        if self.feature == "sequential":
            x = checkpoint_sequential(torch.nn.Sequential(*blocks), 2, x, use_reentrant=True)
        elif self.feature in BLOCK_CALLS:
            for i, block in enumerate(blocks):
                x = BLOCK_CALLS[self.feature](i, block, x)
        else:
            for block in blocks:
                x = block(x)
        return self.head(x, tgt)


# How one step's gradients are made from the loss(es), the same in both processes.
def _backward_plain(model, idx, tgt):
    loss = model(idx, tgt)
    loss.backward()
    return loss


def _backward_save_on_cpu(model, idx, tgt):
    with torch.autograd.graph.save_on_cpu():
        loss = model(idx, tgt)
    loss.backward()
    return loss


def _backward_two_forwards(model, idx, tgt):
    """Two forwards (each half of the batch) before one backward of their mean."""
    h = idx.shape[0] // 2
    loss = (model(idx[:h], tgt[:h]) + model(idx[h:], tgt[h:])) / 2
    loss.backward()
    return loss


def _backward_retain_graph(model, idx, tgt):
    """Two backwards through one retained graph: the gradients add up."""
    loss = model(idx, tgt)
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    return loss


def _backward_input_grad_first(model, idx, tgt):
    """`torch.autograd.grad` of the loss with respect to the embeddings' output (an input
    gradient, as a saliency map or an adversarial step wants; no parameter's .grad is
    touched), then a second forward and the usual backward."""
    outputs = []
    handle = model.gpt.wte.register_forward_hook(lambda m, i, out: outputs.append(out))
    (saliency,) = torch.autograd.grad(model(idx, tgt), outputs[0])
    handle.remove()
    assert saliency.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters()), "autograd.grad set a .grad"
    loss = model(idx, tgt)
    loss.backward()
    return loss


BACKWARDS = {"plain": _backward_plain, "save_on_cpu": _backward_save_on_cpu,
             "two_forwards": _backward_two_forwards, "retain_graph": _backward_retain_graph,
             "input_grad_first": _backward_input_grad_first}

CASES = [(f, False, "plain") for f in ("reentrant", "non_reentrant", "every_2nd_layer",
                                      "inside_the_unit", "sequential", "deepspeed")]
CASES += [("reentrant", True, "plain"), ("non_reentrant", True, "plain"),
          ("none", False, "save_on_cpu"), ("reentrant", False, "save_on_cpu"),
          ("none", False, "two_forwards"), ("reentrant", False, "two_forwards"),
          ("none", False, "retain_graph"), ("none", False, "input_grad_first")]


def _norm(params):
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def feature_rank(rank, world, feature, frozen, backward):
    step_fn = BACKWARDS[backward]
    torch.manual_seed(0)
    reference = Recipe(feature, frozen)
    torch.manual_seed(0)
    model = Recipe(feature, frozen)
    for block in model.gpt.blocks:
        fully_shard(block)
    fully_shard(model)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **LR)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **LR)
    norms, losses = [], []
    per = GLOBAL_BATCH // world
    for step in range(STEPS):
        idx, tgt = fm.batch("gpt", step, GLOBAL_BATCH)
        want = step_fn(reference, idx, tgt).item()
        want_norm = _norm(reference.parameters())
        got = step_fn(model, idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
        got_norm = clip_grad_norm_(list(model.parameters()), float("inf")).item()
        total = got.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(abs(total.item() / world - want) / want)
        norms.append(abs(got_norm - want_norm) / want_norm)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    full, ref = full_state_dict(model), reference.state_dict()
    worst = max(((full[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item()
                for k in ref)
    return max(losses), max(norms), worst


@pytest.mark.parametrize("feature,frozen,backward", CASES,
                         ids=[f"{f}{'-frozen_embedding' if z else ''}-{b}"
                              for f, z, b in CASES])
def test_autograd_feature_equals_one_process(pool, feature, frozen, backward):
    loss, norm, params = pool.run(feature_rank, feature, frozen, backward)[0]
    assert norm < 1e-6 and loss < 1e-6 and params < 1e-5, (loss, norm, params)


ENGINE_CASES = [("reentrant", False, "plain"), ("reentrant", True, "plain"),
                ("every_2nd_layer", False, "plain"), ("sequential", False, "plain"),
                ("deepspeed", False, "plain"), ("reentrant", False, "two_forwards"),
                ("none", False, "retain_graph"), ("none", False, "input_grad_first"),
                ("reentrant", False, "save_on_cpu")]


def engine_feature_rank(rank, world, feature, frozen, backward):
    """The same through `initialize` (blocks as units by the wrap policy, the engine's AdamW);
    the gradient norm is the engine's, before its step."""
    from vescale_engine import initialize
    step_fn = BACKWARDS[backward]
    torch.manual_seed(0)
    reference = Recipe(feature, frozen)
    torch.manual_seed(0)
    engine, _, _, _ = initialize(model=Recipe(feature, frozen), config={
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_clipping": 0,
        "optimizer": {"type": "AdamW", "params": LR},
        "vescale": {"wrap_policy": {"module_classes": ["Block"]}}})
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **LR)
    norms, losses = [], []
    per = GLOBAL_BATCH // world
    for step in range(STEPS):
        idx, tgt = fm.batch("gpt", step, GLOBAL_BATCH)
        want = step_fn(reference, idx, tgt).item()
        want_norm = _norm(reference.parameters())
        ref_opt.step()
        ref_opt.zero_grad()
        got = step_fn(engine, idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
        engine.step()
        total = got.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(abs(total.item() / world - want) / want)
        norms.append(abs(engine.get_global_grad_norm() - want_norm) / want_norm)
    full, ref = full_state_dict(engine.module), reference.state_dict()
    worst = max(((full[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item()
                for k in ref)
    return max(losses), max(norms), worst


@pytest.mark.parametrize("feature,frozen,backward", ENGINE_CASES,
                         ids=[f"{f}{'-frozen_embedding' if z else ''}-{b}"
                              for f, z, b in ENGINE_CASES])
def test_autograd_feature_through_initialize_equals_one_process(pool, feature, frozen,
                                                                 backward):
    loss, norm, params = pool.run(engine_feature_rank, feature, frozen, backward)[0]
    assert norm < 1e-6 and loss < 1e-6 and params < 1e-5, (loss, norm, params)
