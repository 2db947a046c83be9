"""The FLOPs of one training step, unit by unit, from a shapes file and its "architecture"
section (model_plan.Architecture), and the time they take on a cluster's GPU.

Per token, forward, one instance of a unit:
- matmuls: 2 FLOPs per active weight element. Active: every weight, except that a routed
  expert's tensors (a name part "experts"; shared experts are "shared_experts") count at
  experts_per_token / experts of their elements, and the input embedding is a lookup, not a
  matmul (unless tied to the head: then it counts once, as the head). Norms and biases count
  too, as torchtitan's parameter count does (<0.1% of the weights).
- attention, in each decoder layer: scores and values, 2 * seq * heads * (head_dim +
  v_head_dim) = 4 * seq * heads * head_dim, unhalved for the causal mask.

Model FLOPs, for MFU (`model_flops_per_token`), follow torchtitan's definition for comparability
(torchtitan/models/utils.py, get_dense_model_nparams_and_flops / get_moe_model_nparams_and_flops):
3 x the forward above (backward = 2 x forward), i.e. 6 * N + 12 * L * H * Q * T with N the
active parameters less the embedding, causal attention counted unhalved, no recompute.

Executed FLOPs, for time (`unit_flops`), differ where the GPU does different work:
- causal attention is halved: FlashAttention skips the masked blocks (its benchmarks count
  causal FLOPs halved too, which is the convention the cluster's attention_efficiency uses);
- attention's backward is 2.5 x its forward (FlashAttention recomputes the scores: 5 matmuls
  against 2; flash-attention's benchmarks/benchmark_flash_attention.py uses 2.5), matmuls' 2 x;
- activation checkpointing of the decoder layers (groups holding attention tensors: a name
  part "self_attn", "attention" or "attn"; embeddings, final norm and head are not
  checkpointed) adds recompute to backward: "full" the layer's
  whole forward; "selective" torchtitan's op-level SAC (torchtitan/distributed/
  activation_checkpoint.py, _apply_op_sac), which saves SDPA's output and every other matmul's,
  so it recomputes about half the layer's matmul FLOPs and no attention.

Left out as FLOPs: sliding-window attention (GPT-OSS's every other layer: this counts full
attention, as torchtitan does), elementwise work (norms, activations, softmax, rotary, the
router's top-k) and MoE load imbalance (every expert is assumed to get its share). The shipped
clusters' efficiencies are calibrated on a measured eager-PyTorch step (their "source" says
which), so they fold the elementwise work in, at that model's proportions; the optimizer step is
simulate.py's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..capacity.units import tensor_uses
from ..model_plan import ModelShapes, ShapesError
from .cluster import Cluster

__all__ = ["CHECKPOINTING", "EMBEDDING_NAMES", "FLASH_BACKWARD", "SELECTIVE_RECOMPUTE",
           "GroupFlops", "Work", "group_flops", "active_params", "model_flops_per_token",
           "unit_flops", "unit_time", "copy_time"]

CHECKPOINTING = ("none", "selective", "full")
# the input embedding's tensor, as Hugging Face, torchtitan and GPT-2 name it
EMBEDDING_NAMES = ("embed_tokens.weight", "tok_embeddings.weight", "wte.weight",
                   "word_embeddings.weight")
FLASH_BACKWARD = 2.5        # flash-attention's benchmarks: backward FLOPs = 2.5 x forward
SELECTIVE_RECOMPUTE = 0.5   # torchtitan's op SAC recomputes every other matmul


@dataclass(frozen=True)
class GroupFlops:
    """One group (FSDP unit) of a shapes file: per token, forward, one instance."""
    name: str
    repeat: int
    params: float      # active weight elements (module docstring)
    attention: float   # attention FLOPs at the sequence length, unhalved (0: not a layer)
    layer: bool        # a decoder layer: checkpointed when activation checkpointing is on

    @property
    def matmul(self) -> float:
        return 2.0 * self.params


@dataclass(frozen=True)
class Work:
    """FLOPs per token of one pass of one instance, split by the efficiency they run at."""
    matmul: float
    attention: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention

    def time(self, tokens: int, cluster: Cluster) -> float:
        d = cluster.device
        return tokens * (self.matmul / (d.bf16_flops * d.matmul_efficiency)
                         + self.attention / (d.bf16_flops * d.attention_efficiency))


def _is_expert(name: str) -> bool:
    return "experts" in name.split(".")


def _is_attention(name: str) -> bool:
    return bool({"self_attn", "attention", "attn"} & set(name.split(".")))


def _is_embedding(name: str) -> bool:
    return any(name == e or name.endswith("." + e) for e in EMBEDDING_NAMES)


def group_flops(model: ModelShapes, seq_len: int) -> tuple:
    """One GroupFlops per group of a (global, not TP/EP-local) shapes file with an
    "architecture" section; errors name the file."""
    arch = model.architecture
    if arch is None:
        raise ShapesError(f"{model.path}: no 'architecture' section: FLOPs need the model's "
                          f"layers, heads and head dims (docs/design.md, Shapes files)")
    if seq_len < 1:
        raise ShapesError(f"sequence length must be positive, got {seq_len}")
    layers = {g.name for g in model.groups if any(_is_attention(t) for t, _ in g.tensors)}
    repeats = sum(g.repeat for g in model.groups if g.name in layers)
    if repeats != arch.layers:
        raise ShapesError(f"{model.path}: architecture.layers is {arch.layers} but the groups "
                          f"with attention tensors ({', '.join(sorted(layers)) or 'none'}) "
                          f"repeat {repeats} times")
    tied = arch.tied_embeddings or any(count > 1 for (_, t), count in
                                       tensor_uses(model.path).items() if _is_embedding(t))
    attention = 2.0 * seq_len * arch.heads * (arch.head_dim + arch.value_dim)
    out = []
    for g in model.groups:
        params = 0.0
        for name, shape in g.tensors:
            n = math.prod(shape)
            if _is_expert(name):
                if not arch.experts:
                    raise ShapesError(f"{model.path}: group {g.name!r}, tensor {name!r}: an "
                                      f"expert tensor, but architecture.experts is not set")
                params += n * arch.experts_per_token / arch.experts
            elif not _is_embedding(name) or tied:
                params += n
        layer = g.name in layers
        out.append(GroupFlops(g.name, g.repeat, params, attention if layer else 0.0, layer))
    return tuple(out)


def active_params(model: ModelShapes) -> float:
    """Active weight elements per token, the embedding lookup excluded: torchtitan's N."""
    return sum(g.params * g.repeat for g in group_flops(model, 1))


