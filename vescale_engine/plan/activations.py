"""Activation memory per rank of a Llama-style decoder training step, with DeepSpeed's Ulysses
sequence parallelism (each rank holds seq / sp tokens of every sequence), and the longest
sequence a per-rank memory budget allows (`vescale plan --memory --seq`). Torch-free.

The count is what autograd keeps for backward in Hugging Face's Llama with sdpa attention,
per token a rank holds (b: the compute dtype's bytes, h: hidden, i: intermediate, q and kv:
the query and key/value widths, n: heads, V: vocabulary):

- each RMSNorm: its input in fp32 and 1/rms (h + 1 floats), the normalized value cast back
  to the compute dtype and the weighted output (2 h b): two per layer, one before the head;
- attention: the rotated queries and the keys and values (q + 2 kv) b, sdpa's output (q b)
  and log-sum-exp (n floats); with sp > 1 the output's all-to-all back is a copy (q b more);
- the MLP: gate and up outputs, SiLU's output and the product (4 i b); with DeepSpeed's
  TiledMLP only its input, the RMSNorm's output already counted;
- the loss: log-softmax over the vocabulary in fp32 (V floats); with TiledFusedLogitsLoss
  only the head's input, the final RMSNorm's output already counted;
- rotary cos and sin (2 head_dim b, shared by the layers), token ids and labels (int64).

With activation checkpointing (Hugging Face's, per decoder layer) a layer keeps only its input
(h b) through the forward, and one layer's full activations exist again while its backward
recomputes them. Parameters, gathered weights and gradients are not activations (the
capacity estimate counts them). benchmarks/sequence_parallel.py measures the same count on
the engine and on DeepSpeed (their activations are the model's; the two agree to the byte)
and compares this estimate with it.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecoderDims", "activation_bytes", "longest_sequence"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_FLOAT, _INT64 = 4, 8


@dataclass(frozen=True)
class DecoderDims:
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    q_width: int       # heads x head_dim
    kv_width: int      # key/value heads x head_dim
    head_dim: int = 128

    @property
    def heads(self) -> int:
        return self.q_width // self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict) -> "DecoderDims":
        """From a transformers Llama-style config's keys."""
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(config["hidden_size"], config["intermediate_size"], config["vocab_size"],
                   config["num_hidden_layers"], heads * head_dim,
                   config.get("num_key_value_heads", heads) * head_dim, head_dim)

    @classmethod
    def from_shapes(cls, model, head_dim: int = 128) -> "DecoderDims":
        """From a shapes file's tensors (plan.model_plan.ModelShapes): the repeated group's
        self_attn.q_proj / k_proj and mlp.gate_proj, the embedding; ValueError naming what is
        missing for a model that is not a dense Llama-style decoder (MoE MLPs included)."""
        repeated = [g for g in model.groups if g.repeat > 1 and not g.expert]
        single = [g for g in model.groups if g.repeat == 1]
        need = {"q": "self_attn.q_proj.weight", "kv": "self_attn.k_proj.weight",
                "mlp": "mlp.gate_proj.weight", "embed": "embed_tokens.weight"}
        found, layers = {}, 0
        for key, suffix in need.items():
            where = single if key == "embed" else repeated
            hits = [(g, shape) for g in where for name, shape in g.tensors
                    if name.endswith(suffix)]
            if not hits:
                raise ValueError(f"{model.name}: the activation estimate needs a dense "
                                 f"Llama-style decoder; no {'single' if key == 'embed' else 'repeated'}"
                                 f" group has a tensor named *{suffix}")
            found[key] = hits[0][1]
            if key == "q":
                layers = sum(g.repeat for g, _ in hits)
        return cls(found["embed"][1], found["mlp"][0], found["embed"][0], layers,
                   found["q"][0], found["kv"][0], head_dim)


def _per_token(dims: DecoderDims, sp: int, dtype: str, checkpointing: bool, tiled_mlp: bool,
               tiled_loss: bool) -> tuple:
    """(bytes kept per token through the forward, bytes of one layer's full activations per
    token: the transient a checkpointed layer's backward adds)."""
    b = _BYTES[dtype]
    h, q, kv = dims.hidden, dims.q_width, dims.kv_width
    norm = (h + 1) * _FLOAT + 2 * h * b
    attention = (2 * q + 2 * kv) * b + dims.heads * _FLOAT + (q * b if sp > 1 else 0)
    mlp = 0 if tiled_mlp else 4 * dims.intermediate * b  # tiled: keeps the norm's output
    layer = 2 * norm + attention + mlp
    head = norm + (0 if tiled_loss else dims.vocab * _FLOAT)
    shared = 2 * dims.head_dim * b + 2 * _INT64
    kept = dims.layers * (h * b if checkpointing else layer) + head + shared
    return kept, (layer if checkpointing else 0)


def activation_bytes(dims: DecoderDims, seq: int, micro_batch: int = 1, sp: int = 1,
                     dtype: str = "bf16", checkpointing: bool = False, tiled_mlp: bool = False,
                     tiled_loss: bool = False) -> int:
    """Peak activation bytes per rank for micro-batches of `micro_batch` sequences of `seq`
    tokens split over `sp` ranks."""
    if seq % sp:
        raise ValueError(f"a sequence of {seq} tokens does not split over sp {sp} ranks")
    kept, transient = _per_token(dims, sp, dtype, checkpointing, tiled_mlp, tiled_loss)
    return micro_batch * seq // sp * (kept + transient)


def longest_sequence(dims: DecoderDims, budget: float, micro_batch: int = 1, sp: int = 1,
                     dtype: str = "bf16", checkpointing: bool = False, tiled_mlp: bool = False,
                     tiled_loss: bool = False) -> int:
    """The longest sequence (a multiple of sp) whose activations fit in `budget` bytes per
    rank (0 when not even sp tokens do)."""
    kept, transient = _per_token(dims, sp, dtype, checkpointing, tiled_mlp, tiled_loss)
    tokens = int(max(budget, 0) // (micro_batch * (kept + transient)))  # per rank
    return tokens * sp
