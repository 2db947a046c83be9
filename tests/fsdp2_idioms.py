"""FSDP2 user idioms, each run twice on 2 gloo ranks: with torch's `fully_shard` and with ours.

Issue 35: `vescale_engine.fully_shard` should be a drop-in for
`torch.distributed.fsdp.fully_shard` (FSDP2). Each idiom below is a function written as FSDP2
user code (its docstring says which code it mimics) over a tiny deterministic transformer,
`fn(rank, world_size, engine, tmpdir) -> record`, where `engine` picks whose `fully_shard` the
code calls ("fsdp2" or "ours"); everything else it calls is torch's public API, as the user's
code would. The record holds what the user would look at (losses, gradient norms, parameters
gathered to full tensors, state-dict keys and shapes, ...), measured the same way for both
engines; the two records are compared rank by rank and the idiom gets a verdict:

    equal          ran with both, every number within 1e-6 of FSDP2's (or bitwise equal)
    equal (unsharded)  for an idiom of UNSHARDED_REFERENCE, where FSDP2 on CPU is no
                   reference: ours within 1e-6 of the same code on an unsharded model
    raises         ours raised on some rank (the exception, its message and the idiom's line;
                   a peer that went on and waits in a collective for it is shown as hanging,
                   given PEER_GRACE_S: a launcher would end the job there)
    WRONG          ran with both, but something differs from FSDP2: the worst kind, since the
                   user's code carries on with wrong numbers or a wrong picture of the model
    crashes        a rank's process died (e.g. gloo aborting on a collective size mismatch)
    hangs          no rank raised, but one did not finish within the idiom's time limit
    FSDP2 ...      torch's own fully_shard failed here (gloo/CPU): there is no reference

Run all idioms and print the table (2 to 4 minutes on 2 cores):

    PYTHONPATH=. OMP_NUM_THREADS=1 python tests/fsdp2_idioms.py [IDIOM ...]

tests/core/fsdp/test_fsdp2_idioms.py turns each idiom into a test. An idiom is independent of the others: the ranks that ran it are
replaced whenever either engine raised, crashed or hung, so no half-finished collective or
module state leaks into the next idiom.
"""
from __future__ import annotations

import copy
import math
import os
import queue
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

IDIOMS: dict = {}  # name -> function, in the order they are defined
TOLERANCE = 1e-6
DEFAULT_TIMEOUT_S = 150
PEER_GRACE_S = 30  # how long the other ranks get to finish once one has raised
TIMEOUTS = {"compile_blocks_before_fully_shard": 400, "compile_blocks_after_fully_shard": 400}

# -- the model --------------------------------------------------------------------------------
# A tiny llama-like decoder: embedding, 2 blocks (attention with 4 Linear, RMSNorm, a LayerNorm
# and an MLP), a final RMSNorm and an lm head. Every dimension divides by 2 (Shard(0)/Shard(1)).

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH, LAYERS = 32, 16, 2, 32, 8, 2, 2
LR = 1e-2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, DIM // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, DIM))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def init_weights(self):
        """torchtitan style: nn.init on the parameters themselves (a truncated normal per
        layer depth, zero biases), the norms' own reset_parameters."""
        nn.init.normal_(self.tok_embeddings.weight)
        for depth, layer in enumerate(self.layers):
            std = 0.02 / (2 * (depth + 1)) ** 0.5
            for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv,
                           layer.attention.wo, layer.feed_forward.w1, layer.feed_forward.w2):
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.lm_head.weight, std=DIM ** -0.5, a=-3 * DIM ** -0.5,
                              b=3 * DIM ** -0.5)

    @torch.no_grad()
    def generate(self, tokens, steps: int):
        """Greedy decoding that calls `self.forward` directly (not `self(...)`): the root's
        forward hooks do not run unless the method is registered with FSDP."""
        for _ in range(steps):
            logits = self.forward(tokens[:, -SEQ:])
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens, logits


def build(seed: int = 0, tied: bool = False) -> TinyLM:
    """The same fp32 model on every rank and for both engines (built on CPU from `seed`)."""
    torch.manual_seed(seed)
    return TinyLM(tied)


def batch(step: int, rank: int):
    """This rank's (inputs, targets) for `step`: the same for both engines."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, step: int, rank: int):
    inputs, targets = batch(step, rank)
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


# -- the engines and the measurements -----------------------------------------------------------

def fully_shard_of(engine: str):
    """The `fully_shard` the user's code calls."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    if engine == "ours":
        from vescale_engine import fully_shard
        return fully_shard
    raise ValueError(engine)


def dp_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def shard(model, engine: str, mesh=None, **kwargs):
    """The usual recipe: `fully_shard` each block, then the root (FSDP2's docs, torchtitan)."""
    fully_shard = fully_shard_of(engine)
    mesh = mesh if mesh is not None else dp_mesh(dist.get_world_size())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local_of(t):
    """The rank's own piece: a DTensor's local tensor, a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def full_of(t):
    """What FSDP2 user code does with a value that may be a DTensor: `.full_tensor()`."""
    return t.full_tensor() if is_dtensor(t) else t


def canonical(name: str) -> str:
    """A parameter's name without torch.compile's and checkpoint_wrapper's wrapper prefixes."""
    return name.replace("_orig_mod.", "").replace("._checkpoint_wrapped_module", "")