def model_flops_per_token(model: ModelShapes, seq_len: int) -> float:
    """torchtitan's FLOPs per token for MFU: 6 * N + 12 * L * H * Q * T (no recompute, causal
    attention unhalved)."""
    return sum(3 * (g.matmul + g.attention) * g.repeat for g in group_flops(model, seq_len))


def unit_flops(g: GroupFlops, checkpointing: str = "none", causal: bool = True) -> tuple:
    """(forward, backward) Work per token of one instance, as executed: causal attention halved,
    FlashAttention's backward at 2.5 x, the layer's recompute (if checkpointed) in backward."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"unknown activation checkpointing {checkpointing!r} (expected one of "
                         f"{', '.join(CHECKPOINTING)})")
    attention = g.attention / 2 if causal else g.attention
    forward = Work(g.matmul, attention)
    backward = Work(2 * g.matmul, FLASH_BACKWARD * attention)
    if g.layer and checkpointing == "full":
        backward = Work(backward.matmul + forward.matmul, backward.attention + attention)
    elif g.layer and checkpointing == "selective":
        backward = Work(backward.matmul + SELECTIVE_RECOMPUTE * forward.matmul,
                        backward.attention)
    return forward, backward


def unit_time(g: GroupFlops, tokens: int, cluster: Cluster, checkpointing: str = "none",
              causal: bool = True) -> tuple:
    """(forward, backward) seconds of one instance of a unit over `tokens` tokens (one rank's
    micro-batch: batch x sequence length)."""
    forward, backward = unit_flops(g, checkpointing, causal)
    return forward.time(tokens, cluster), backward.time(tokens, cluster)


def copy_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds to copy `nbytes` within device memory (FSDP2's copy-in before its all-gather and
    copy-out after it): each byte read once and written once."""
    d = cluster.device
    return 2 * nbytes / (d.memory_bandwidth * d.memory_efficiency)
