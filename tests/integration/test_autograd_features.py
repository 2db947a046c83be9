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
from vescale_engine.fsdp import full_state_dict, fully_shard
from vescale_engine.optim.clip import clip_grad_norm_

GLOBAL_BATCH, STEPS = 8, 3
LR = dict(lr=1e-3, eps=1e-6, weight_decay=0.01)


@functools.lru_cache(maxsize=None)
def _deepspeed_checkpoint_failure():
    """DeepSpeed's own `checkpoint` on a plain Linear in this process, without veScale: the
    error it raises here, or None. Before 0.19.8 it calls the CPU accelerator's Stream, which
    is None, so it cannot run on CPU at all (our lowest supported DeepSpeed is 0.19.3)."""
    import deepspeed
    linear = torch.nn.Linear(2, 2)
    try:
        deepspeed.checkpointing.checkpoint(linear, torch.ones(1, 2, requires_grad=True)).sum() \
            .backward()
    except Exception as err:  # whatever DeepSpeed raises
        return f"deepspeed {deepspeed.__version__}: {type(err).__name__}: {err}"
    return None


def _require_deepspeed_checkpoint(feature="deepspeed"):
    if feature == "deepspeed" and _deepspeed_checkpoint_failure() is not None:
        pytest.skip("DeepSpeed's checkpoint fails on this machine without veScale too ("
                    f"{_deepspeed_checkpoint_failure()})")


def _deepspeed_checkpoint(block, x):
    import deepspeed
    return deepspeed.checkpointing.checkpoint(block, x)


# How each block is called: with its hooks inside the checkpointed region or not.
BLOCK_CALLS = {
    "reentrant": lambda i, block, x: checkpoint(block.__call__, x, use_reentrant=True),
    "non_reentrant": lambda i, block, x: checkpoint(block.__call__, x, use_reentrant=False),
    "every_2nd_layer": lambda i, block, x: (checkpoint(block.__call__, x, use_reentrant=True)
                                            if i % 2 == 0 else block(x)),
    "inside_the_unit": lambda i, block, x: block(x),  # its MLP checkpoints itself
    "reentrant_forward": lambda i, block, x: block(x),  # its forward is checkpointed whole
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
        for block in self.gpt.blocks:
            if feature == "inside_the_unit":  # the block's MLP Linears checkpoint themselves
                for linear in (block.fc, block.out):
                    linear.forward = functools.partial(checkpoint, linear.forward,
                                                       use_reentrant=True)
            elif feature == "reentrant_forward":  # transformers >= 5.x's GradientCheckpointingLayer:
                # the unit's hooks outside, every parameter only in the nested backward's graph
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=True)
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
                                      "inside_the_unit", "reentrant_forward", "sequential",
                                      "deepspeed")]
CASES += [("reentrant", True, "plain"), ("reentrant_forward", True, "plain"),
          ("non_reentrant", True, "plain"),
          ("none", False, "save_on_cpu"), ("reentrant", False, "save_on_cpu"),
          ("none", False, "two_forwards"), ("reentrant", False, "two_forwards"),
          ("inside_the_unit", False, "two_forwards"), ("reentrant_forward", False, "two_forwards"),
          ("none", False, "retain_graph"), ("none", False, "input_grad_first")]