def full_params(model, engine: str) -> dict:
    """Every parameter's full value (a collective), each engine's own way: FSDP2's DTensor
    `.full_tensor()`; our `vescale_engine.full_state_dict`. Tied parameters under every name."""
    if engine == "fsdp2":
        return {canonical(n): full_of(p.detach()).clone()
                for n, p in model.named_parameters(remove_duplicate=False)}
    from vescale_engine import full_state_dict
    names = {canonical(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    return {canonical(n): v.clone() for n, v in full_state_dict(model).items()
            if canonical(n) in names}


def grad_norm(model) -> float:
    """The global gradient 2-norm measured the same way for both engines: each rank's own
    gradient pieces (a DTensor's local tensor, our flat piece) squared in float64, all-reduced.
    Not the user's clipping code (that is idiom material); a reference for it."""
    local = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            local += local_of(p.grad).detach().double().pow(2).sum()
    dist.all_reduce(local)
    return math.sqrt(local.item())


def train(model, opt, rank, steps, start=0, clip=None, micro_batches=1, before_micro=None):
    """`steps` optimizer steps; each step backpropagates `micro_batches` micro-batches
    (`before_micro(model, k, last)` runs before each) and runs `clip(model)` (its return value
    is recorded) before `opt.step()`. Returns the losses and the measured gradient norms."""
    out = {"losses": [], "grad_norms": []}
    for step in range(start, start + steps):
        for k in range(micro_batches):
            if before_micro is not None:
                before_micro(model, k, k == micro_batches - 1)
            loss = loss_of(model, step * micro_batches + k, rank)
            (loss / micro_batches).backward()
            out["losses"].append(loss.item())
        out["grad_norms"].append(grad_norm(model))
        if clip is not None:
            out.setdefault("clip", []).append(clip(model))
        opt.step()
        opt.zero_grad()
    return out


def train_unsharded(model, opt, rank, world, steps):
    """`train`'s numbers for an unsharded model in one process: each step's gradient is the
    mean over every rank's batch (what data-parallel training computes), the losses recorded
    are this rank's batch's, the norm is the whole gradient's (nothing to all-reduce)."""
    out = {"losses": [], "grad_norms": []}
    for step in range(steps):
        for r in range(world):
            loss = loss_of(model, step, r)
            (loss / world).backward()
            if r == rank:
                out["losses"].append(loss.item())
        out["grad_norms"].append(math.sqrt(sum(p.grad.detach().double().pow(2).sum().item()
                                               for p in model.parameters()
                                               if p.grad is not None)))
        opt.step()
        opt.zero_grad()
    return out


def describe(value):
    """A state-dict value as the user sees it: its type, shape and (`.full_tensor()` if a
    DTensor) values; nested dicts and lists described member by member, in sorted key order
    so that every rank runs the same collectives."""
    if isinstance(value, dict):
        return {str(k): describe(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {"type": "DTensor" if is_dtensor(value) else "Tensor",
                "shape": list(value.shape), "value": full_of(value.detach()).clone()}
    return value


def unsharded_now(param, full_shape) -> bool:
    """Does the module hold this parameter at full shape as a plain tensor right now?"""
    return not is_dtensor(param) and tuple(param.shape) == tuple(full_shape)


def idiom(fn):
    IDIOMS[fn.__name__] = fn
    return fn


# -- training ---------------------------------------------------------------------------------

@idiom
def train_loop(rank, world, engine, tmpdir):
    """`fully_shard` each block, then the root; `torch.optim.AdamW(model.parameters())`
    (foreach default); 3 steps of forward, backward, step, zero_grad."""
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 3)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def clip_grad_norm(rank, world, engine, tmpdir):
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` before each step
    (max_norm below the gradient norm, so it clips); the returned norm as the user logs it
    (`.full_tensor()` if it is a DTensor)."""
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 3, clip=lambda m: full_of(
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)).item())
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def total_norm_then_clip_with_norm(rank, world, engine, tmpdir):
    """torchtitan's / Accelerate's clipping: `get_total_norm([p.grad ...])`, `.full_tensor()`
    if that is a DTensor, then `clip_grads_with_norm_(params, max_norm, total_norm)`."""
    def clip(m):
        params = [p for p in m.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        total = full_of(total)
        torch.nn.utils.clip_grads_with_norm_(params, 0.5, total)
        return total.item()
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 3, clip=clip)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def accumulation_without_sync_control(rank, world, engine, tmpdir):
    """Gradient accumulation as HF Trainer/Accelerate often run it under FSDP2: two
    `(loss / 2).backward()` per step with no sync control (each backward reduce-scatters; the
    sharded gradients add up)."""
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 2, micro_batches=2)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def zero_grad_set_to_none_false(rank, world, engine, tmpdir):
    """`opt.zero_grad(set_to_none=False)` (gradients kept as zeros between steps), with
    2 micro-batches per step."""
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = {"losses": [], "grad_norms": []}
    for step in range(2):
        for k in range(2):
            loss = loss_of(model, 2 * step + k, rank)
            (loss / 2).backward()
            rec["losses"].append(loss.item())
        rec["grad_norms"].append(grad_norm(model))
        opt.step()
        opt.zero_grad(set_to_none=False)
    rec["zeroed_grad_norm"] = grad_norm(model)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def optimizer_built_before_fully_shard(rank, world, engine, tmpdir):
    """Accelerate's `_prepare_fsdp2`: the optimizer was made on the unsharded model; after
    `fully_shard` each param group's parameters are swapped for the new ones by name."""
    model = build(0)
    opt = adamw(model.parameters())
    name_of = {id(p): n for n, p in model.named_parameters()}
    shard(model, engine)
    new = dict(model.named_parameters())
    for group in opt.param_groups:
        group["params"] = [new[name_of[id(p)]] for p in group["params"]]
    rec = train(model, opt, rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def weight_decay_groups_by_dim(rank, world, engine, tmpdir):
    """nanoGPT's `configure_optimizers` after sharding: weight decay for `p.dim() >= 2`, none
    for biases and norms."""
    model = shard(build(0), engine)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    rec = train(model, opt, rank, 2)
    rec.update(n_decay=len(decay), n_no_decay=len(no_decay), params=full_params(model, engine))
    return rec


@idiom
def parameter_count_and_shapes(rank, world, engine, tmpdir):
    """`sum(p.numel() for p in model.parameters())` (the "model has N parameters" log line)
    and `p.shape` / `p.dim()` per parameter after sharding."""
    model = shard(build(0), engine)
    return {"num_params": sum(p.numel() for p in model.parameters()),
            "shapes": {n: list(p.shape) for n, p in model.named_parameters()},
            "dims": {n: p.dim() for n, p in model.named_parameters()}}


@idiom
def eval_under_no_grad_between_steps(rank, world, engine, tmpdir):
    """A training step, then `model.eval()` and an evaluation forward under `torch.no_grad()`,
    then `model.train()` and more training."""
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 1)
    model.eval()
    with torch.no_grad():
        rec["eval_loss"] = loss_of(model, 100, rank).item()
    model.train()
    rec["after"] = train(model, opt, rank, 2, start=1)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def tied_embeddings(rank, world, engine, tmpdir):
    """`lm_head.weight = tok_embeddings.weight` (tied, as GPT-2/Llama-3.2 do); blocks, then
    the root, which holds the tied weight."""
    model = shard(build(0, tied=True), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def frozen_embedding(rank, world, engine, tmpdir):
    """`model.tok_embeddings.requires_grad_(False)` before sharding (a frozen part); the
    optimizer gets the trainable parameters only."""
    model = build(0)
    model.tok_embeddings.requires_grad_(False)
    shard(model, engine)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    rec = train(model, opt, rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def activation_checkpoint_wrapper(rank, world, engine, tmpdir):
    """torchtitan's/Accelerate's activation checkpointing: each block wrapped by
    `checkpoint_wrapper` (non-reentrant), then `fully_shard` each wrapper, then the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    model = build(0)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    model = shard(model, engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


# -- state dicts and checkpoints --------------------------------------------------------------

def _trained(engine, seed=0, steps=1, rank=0):
    model = shard(build(seed), engine)
    opt = adamw(model.parameters())
    train(model, opt, rank, steps)
    return model, opt


def _sd_api():
    import torch.distributed.checkpoint.state_dict as api
    return api


@idiom
def get_model_state_dict_full_cpu_offload(rank, world, engine, tmpdir):
    """`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))` after a step (what an HF-style save on rank 0 writes)."""
    api = _sd_api()
    model, _ = _trained(engine, rank=rank)
    sd = api.get_model_state_dict(model, options=api.StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
    return {"keys": sorted(sd), "values": describe(sd)}


@idiom
def get_model_state_dict_sharded(rank, world, engine, tmpdir):
    """`get_model_state_dict(model)` (default: sharded); each value's type, shape and
    `.full_tensor()` if a DTensor."""
    api = _sd_api()
    model, _ = _trained(engine, rank=rank)
    return {"values": describe(api.get_model_state_dict(model))}


@idiom
def get_optimizer_state_dict_full(rank, world, engine, tmpdir):
    """`get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))` after a step: on rank 0, every state tensor at full shape."""
    api = _sd_api()
    model, opt = _trained(engine, rank=rank)
    osd = api.get_optimizer_state_dict(model, opt, options=api.StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    return {"osd": describe(osd)}


@idiom
def get_optimizer_state_dict_sharded(rank, world, engine, tmpdir):
    """`get_optimizer_state_dict(model, opt)` (default: sharded) after a step; each state
    tensor's type, shape and `.full_tensor()` if a DTensor."""
    api = _sd_api()
    model, opt = _trained(engine, rank=rank)
    return {"osd": describe(api.get_optimizer_state_dict(model, opt))}


@idiom
def get_optimizer_state_dict_flattened(rank, world, engine, tmpdir):
    """torchtitan's `get_optimizer_state_dict(model, opt, options=StateDictOptions(
    flatten_optimizer_state_dict=True))` after a step."""
    api = _sd_api()
    model, opt = _trained(engine, rank=rank)
    osd = api.get_optimizer_state_dict(model, opt, options=api.StateDictOptions(
        flatten_optimizer_state_dict=True))
    return {"osd": describe(osd)}


def _set_full_model_state_dict(rank, engine, broadcast):
    api = _sd_api()
    full_sd = build(0).state_dict()  # an unsharded checkpoint (e.g. loaded from HF files)
    if broadcast and rank != 0:
        full_sd = {}
    model = shard(build(1), engine)
    api.set_model_state_dict(model, full_sd, options=api.StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast))
    rec = {"loaded": full_params(model, engine)}
    opt = adamw(model.parameters())
    rec["train"] = train(model, opt, rank, 1)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def set_model_state_dict_full(rank, world, engine, tmpdir):
    """`set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))`
    with the full (unsharded) state dict on every rank, into a differently seeded sharded
    model; then a step."""
    return _set_full_model_state_dict(rank, engine, broadcast=False)


@idiom
def set_model_state_dict_broadcast_from_rank0(rank, world, engine, tmpdir):
    """The same with `broadcast_from_rank0=True`: only rank 0 holds the full state dict, the
    others pass `{}` (torchtitan's / Accelerate's rank-0 loading)."""
    return _set_full_model_state_dict(rank, engine, broadcast=True)


def _optimizer_round_trip(rank, engine, tmpdir, full):
    api = _sd_api()
    model, opt = _trained(engine, seed=0, rank=rank)
    if full:  # rank 0 writes one file (torch.save), every rank reads it
        options = api.StateDictOptions(full_state_dict=True, cpu_offload=True)
        saved = {"model": api.get_model_state_dict(model, options=options),
                 "optim": api.get_optimizer_state_dict(model, opt, options=options)}
        path = os.path.join(tmpdir, f"full_{engine}.pt")
        if rank == 0:
            torch.save(saved, path)
        dist.barrier()
        saved = torch.load(path)
        options = api.StateDictOptions(full_state_dict=True)
    else:  # a snapshot in memory (a copy, as a checkpoint would be)
        options = api.StateDictOptions()
        saved = copy.deepcopy({"model": api.get_model_state_dict(model),
                               "optim": api.get_optimizer_state_dict(model, opt)})
    fresh = shard(build(1), engine)
    fresh_opt = adamw(fresh.parameters())
    api.set_model_state_dict(fresh, saved["model"], options=options)
    api.set_optimizer_state_dict(fresh, fresh_opt, saved["optim"], options=options)
    rec = {"continued": train(model, opt, rank, 1, start=1),
           "resumed": train(fresh, fresh_opt, rank, 1, start=1)}
    rec["params"] = full_params(fresh, engine)
    return rec


@idiom
def set_optimizer_state_dict_sharded(rank, world, engine, tmpdir):
    """Resume in memory: `get_model_state_dict` / `get_optimizer_state_dict` (sharded) after a
    step, copied; `set_model_state_dict` / `set_optimizer_state_dict` into a fresh,
    differently seeded model and optimizer, and a step: the same as continuing the original."""
    return _optimizer_round_trip(rank, engine, tmpdir, full=False)


@idiom
def set_optimizer_state_dict_full(rank, world, engine, tmpdir):
    """The same resume through a full checkpoint: `get_*_state_dict(..., StateDictOptions(
    full_state_dict=True, cpu_offload=True))`, `torch.save` on rank 0, `torch.load` on every
    rank, `set_*_state_dict(..., StateDictOptions(full_state_dict=True))`."""
    return _optimizer_round_trip(rank, engine, tmpdir, full=True)


@idiom
def module_state_dict_round_trip(rank, world, engine, tmpdir):
    """`sd = model.state_dict()` after a step, `other.load_state_dict(sd)` into a differently
    seeded sharded model, then a step with a fresh optimizer."""
    model, _ = _trained(engine, rank=rank)
    sd = model.state_dict()
    other = shard(build(1), engine)
    other.load_state_dict(sd)
    rec = {"keys": sorted(sd), "loaded": full_params(other, engine)}
    rec["train"] = train(other, adamw(other.parameters()), rank, 1, start=1)
    return rec


@idiom
def dcp_save_load_model_state_dict(rank, world, engine, tmpdir):
    """`dcp.save(model.state_dict(), checkpoint_id=...)` after a step; a fresh differently
    seeded sharded model: `sd = model.state_dict(); dcp.load(sd, ...);
    model.load_state_dict(sd)`; then a step."""
    import torch.distributed.checkpoint as dcp
    path = os.path.join(tmpdir, f"dcp_{engine}")
    model, _ = _trained(engine, rank=rank)
    dcp.save(model.state_dict(), checkpoint_id=path)
    other = shard(build(1), engine)
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=path)
    other.load_state_dict(sd)
    rec = {"loaded": full_params(other, engine)}
    rec["train"] = train(other, adamw(other.parameters()), rank, 1, start=1)
    return rec


@idiom
def dcp_save_checkpoint_metadata(rank, world, engine, tmpdir):
    """`dcp.save(model.state_dict(), checkpoint_id=...)`, then what the checkpoint says it
    holds: each key's global size in `FileSystemReader(path).read_metadata()`, and whether
    every element was written (the sizes of its stored chunks add up)."""
    import torch.distributed.checkpoint as dcp
    path = os.path.join(tmpdir, f"dcp_meta_{engine}")
    model, _ = _trained(engine, rank=rank)
    dcp.save(model.state_dict(), checkpoint_id=path)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: {"size": list(m.size),
                "stored": sum(math.prod(c.sizes) for c in m.chunks)}
            for k, m in sorted(metadata.items())}


def _dcp_cross(rank, save_engine, load_engine, path):
    """torchtitan's checkpoint: `get_state_dict(model, opt)`, `dcp.save`; `get_state_dict` of a
    fresh model and optimizer, `dcp.load` into it, `set_state_dict`; then a step."""
    import torch.distributed.checkpoint as dcp
    api = _sd_api()
    model, opt = _trained(save_engine, rank=rank)
    msd, osd = api.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    other = shard(build(1), load_engine)
    other_opt = adamw(other.parameters())
    msd, osd = api.get_state_dict(other, other_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    api.set_state_dict(other, other_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    rec = {"loaded": full_params(other, load_engine)}
    rec["train"] = train(other, other_opt, rank, 1, start=1)
    rec["params"] = full_params(other, load_engine)
    return rec


@idiom
def dcp_fsdp2_checkpoint_loaded_by_engine(rank, world, engine, tmpdir):
    """A checkpoint written by an FSDP2 job (`get_state_dict` + `dcp.save`) resumed by this
    engine (`get_state_dict` + `dcp.load` + `set_state_dict`), then a step. FSDP2's column:
    FSDP2 resumes its own checkpoint."""
    return _dcp_cross(rank, "fsdp2", engine, os.path.join(tmpdir, f"from_fsdp2_{engine}"))


@idiom
def dcp_engine_checkpoint_loaded_by_fsdp2(rank, world, engine, tmpdir):
    """The reverse: this engine writes the checkpoint, an FSDP2 job resumes it, then a step."""
    return _dcp_cross(rank, engine, "fsdp2", os.path.join(tmpdir, f"to_fsdp2_{engine}"))


@idiom
def accelerate_load_full_state_dict(rank, world, engine, tmpdir):
    """Accelerate's `fsdp2_load_full_state_dict` (cpu_ram_efficient_loading): a model built on
    meta is sharded; for each `model.state_dict()` entry rank 0 broadcasts the full tensor,
    every rank `distribute_tensor(full, v.device_mesh, v.placements)`s it, and
    `model.load_state_dict(sharded_sd, assign=True)`; then training."""
    full_sd = build(0).state_dict() if rank == 0 else None
    with torch.device("meta"):
        model = TinyLM()
    shard(model, engine)
    from torch.distributed.tensor import distribute_tensor  # where Accelerate imports it
    sharded_sd = {}
    for name, meta_value in model.state_dict().items():
        full = full_sd[name].contiguous() if rank == 0 else \
            torch.empty(meta_value.size(), dtype=meta_value.dtype)
        dist.broadcast(full, src=0)
        sharded_sd[name] = distribute_tensor(full, meta_value.device_mesh, meta_value.placements) \
            if is_dtensor(meta_value) else full
    model.load_state_dict(sharded_sd, assign=True)
    rec = {"loaded": full_params(model, engine)}
    rec["train"] = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


# -- FSDPModule and its methods ---------------------------------------------------------------

def _is_fsdp_module(module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


@idiom
def isinstance_fsdp_module(rank, world, engine, tmpdir):
    """`isinstance(model, FSDPModule)` / `isinstance(block, FSDPModule)` (Accelerate and
    torchtitan branch on it), and False for an unwrapped submodule."""
    model = shard(build(0), engine)
    return {"root": _is_fsdp_module(model), "block": _is_fsdp_module(model.layers[0]),
            "lm_head": _is_fsdp_module(model.lm_head)}


@idiom
def set_requires_gradient_sync_accumulation(rank, world, engine, tmpdir):
    """Gradient accumulation without communication: `model.set_requires_gradient_sync(False)`
    for the first micro-batch, `True` for the last (FSDP1's `no_sync`)."""
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 2, micro_batches=2,
                before_micro=lambda m, k, last: m.set_requires_gradient_sync(last))
    rec["params"] = full_params(model, engine)
    return rec


def _unshard_reshard(rank, engine, async_op):
    model, opt = _trained(engine, rank=rank)
    handle = model.unshard(async_op=async_op)
    if async_op:
        handle.wait()
    rec = {"unsharded": {n: unsharded_now(p, s) for (n, p), s in zip(
        _root_params(model), ([VOCAB, DIM], [DIM], [VOCAB, DIM]))}}
    rec["lm_head_weight"] = model.lm_head.weight.detach().clone()  # read while unsharded
    model.reshard()
    rec["resharded"] = {n: not unsharded_now(p, s) for (n, p), s in zip(
        _root_params(model), ([VOCAB, DIM], [DIM], [VOCAB, DIM]))}
    rec["train"] = train(model, opt, rank, 1, start=1)
    return rec


def _root_params(model):
    return [("tok_embeddings.weight", model.tok_embeddings.weight),
            ("norm.weight", model.norm.weight), ("lm_head.weight", model.lm_head.weight)]


@idiom
def unshard_then_reshard(rank, world, engine, tmpdir):
    """`model.unshard()` (the root's own parameters at full size: read a weight), then
    `model.reshard()`, then training goes on."""
    return _unshard_reshard(rank, engine, async_op=False)


@idiom
def unshard_async_wait(rank, world, engine, tmpdir):
    """The same with `handle = model.unshard(async_op=True); handle.wait()`."""
    return _unshard_reshard(rank, engine, async_op=True)


def _train_with(rank, engine, setup=None, before_micro=None, micro_batches=1, steps=2,
                after_step=None, shard_embedding=False, after_optimizer=None):
    """Train with an FSDPModule method called by `setup(model)` (after sharding) and/or
    `before_micro(model, k, last)`."""
    model = build(0)
    if shard_embedding:
        fully_shard_of(engine)(model.tok_embeddings, mesh=dp_mesh(dist.get_world_size()))
    shard(model, engine)
    if setup is not None:
        setup(model)
    opt = adamw(model.parameters())
    if after_optimizer is not None:
        after_optimizer(model)
    rec = {"losses": [], "grad_norms": []}
    for step in range(steps):
        part = train(model, opt, rank, 1, start=step, micro_batches=micro_batches,
                     before_micro=before_micro)
        for key in rec:
            rec[key] += part[key]
        if after_step is not None:
            after_step(model)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def method_set_reshard_after_backward(rank, world, engine, tmpdir):
    """Accumulation that keeps parameters gathered between micro-batches:
    `model.set_reshard_after_backward(last)` before each micro-batch."""
    return _train_with(rank, engine, micro_batches=2,
                       before_micro=lambda m, k, last: m.set_reshard_after_backward(last))


@idiom
def method_set_reshard_after_forward(rank, world, engine, tmpdir):
    """`model.set_reshard_after_forward(False)` for an evaluation under no_grad, `True` again
    for training. The optimizer is built first, while every parameter is sharded: built after
    such an evaluation, FSDP2's gets the root's unsharded parameters (FSDP2 leaves the root
    unsharded after a no_grad forward), whose updates are lost (step 2's gradient norm 1.220
    instead of 0.872 here); ours reshards after inference, so both orders train alike."""
    def evaluate(m):
        m.set_reshard_after_forward(False)
        with torch.no_grad():
            loss_of(m, 100, rank)
        m.set_reshard_after_forward(True)
    return _train_with(rank, engine, after_optimizer=evaluate)


@idiom
def method_set_modules_to_forward_prefetch(rank, world, engine, tmpdir):
    """torchtitan's explicit prefetch: `layers[i].set_modules_to_forward_prefetch(
    [layers[i + 1]])`."""
    def setup(m):
        for a, b in zip(m.layers[:-1], m.layers[1:]):
            a.set_modules_to_forward_prefetch([b])
    return _train_with(rank, engine, setup=setup)


@idiom
def method_set_modules_to_backward_prefetch(rank, world, engine, tmpdir):
    """`layers[i].set_modules_to_backward_prefetch([layers[i - 1]])`."""
    def setup(m):
        for a, b in zip(m.layers[1:], m.layers[:-1]):
            a.set_modules_to_backward_prefetch([b])
    return _train_with(rank, engine, setup=setup)


@idiom
def method_set_is_last_backward(rank, world, engine, tmpdir):
    """`model.set_is_last_backward(last)` before each micro-batch of an accumulation."""
    return _train_with(rank, engine, micro_batches=2,
                       before_micro=lambda m, k, last: m.set_is_last_backward(last))


@idiom
def method_set_gradient_divide_factor(rank, world, engine, tmpdir):
    """torchtitan's summed gradients: `m.set_gradient_divide_factor(1.0)` on every module that
    `isinstance(m, FSDPModule)` (the loss is then normalized by the global token count). With
    `set_force_sum_reduction_for_comms(True)` too: FSDP2 otherwise reduces with PREMUL_SUM,
    which gloo lacks."""
    def setup(m):
        for module in m.modules():
            if _is_fsdp_module(module):
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
    return _train_with(rank, engine, setup=setup)


@idiom
def method_set_reduce_scatter_divide_factor(rank, world, engine, tmpdir):
    """The older name, called on the blocks and the root directly:
    `block.set_reduce_scatter_divide_factor(1.0)` (and `set_force_sum_reduction_for_comms(
    True)`, for gloo)."""
    def setup(m):
        for module in [*m.layers, m]:
            module.set_reduce_scatter_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return _train_with(rank, engine, setup=setup)


@idiom
def method_set_requires_all_reduce(rank, world, engine, tmpdir):
    """`model.set_requires_all_reduce(last)` before each micro-batch (HSDP accumulation
    without the replicas' all-reduce; a no-op on a 1-D mesh)."""
    return _train_with(rank, engine, micro_batches=2,
                       before_micro=lambda m, k, last: m.set_requires_all_reduce(last))


@idiom
def method_set_force_sum_reduction_for_comms(rank, world, engine, tmpdir):
    """`module.set_force_sum_reduction_for_comms(True)` on the blocks and the root."""
    def setup(m):
        for module in [*m.layers, m]:
            module.set_force_sum_reduction_for_comms(True)
    return _train_with(rank, engine, setup=setup)


@idiom
def method_set_post_optim_event(rank, world, engine, tmpdir):
    """After each `opt.step()`: `event = torch.Event(); event.record();
    model.set_post_optim_event(event)` (no `record()` on CPU, which has no events)."""
    def after_step(m):
        event = torch.Event()
        if torch.accelerator.is_available():  # CPU events cannot be recorded; FSDP2's CPU
            event.record()                    # streams ignore the wait
        m.set_post_optim_event(event)
    return _train_with(rank, engine, after_step=after_step, steps=3)


@idiom
def method_set_unshard_in_backward(rank, world, engine, tmpdir):
    """The embedding as its own unit, `model.tok_embeddings.set_unshard_in_backward(False)`
    (its backward does not read its weight)."""
    return _train_with(rank, engine, shard_embedding=True,
                       setup=lambda m: m.tok_embeddings.set_unshard_in_backward(False))


class _Injected(RuntimeError):
    pass


@idiom
def method_reset_iter_state(rank, world, engine, tmpdir):
    """Recovery after a forward that raised mid-flight: catch it, `model.reset_iter_state()`,
    train on."""
    model = shard(build(0), engine)
    opt = adamw(model.parameters())
    rec = train(model, opt, rank, 1)

    def boom(module, args, output):
        raise _Injected("injected failure in block 1's forward")
    handle = model.layers[1].register_forward_hook(boom)
    try:
        loss_of(model, 1, rank)
    except _Injected:
        pass
    handle.remove()
    model.reset_iter_state()
    rec["after"] = train(model, opt, rank, 2, start=1)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def method_set_keep_unsharded_storage(rank, world, engine, tmpdir):
    """torch 2.15: `model.set_keep_unsharded_storage(True)` (CUDA graph capture wants the full
    parameters at the same addresses every step): training as usual, and a block's full
    weight seen by its forward at one address in every step."""
    pointers = []

    def setup(m):
        m.set_keep_unsharded_storage(True)
        m.layers[0].attention.wq.register_forward_pre_hook(
            lambda module, args: pointers.append(module.weight.data_ptr()))
    rec = _train_with(rank, engine, setup=setup, steps=3)
    rec["one_address"] = len(set(pointers)) == 1 and len(pointers) == 3
    return rec


@idiom
def method_finalize_backward_without_manual_mode(rank, world, engine, tmpdir):
    """torch 2.15: `model.finalize_backward()` before the first forward (nothing to do), and
    after a step without `set_manual_backward_finalization(True)` (FSDP2 refuses it there);
    `set_manual_backward_finalization(False)` (the default) changes nothing."""
    model = shard(build(0), engine)
    rec = {"before_forward": model.finalize_backward(),
           "handle_before_forward": model.finalize_backward(async_op=True).wait()}
    model.set_manual_backward_finalization(False)
    rec.update(train(model, adamw(model.parameters()), rank, 1))
    try:
        model.finalize_backward()
        rec["after_step"] = "returned"
    except RuntimeError as err:
        rec["after_step"] = str(err).split(".")[0]
    return rec


@idiom
def register_fsdp_forward_method(rank, world, engine, tmpdir):
    """`torch.distributed.fsdp.register_fsdp_forward_method(model, "generate")` for a
    `generate` that calls `self.forward` directly; greedy decoding under no_grad."""
    from torch.distributed.fsdp import register_fsdp_forward_method as register
    model, _ = _trained(engine, rank=rank)
    register(model, "generate")
    tokens, logits = model.generate(batch(7, rank)[0][:, :4], 4)
    return {"tokens": tokens, "logits": logits, "train": train(model, adamw(
        model.parameters()), rank, 1, start=1)}


# -- fully_shard's arguments ------------------------------------------------------------------

@idiom
def fully_shard_list_of_modules(rank, world, engine, tmpdir):
    """torchtitan/Accelerate: `fully_shard([model.norm, model.lm_head])` (one unit for the
    tail), then the root."""
    model = build(0)
    fully_shard = fully_shard_of(engine)
    mesh = dp_mesh(world)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    rec = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


def _reshard_after_forward(rank, engine, value):
    model = shard(build(0), engine, reshard_after_forward=value)
    opt = adamw(model.parameters())
    loss = loss_of(model, 0, rank)
    rec = {"block0_wq_unsharded_after_forward":
           unsharded_now(model.layers[0].attention.wq.weight, [DIM, DIM])}
    loss.backward()
    opt.step()
    opt.zero_grad()
    rec["train"] = train(model, opt, rank, 2, start=1)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def reshard_after_forward_int_1(rank, world, engine, tmpdir):
    """`fully_shard(block, reshard_after_forward=1)` (an int: reshard to groups of 1 rank,
    i.e. keep a full copy; FSDP2 treats it as False); is block 0 still gathered after the
    forward, and training."""
    return _reshard_after_forward(rank, engine, 1)


@idiom
def reshard_after_forward_false(rank, world, engine, tmpdir):
    """`fully_shard(block, reshard_after_forward=False)` (ZeRO-2 style)."""
    return _reshard_after_forward(rank, engine, False)


def _rows_whole(p) -> bool:
    """Whether every rank holds whole dim-0 slices of `p` (what Shard(0) promises). FSDP2 says
    so with `Shard(0)`; ours with a RaggedPlacement whose blocks are whole slices (a rank's
    local tensor is its flat range, 1-D: a documented difference of representation)."""
    placement = p.placements[0]
    if isinstance(placement, Shard):
        return placement.dim == 0
    block = getattr(placement, "block", None)
    return block is not None and block % math.prod(p.shape[1:]) == 0


def _placement_fn_run(rank, engine, dim):
    from torch.distributed.tensor import Shard
    model = shard(build(0), engine,
                  shard_placement_fn=lambda p: Shard(dim) if p.ndim == 2 else Shard(0))
    rec = {"wq_rows_whole": _rows_whole(model.layers[0].attention.wq.weight)}
    rec.update(train(model, adamw(model.parameters()), rank, 2))
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def shard_placement_fn_shard0(rank, world, engine, tmpdir):
    """`fully_shard(..., shard_placement_fn=lambda p: Shard(0))` (the default, explicit)."""
    return _placement_fn_run(rank, engine, 0)


@idiom
def shard_placement_fn_shard1(rank, world, engine, tmpdir):
    """`shard_placement_fn` returning `Shard(1)` for 2-D weights (column sharding)."""
    return _placement_fn_run(rank, engine, 1)


@idiom
def mp_policy_torch_class_bf16(rank, world, engine, tmpdir):
    """`mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32, cast_forward_inputs=False)` (torch's class) on every unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    model = shard(build(0), engine, mp_policy=policy)
    rec = {"logits_dtype": str(model(batch(0, rank)[0]).dtype)}
    rec.update(train(model, adamw(model.parameters()), rank, 2))
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def mp_policy_bf16_accumulation(rank, world, engine, tmpdir):
    """torchtitan's mixed precision (`param_dtype=torch.bfloat16, reduce_dtype=torch.float32`)
    with accumulation: `model.set_requires_gradient_sync(last)` before each of 2 micro-batches
    (FSDP2 accumulates the unsharded gradients in fp32; torch 2.15's keeps the fp32 gradients
    autograd gives the RMSNorm weights, 2.14's rounds them to bf16 first)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(build(0), engine, mp_policy=policy)
    rec = train(model, adamw(model.parameters()), rank, 2, micro_batches=2,
                before_micro=lambda m, k, last: m.set_requires_gradient_sync(last))
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def mp_policy_output_dtype(rank, world, engine, tmpdir):
    """`MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)` on the
    root (bf16 blocks): the logits come out fp32; the loss on them without `.float()`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    model = build(0)
    fully_shard = fully_shard_of(engine)
    mesh = dp_mesh(world)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32))
    inputs, targets = batch(0, rank)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    return {"logits_dtype": str(logits.dtype), "loss": loss.item(), "grad_norm": grad_norm(model)}


@idiom
def cpu_offload_policy(rank, world, engine, tmpdir):
    """`fully_shard(..., offload_policy=torch.distributed.fsdp.CPUOffloadPolicy())`."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    model = shard(build(0), engine, offload_policy=CPUOffloadPolicy())
    rec = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def ignored_params(rank, world, engine, tmpdir):
    """`fully_shard(model, ignored_params={model.norm.weight})`: that parameter stays whole and
    unreduced (each rank trains its own copy)."""
    model = build(0)
    fully_shard = fully_shard_of(engine)
    mesh = dp_mesh(world)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params={model.norm.weight})
    rec = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


def _meta_init(rank, world, engine, init):
    """Build under `torch.device("meta")`, `fully_shard`, `model.to_empty(device="cpu")`,
    `init(model)` under a seed, two steps; and the same numbers for an unsharded model (the
    reference: see UNSHARDED_REFERENCE)."""
    with torch.device("meta"):
        model = TinyLM()
    shard(model, engine)
    model.to_empty(device="cpu")
    torch.manual_seed(42)
    init(model)
    rec = {"init": full_params(model, engine)}
    rec["train"] = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    plain = build(0)
    torch.manual_seed(42)
    init(plain)
    unsharded = {"init": {canonical(n): p.detach().clone() for n, p in plain.named_parameters()}}
    unsharded["train"] = train_unsharded(plain, adamw(plain.parameters()), rank, world, 2)
    unsharded["params"] = {canonical(n): p.detach().clone() for n, p in plain.named_parameters()}
    rec["unsharded"] = unsharded
    return rec


def _reset_every_module(model):
    for module in model.modules():
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()


@idiom
def meta_init_to_empty_reset_parameters(rank, world, engine, tmpdir):
    """FSDP2's documented recipe: on meta, `fully_shard`, `model.to_empty(device="cpu")`, then
    every submodule's `reset_parameters()` under a seed; then training."""
    return _meta_init(rank, world, engine, _reset_every_module)


@idiom
def meta_init_to_empty_init_weights(rank, world, engine, tmpdir):
    """torchtitan / nanoGPT: the same with `model.init_weights()`, which calls nn.init's
    normal_ / trunc_normal_ / zeros_ on the parameters themselves."""
    return _meta_init(rank, world, engine, TinyLM.init_weights)


@idiom
def compile_blocks_before_fully_shard(rank, world, engine, tmpdir):
    """torchtitan: `model.layers[i] = torch.compile(block)` for each block, then `fully_shard`
    each compiled block and the root (backend aot_eager: the same numbers as eager)."""
    model = build(0)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend="aot_eager")
    shard(model, engine)
    rec = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def compile_blocks_after_fully_shard(rank, world, engine, tmpdir):
    """`fully_shard` first, then `model.layers[i] = torch.compile(block)` for each block."""
    model = shard(build(0), engine)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend="aot_eager")
    rec = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


@idiom
def hsdp_mesh_1x2(rank, world, engine, tmpdir):
    """HSDP: a 2-D `init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate",
    "shard"))` given to `fully_shard` (one replica group of `world` ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model = shard(build(0), engine, mesh=mesh)
    rec = train(model, adamw(model.parameters()), rank, 2)
    rec["params"] = full_params(model, engine)
    return rec


# -- gradients and parameters as DTensors -----------------------------------------------------

@idiom
def grads_as_dtensors(rank, world, engine, tmpdir):
    """After `loss.backward()`: each `p.grad`'s type and shape, and `p.grad.full_tensor()`
    if a DTensor (gradient logging, custom clipping)."""
    model = shard(build(0), engine)
    loss_of(model, 0, rank).backward()
    return {"grads": describe({n: p.grad for n, p in model.named_parameters()})}


@idiom
def params_as_dtensors(rank, world, engine, tmpdir):
    """What DTensor-aware code reads on each parameter: `isinstance(p, DTensor)`, its global
    shape, `p.device_mesh`, `p.full_tensor()`, the elements of `p.to_local()` over all ranks,
    and whether the pieces are whole dim-0 slices. Not compared, by design: the placement's
    class (RaggedPlacement, not Shard(0)) and the local tensor's shape (a rank's flat range,
    1-D, not a block of rows)."""
    model = shard(build(0), engine)
    out = {}
    for n, p in model.named_parameters():
        local = torch.tensor([p.to_local().numel()])
        dist.all_reduce(local)
        out[n] = {"is_dtensor": isinstance(p, DTensor), "shape": list(p.shape),
                  "mesh": p.device_mesh.mesh.tolist(), "full": p.full_tensor(),
                  "local_elements": int(local), "rows_whole": _rows_whole(p)}
    return out


# -- running an idiom on the ranks ------------------------------------------------------------

def run_idiom(rank, world, name, engine, tmpdir):
    """On each rank: run one idiom with one engine; its record, or the exception it raised
    (caught here, so that the pool's other ranks are not torn down with a traceback)."""
    started = time.perf_counter()
    torch.manual_seed(0)
    try:
        record = _plain(IDIOMS[name](rank, world, engine, tmpdir))
        out = {"status": "ok", "record": record}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - the verdict reports it (DCP's
        # CheckpointException is a BaseException)
        message = [line for line in str(err).strip().splitlines() if line.strip()]
        if len(message) > 1 and "Traceback" in str(err):  # a wrapped error: its last line too
            message = [f"{message[0]} ... {message[-1].strip()}"]
        elif len(message) > 1 and message[0].endswith(":"):  # "Error(s) in loading ...:"
            message = [f"{message[0]} {message[1].strip()}"]
        frames = traceback.extract_tb(err.__traceback__)
        ours = [f for f in frames if f.filename == __file__]
        where = f"{ours[-1].name}:{ours[-1].lineno} `{(ours[-1].line or '')[:70]}`" \
            if ours else ""
        deepest = frames[-1]
        out = {"status": "raises",
               "error": f"{type(err).__name__}: {message[0][:300] if message else ''}",
               "where": where,
               "raised_in": f"{os.path.relpath(deepest.filename, _root_of(deepest.filename))}"
                            f":{deepest.lineno}"}
    finally:
        if "compile" in name:
            torch._dynamo.reset()
    out["seconds"] = time.perf_counter() - started
    return out


def _root_of(path):
    for marker in ("site-packages", "wt-idioms"):
        if marker in path:
            return path[:path.index(marker) + len(marker)]
    return os.path.dirname(path)


def _plain(value):
    """A record as picklable plain data: CPU tensors, lists, dicts, scalars."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        if is_dtensor(value):
            raise TypeError("a record holds a DTensor: describe() it first")
        return value.detach().cpu().clone()
    return value


class Ranks:
    """2 gloo ranks (a tests/dist_harness.py RankPool) for the idioms, replaced after any run
    in which a rank raised, hung or died: a failed rank may have left a collective half done,
    or a module state behind. Unlike `RankPool.run`, a run keeps what the ranks that finished
    returned (one rank raising while its peer waits in a collective is a hang worth seeing
    whole) and notices a dead rank at once instead of at the timeout."""

    def __init__(self, world: int = 2):
        from dist_harness import RankPool
        self.world = world
        self._pool_class = RankPool
        self.pool = RankPool(world)

    def run(self, name, engine, tmpdir) -> list:
        timeout = TIMEOUTS.get(name, DEFAULT_TIMEOUT_S)
        pool = self.pool
        for tasks in pool._tasks:
            tasks.put((run_idiom.__module__, run_idiom.__name__, (name, engine, tmpdir)))
        outcomes, deadline = {}, time.monotonic() + timeout
        while len(outcomes) < self.world:
            try:
                rank, ok, value = pool._results.get(timeout=1.0)
                outcomes[rank] = value if ok else {  # (run_idiom catches; this is a bug)
                    "status": "raises", "error": value.strip().splitlines()[-1], "where": "",
                    "seconds": 0.0}
                if outcomes[rank]["status"] != "ok":  # its peers may wait for it forever
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                continue
            except queue.Empty:
                pass
            dead = {r: p.exitcode for r, p in enumerate(pool._procs)
                    if r not in outcomes and not p.is_alive()}
            if dead or time.monotonic() > deadline:
                for r in range(self.world):
                    if r in dead:
                        outcomes[r] = {"status": "crashes", "where": "", "seconds": 0.0,
                                       "error": f"the rank died (exit code {dead[r]})"}
                    elif r not in outcomes:
                        outcomes[r] = {"status": "hangs", "where": "", "seconds": timeout,
                                       "error": "no result (waiting in a collective?)"}
                break
        outcomes = [outcomes[r] for r in range(self.world)]
        if any(o["status"] != "ok" for o in outcomes):
            self.restart()
        return outcomes

    def restart(self):
        self.pool.close()
        self.pool = self._pool_class(self.world)

    def close(self):
        self.pool.close()


# -- comparing the two engines ----------------------------------------------------------------

@dataclass
class Result:
    name: str
    verdict: str
    detail: str
    fsdp2: list
    ours: list
    differences: list = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def ours_error(self) -> str:
        return _first_failure(self.ours) or ""


def compare_idiom(ranks: Ranks, name: str, tmpdir: str) -> Result:
    """Run `name` with FSDP2, then with ours, and compare."""
    fsdp2 = ranks.run(name, "fsdp2", tmpdir)
    ours = ranks.run(name, "ours", tmpdir)
    return judge(name, fsdp2, ours)


_SEVERITY = {"crashes": 3, "raises": 2, "hangs": 1, "ok": 0}


def _status(outcomes) -> str:
    """One status for the ranks: crashes (a rank died) > raises (a rank raised; a peer may
    wait for it in a collective, which a launcher would end) > hangs (no rank raised, one
    never finished) > ok."""
    return max((o["status"] for o in outcomes), key=_SEVERITY.get)


def _first_failure(outcomes):
    """What went wrong, or None: the error once when every rank had the same, else per rank
    (a raise first: it usually explains a peer's hang)."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o["status"] != "ok"]
    if not failed:
        return None
    texts = [f"{o['error']}" + (f" [{o['where']}]" if o.get("where") else "") for _, o in failed]
    if len(failed) == len(outcomes) and len(set(texts)) == 1:
        return texts[0]
    first = {"raises": 0, "crashes": 1, "hangs": 2}
    order = sorted(range(len(failed)), key=lambda i: first[failed[i][1]["status"]])
    return "; ".join(f"rank {failed[i][0]}: {texts[i]}" for i in order) + \
        "".join(f"; rank {rank}: ok" for rank, o in enumerate(outcomes) if o["status"] == "ok")


# Idioms where FSDP2 on CPU is no reference, and why; the idiom's record carries an
# "unsharded" record of the same code on an unsharded model, which each engine is held to.
UNSHARDED_REFERENCE = {
    name: "torch's DTensor random ops are correct only on CUDA-like meshes (_random.py, "
          "is_rng_supported_mesh): on CPU each rank draws its shard from the same generator "
          "state, so FSDP2's init is not an unsharded model's"
    for name in ("meta_init_to_empty_reset_parameters", "meta_init_to_empty_init_weights")}


def _against_unsharded(outcomes, prefix):
    """Each rank's record without its "unsharded" part compared with that part."""
    differences, worst = [], (0.0, "")
    for rank, o in enumerate(outcomes):
        record = dict(o["record"])
        reference = record.pop("unsharded")
        diffs, rank_worst = compare_records(reference, record, f"{prefix}r{rank}")
        differences += diffs
        worst = max(worst, rank_worst)
    return differences, worst


def judge(name, fsdp2, ours) -> Result:
    if name in UNSHARDED_REFERENCE:
        return _judge_against_unsharded(name, fsdp2, ours)
    info = {}
    for engine, outcomes in (("fsdp2", fsdp2), ("ours", ours)):
        for o in outcomes:
            if o["status"] == "ok":
                info.update({f"{engine}: {k}": v for k, v in o["record"].pop("info", {}).items()})
    failed = _first_failure(fsdp2)
    if failed:
        return Result(name, f"FSDP2 {_status(fsdp2)}", failed, fsdp2, ours, info=info)
    failed = _first_failure(ours)
    if failed:
        return Result(name, _status(ours), failed, fsdp2, ours, info=info)
    differences, worst = [], (0.0, "")
    for rank, (a, b) in enumerate(zip(fsdp2, ours)):
        diffs, rank_worst = compare_records(a["record"], b["record"], f"r{rank}")
        differences += diffs
        worst = max(worst, rank_worst)
    if differences:
        return Result(name, "WRONG", _summarize(differences), fsdp2, ours, differences, info)
    detail = "bitwise" if worst[0] == 0.0 else f"max |diff| {worst[0]:.1e} ({worst[1]})"
    return Result(name, "equal", detail, fsdp2, ours, info=info)


def _judge_against_unsharded(name, fsdp2, ours) -> Result:
    info = {"why not FSDP2": UNSHARDED_REFERENCE[name]}
    if not _first_failure(fsdp2):
        diffs, _ = _against_unsharded(fsdp2, "fsdp2.")
        info["FSDP2 vs unsharded"] = _summarize(diffs) if diffs else "equal"
    failed = _first_failure(ours)
    if failed:
        return Result(name, _status(ours), failed, fsdp2, ours, info=info)
    differences, worst = _against_unsharded(ours, "")
    if differences:
        return Result(name, "WRONG", _summarize(differences), fsdp2, ours, differences, info)
    detail = "bitwise" if worst[0] == 0.0 else f"max |diff| {worst[0]:.1e} ({worst[1]})"
    return Result(name, "equal (unsharded)", detail, fsdp2, ours, info=info)


def flatten(value, prefix=""):
    """{path: leaf} of a record (dict keys joined by '.', list indices in brackets)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out or {prefix: []}
    return {prefix: value}


def compare_records(ref, got, prefix):
    """([(size of the difference or inf, path, text)], (largest numeric difference within
    tolerance, its path)) between FSDP2's record `ref` and ours `got`."""
    a, b = flatten(ref), flatten(got)
    diffs, worst = [], (0.0, "")
    for path in sorted(a.keys() | b.keys()):
        where = f"{prefix}.{path}"
        if path not in b:
            diffs.append((math.inf, where, "missing in ours"))
            continue
        if path not in a:
            diffs.append((math.inf, where, "only in ours"))
            continue
        x, y = a[path], b[path]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                diffs.append((math.inf, where, f"{_short(x)} vs {_short(y)}"))
            elif x.shape != y.shape or x.dtype != y.dtype:
                diffs.append((math.inf, where, f"{_short(x)} vs {_short(y)}"))
            elif x.numel():
                d = (x.double() - y.double()).abs().max().item()
                if not d <= TOLERANCE:
                    diffs.append((d, where, f"max |diff| {d:.2e} (|ref| max "
                                            f"{x.double().abs().max().item():.3g})"))
                else:
                    worst = max(worst, (d, where))
        elif isinstance(x, float) and isinstance(y, (int, float)) and not isinstance(y, bool):
            d = abs(x - y)
            if not d <= TOLERANCE:
                diffs.append((d, where, f"{x:.6g} vs {y:.6g}"))
            else:
                worst = max(worst, (d, where))
        elif x != y or type(x) is not type(y):
            diffs.append((math.inf, where, f"{_short(x)} vs {_short(y)}"))
    return diffs, worst


def _short(v):
    if isinstance(v, torch.Tensor):
        return f"tensor{list(v.shape)} {str(v.dtype).replace('torch.', '')}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _summarize(differences, shown=3):
    ordered = sorted(differences, key=lambda d: -d[0])
    parts = [f"{path}: {text}" for _, path, text in ordered[:shown]]
    more = f" (+{len(ordered) - shown} more)" if len(ordered) > shown else ""
    return f"{len(ordered)} differ: " + "; ".join(parts) + more


# -- the table --------------------------------------------------------------------------------

def _column(outcomes):
    status = _status(outcomes)
    if status == "ok":
        return f"ok {max(o['seconds'] for o in outcomes):.1f}s"
    if status == "raises":
        error = next(o["error"] for o in outcomes if o["status"] == "raises")
        return f"raises {error.split(':')[0]}"
    return status


def print_table(results, out=sys.stdout):
    width = max(len(r.name) for r in results)
    header = f"{'idiom':<{width}} | {'FSDP2':<14} | {'ours':<26} | {'verdict':<12} | " \
             "numbers / error"
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        print(f"{r.name:<{width}} | {_column(r.fsdp2):<14} | {_column(r.ours):<26} | "
              f"{r.verdict:<12} | {r.detail}", file=out)
    counts = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    print("\n" + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())), file=out)
    notes = [(r.name, k, v) for r in results for k, v in r.info.items()]
    if notes:
        print("\nnotes:", file=out)
        for name, k, v in notes:
            print(f"  {name}: {k}: {v}", file=out)


def main(argv=None) -> int:
    from dist_harness import scratch_dir
    names = list(argv if argv is not None else sys.argv[1:]) or list(IDIOMS)
    unknown = [n for n in names if n not in IDIOMS]
    if unknown:
        print(f"unknown idioms {unknown}; known: {', '.join(IDIOMS)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    ranks = Ranks(2)
    tmpdir = scratch_dir()
    results = []
    try:
        for name in names:
            result = compare_idiom(ranks, name, tmpdir)
            print(f"[{time.perf_counter() - started:6.1f}s] {name}: {result.verdict}  "
                  f"{result.detail}", flush=True)
            results.append(result)
    finally:
        ranks.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    print()
    print_table(results)
    print(f"\n{len(results)} idioms in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fsdp2_idioms  # the ranks import the idioms by this module name, not __main__
    sys.exit(fsdp2_idioms.main())

