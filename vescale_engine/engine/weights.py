"""The model's weights in `initialize`: where the model goes before wrapping and where its values
come from after.

`place_model` moves a CPU model to the rank's device (a meta model stays on meta);
`prepare_weights` is initialize's one choice of weight source (a transformers build under a
vescale zero.Init, the config's `vescale.hf_checkpoint`, or `materialize`'s init). It composes
the lower layers (fsdp, materialize, checkpoint.hf, the zero.Init record); they must not know
about it.
"""
from __future__ import annotations

import logging
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..checkpoint.hf import load_into
from ..fsdp.materialize import init_fn_of, materialize
from ..fsdp.param import sharding_of
from ..fsdp.deferred import deferred_record, replayed_generator
from ..fsdp.guards import meta_leftovers
from ..launch.device import DeviceError

__all__ = ["place_model", "take_rank0_values", "prepare_weights"]

LOG = logging.getLogger("vescale_engine")
_NAMED = 3  # parameter names in the log line


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Move a CPU model to this rank's GPU before wrapping (as DeepSpeed's engine does). A
    model on meta stays there (initialize materializes it after wrapping); a model that mixes
    meta with real tensors (unless a vescale zero.Init built it: then the real ones, added
    after the build, move), or sits on another device than this rank's, is an error."""
    named = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, tensor in named if tensor.device.type == "meta"]
    if meta and len(meta) < len(named) and deferred_record(model) is not None:
        # built under a vescale zero.Init, then given real tensors (PEFT adapters, a new head):
        # those move (the deferred modules' own wait for initialize: fsdp/deferred.py's
        # record; the DeepSpeed integration's zero.Init keeps them there)
        return model.to(device) if device.type == "cuda" else model
    if meta and len(meta) < len(named):
        real = next((name, t.device) for name, t in named if t.device.type != "meta")
        raise DeviceError(f"{meta[0]} is on the meta device but {real[0]} is on {real[1]}: "
                          "build the whole model on meta (initialize materializes it) or on CPU")
    if meta:
        return model
    for name, tensor in named:
        where = tensor.device
        if where != device and not (where.type == "cpu" and device.type == "cuda"):
            raise DeviceError(f"{name} is on {where} but this rank's device is {device}: build "
                              f"the model on CPU, or on {device} (engine.device)")
    return model.to(device) if device.type == "cuda" else model


def take_rank0_values(model: nn.Module) -> int:
    """Every rank starts from rank 0's values of the parameters it holds in full (not those a
    zero.Init left on meta), as DeepSpeed's initialize broadcasts them: a model whose ranks
    drew different values (a seed per rank, weights set on rank 0 only) would otherwise be
    stitched from each rank's own shard. Two sums per tensor go in one all-reduce first, and
    only the tensors that differ are broadcast. DeepSpeed MoE experts (`allreduce=False`)
    differ by design and are left alone. Returns how many were taken from rank 0."""
    named = [(n, p) for n, p in model.named_parameters()
             if not p.is_meta and not isinstance(p, DTensor)  # placed by the caller
             and sharding_of(p, full=True) is None  # a shard differs by rank by design
             and getattr(p, "allreduce", True) is not False]
    if not named or dist.get_world_size() == 1:
        return 0
    prints = torch.stack([_fingerprint(p) for _, p in named])
    both = torch.cat([prints, -prints])  # the largest and the smallest in one all-reduce
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    differ = [i for i in range(len(named))
              if not torch.equal(both[i], -both[len(named) + i])]
    for i in differ:
        dist.broadcast(named[i][1].data, src=0)
    if differ and dist.get_rank() == 0:
        names = ", ".join(named[i][0] for i in differ[:_NAMED])
        more = f" and {len(differ) - _NAMED} more" if len(differ) > _NAMED else ""
        LOG.warning(f"initialize: {len(differ)} of {len(named)} parameters differed between "
                    f"ranks ({names}{more}): every rank starts from rank 0's values, as "
                    "DeepSpeed's initialize does")
    return len(differ)


def _fingerprint(param: torch.Tensor) -> torch.Tensor:
    values = param.detach().double().nan_to_num(nan=0.0, posinf=1.0, neginf=-1.0).flatten()
    return torch.stack([values.sum(), values.square().sum()])


def prepare_weights(module: nn.Module, cfg, device: torch.device) -> None:
    """`initialize`'s one place for the weights, before the optimizer is built, first match:
    the deferred build's own way (a model transformers built under a vescale ZeRO-3 config:
    the checkpoint `from_pretrained` recorded, or `from_config`'s init; integrations/
    transformers/pretrained.py); the checkpoint `vescale.hf_checkpoint`
    names (a meta model gets its shards allocated and filled; what the file lacks is
    initialized by its modules); else, for a model wrapped on meta, random init by
    `materialize`, drawing from the generator as the caller left it, or, for a model built
    inside `deepspeed.zero.Init` (fsdp/deferred.py's record), as it was when the build
    started."""
    record = deferred_record(module)
    if record is not None and record.prepare_weights(module, cfg, device):
        return
    if cfg.checkpointing.hf_checkpoint:
        load_into(module, cfg.checkpointing.hf_checkpoint, device=device)
    elif meta_leftovers(module):
        with replayed_generator(record, device):
            _require_one_generator_state(cfg, device)
            materialize(module, device, init_fn=init_fn_of(module))


def _require_one_generator_state(cfg, device: torch.device) -> None:
    """Replicas (TP peers of the tensors TP leaves whole, HSDP and stage-0 replicas) each draw
    the values they hold: from different generator states they would start different and stay
    so, silently. One all-gather of a digest of the states, before any draw; every rank raises
    the same one line."""
    tp = cfg.parallel.tp if cfg.parallel is not None else 1
    if tp == 1 and cfg.hsdp_replicate_size <= 1 and cfg.zero_stage != 0:
        return   # every element is drawn on one rank only
    states = [torch.get_rng_state()] + \
        ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    digest = [zlib.crc32(state.numpy().tobytes()) for state in states]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    differ = [rank for rank, d in enumerate(every) if d != every[0]]
    if differ:
        raise ValueError(
            f"random init of a meta model with replicated tensors (tensor_parallel.autotp_size "
            f"{tp}, vescale.hsdp_replicate_size {cfg.hsdp_replicate_size}, zero stage "
            f"{cfg.zero_stage}) needs the same random state on every rank, and rank(s) "
            f"{differ[:8]} differ from rank 0: seed every rank alike (torch.manual_seed(seed), "
            "not seed + rank) before building the model")