def _norm(params):
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def compare_with_one_process(rank, world, feature, frozen, backward, sharded, step):
    """STEPS steps of `Recipe(feature, frozen)` on one process (torch's AdamW) and of the
    `sharded` one (its share of each global batch); `step(norm)` ends a sharded step and
    returns its global gradient norm. The worst relative gap in losses, norms and (after the
    last step) parameters."""
    step_fn = BACKWARDS[backward]
    torch.manual_seed(0)
    reference = Recipe(feature, frozen)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **LR)
    norms, losses = [], []
    per = GLOBAL_BATCH // world
    for index in range(STEPS):
        idx, tgt = fm.batch("gpt", index, GLOBAL_BATCH)
        want = step_fn(reference, idx, tgt).item()
        want_norm = _norm(reference.parameters())
        ref_opt.step()
        ref_opt.zero_grad()
        got = step_fn(sharded, idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
        norms.append(abs(step() - want_norm) / want_norm)
        total = got.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(abs(total.item() / world - want) / want)
    module = getattr(sharded, "module", sharded)
    full, ref = full_state_dict(module), reference.state_dict()
    worst = max(((full[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item()
                for k in ref)
    return max(losses), max(norms), worst


def feature_rank(rank, world, feature, frozen, backward):
    torch.manual_seed(0)
    model = Recipe(feature, frozen)
    for block in model.gpt.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **LR)

    def step():
        norm = clip_grad_norm_(list(model.parameters()), float("inf")).item()
        opt.step()
        opt.zero_grad()
        return norm
    return compare_with_one_process(rank, world, feature, frozen, backward, model, step)


@pytest.mark.parametrize("feature,frozen,backward", CASES,
                         ids=[f"{f}{'-frozen_embedding' if z else ''}-{b}"
                              for f, z, b in CASES])
def test_autograd_feature_equals_one_process(pool, feature, frozen, backward):
    _require_deepspeed_checkpoint(feature)
    loss, norm, params = pool.run(feature_rank, feature, frozen, backward)[0]
    assert norm < 1e-6 and loss < 1e-6 and params < 1e-5, (loss, norm, params)


ENGINE_CASES = [("reentrant", False, "plain"), ("reentrant", True, "plain"),
                ("reentrant_forward", True, "plain"),
                ("every_2nd_layer", False, "plain"), ("sequential", False, "plain"),
                ("deepspeed", False, "plain"), ("reentrant", False, "two_forwards"),
                ("none", False, "retain_graph"), ("none", False, "input_grad_first"),
                ("reentrant", False, "save_on_cpu")]


def engine_config(world, **extra):
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_clipping": 0,
            "optimizer": {"type": "AdamW", "params": LR},
            "vescale": {"wrap_policy": {"module_classes": ["Block"]}}, **extra}


def engine_feature_rank(rank, world, feature, frozen, backward, config=None):
    """The same through `initialize` (blocks as units by the wrap policy, the engine's AdamW);
    the gradient norm is the engine's."""
    from vescale_engine import initialize
    torch.manual_seed(0)
    engine, _, _, _ = initialize(model=Recipe(feature, frozen),
                                 config=config or engine_config(world))

    def step():
        engine.step()
        return engine.get_global_grad_norm()
    return compare_with_one_process(rank, world, feature, frozen, backward, engine, step)


@pytest.mark.parametrize("feature,frozen,backward", ENGINE_CASES,
                         ids=[f"{f}{'-frozen_embedding' if z else ''}-{b}"
                              for f, z, b in ENGINE_CASES])
def test_autograd_feature_through_initialize_equals_one_process(pool, feature, frozen,
                                                                 backward):
    _require_deepspeed_checkpoint(feature)
    loss, norm, params = pool.run(engine_feature_rank, feature, frozen, backward)[0]
    assert norm < 1e-6 and loss < 1e-6 and params < 1e-5, (loss, norm, params)


def deepspeed_configured_rank(rank, world, section):
    """A Megatron-style script: `deepspeed.checkpointing.configure(None, deepspeed_config=...)`
    from the config's activation_checkpointing section, then `deepspeed.initialize` (ours,
    through patch_deepspeed) and DeepSpeed's `checkpoint` around each block."""
    import deepspeed
    import vescale_engine
    vescale_engine.patch_deepspeed()
    config = engine_config(world, activation_checkpointing=section)
    try:
        deepspeed.checkpointing.configure(None, deepspeed_config=config)
    except ValueError as err:
        return str(err)
    try:
        return engine_feature_rank(rank, world, "deepspeed", False, "plain", config)
    finally:
        deepspeed.checkpointing.configure(None)  # DeepSpeed's defaults for the next test


DEEPSPEED_SECTIONS = [
    {"partition_activations": True, "cpu_checkpointing": True, "synchronize_checkpoint_boundary":
     True, "profile": True},
    {"partition_activations": True, "contiguous_memory_optimization": True,
     "number_checkpoints": 4}]


@pytest.mark.parametrize("section", DEEPSPEED_SECTIONS, ids=["cpu_offload", "contiguous"])
def test_deepspeed_activation_checkpointing_section_acts_through_configure(pool, section):
    _require_deepspeed_checkpoint()
    loss, norm, params = pool.run(deepspeed_configured_rank, section)[0]
    assert norm < 1e-6 and loss < 1e-6 and params < 1e-5, (loss, norm, params)


def test_deepspeed_cpu_checkpointing_without_partitioning_is_refused_by_name(pool):
    """DeepSpeed accepts it and fails in backward ('both arguments to linear need to be at
    least 1D'): one line naming the key instead, on every rank, before any step."""
    for message in pool.run(deepspeed_configured_rank, {"cpu_checkpointing": True}):
        assert "activation_checkpointing.cpu_checkpointing needs partition_activations" in \
            message, message


class SharedInAndOut(torch.nn.Module):
    """One Linear used directly and inside a reentrant checkpoint, in either order."""

    def __init__(self, checkpoint_first):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.checkpoint_first = checkpoint_first

    def forward(self, x):
        inner = functools.partial(checkpoint, self.lin, use_reentrant=True)
        first, then = (inner, self.lin) if self.checkpoint_first else (self.lin, inner)
        return then(torch.tanh(first(x))).square().mean()


def shared_in_and_out_rank(rank, world, checkpoint_first, grads_in_place):
    torch.manual_seed(0)
    reference = SharedInAndOut(checkpoint_first)
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Sequential(SharedInAndOut(checkpoint_first)),
                        grads_in_place=grads_in_place)
    x = torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(3)).requires_grad_()
    reference(x).backward()
    try:
        model(x[4 * rank:4 * (rank + 1)]).backward()
    except RuntimeError as err:
        return str(err)
    got = clip_grad_norm_(list(model.parameters()), float("inf")).item()
    return abs(got - _norm(reference.parameters())) / _norm(reference.parameters())


def test_a_parameter_inside_and_outside_a_reentrant_checkpoint(pool):
    """Used inside the checkpoint after its direct use (backward reaches the checkpoint
    first): its gradients wait aside until the unit's backward ends. Used inside it before
    (the direct use's gradient is complete, and written over the parameter, before the
    recomputation reads it): an error naming grads_in_place=False, which is exact."""
    assert pool.run(shared_in_and_out_rank, False, True)[0] < 1e-6
    message = pool.run(shared_in_and_out_rank, True, True)[0]
    assert "lin." in message and "gradient arrived again" in message and \
        "grads_in_place=False" in message, message
    assert pool.run(shared_in_and_out_rank, True, False)[0] < 1e-6


def whole_model_reentrant_rank(rank, world):
    """The root unit's own call under a reentrant checkpoint: its forward runs without
    gradients, so nothing marks its units as owed a recomputation."""
    torch.manual_seed(0)
    model = Recipe("none")
    for block in model.gpt.blocks:
        fully_shard(block)
    fully_shard(model)
    idx, tgt = fm.batch("gpt", 0, GLOBAL_BATCH)
    scale = torch.ones((), requires_grad=True)  # reentrant checkpoints need an input with grad
    loss = checkpoint(lambda s: model(idx, tgt) * s, scale, use_reentrant=True)
    try:
        loss.backward()
    except RuntimeError as err:
        message = str(err)
    else:
        message = "no error"
    assert "runs with gradients inside a backward" in message and \
        "use_reentrant=False" in message, message


def test_the_root_under_a_reentrant_checkpoint_is_an_error_not_lost_gradients(pool):
    pool.run(whole_model_reentrant_rank)
