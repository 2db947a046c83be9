"""DeepSpeed ZeRO-3 (deepspeed/runtime/zero/stage3.py), estimated, not simulated: flat
partitions of ceil(numel / W) per parameter in the parameter dtype, the fp32 master and gradient
partitions, the optimizer state, the reduce bucket, and the gathered parameters DeepSpeed's
default prefetch, reuse-distance and live-parameter limits allow; and the bytes its collectives
move.
"""
from __future__ import annotations

from ..model_plan import DTYPE_BYTES
from ..optim_spec import is_muon_matrix
from .request import MASTER_BYTES, Setup
from .units import Unit, expand

__all__ = ["ZERO3_DEFAULTS", "estimate_zero3", "traffic_zero3"]

# DeepSpeed ZeRO-3's defaults (deepspeed/runtime/zero/config.py): elements.
ZERO3_DEFAULTS = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                  "max_live_parameters": 1_000_000_000, "max_reuse_distance": 1_000_000_000,
                  "param_persistence_threshold": 100_000, "sub_group_size": 1_000_000_000}


def estimate_zero3(root: Unit, others: list, setup: Setup) -> dict:
    M = setup.shard_size
    pb = DTYPE_BYTES[setup.param_dtype]
    d = ZERO3_DEFAULTS
    units = ([root] if root.tensors else []) + list(others)
    partition = persistent = numel = largest_tensor = 0
    state = 0
    for u in units:
        for t in u.tensors:
            n = t.numel
            part = -(-n // M)
            partition += part * u.repeat
            numel += n * u.repeat
            largest_tensor = max(largest_tensor, n)
            if n < d["param_persistence_threshold"]:
                persistent += n * u.repeat     # kept gathered for the whole run
            if setup.optimizer == "AdamW":
                state += 2 * MASTER_BYTES * part * u.repeat
            elif setup.optimizer == "AdamW8bit":
                state += (2 * part + 2 * 4 * -(-part // 256)) * u.repeat
            else:
                state += (1 if is_muon_matrix(t.name, t.shape) else 2) * MASTER_BYTES * part \
                    * u.repeat
    # Partitions in the parameter dtype plus the fp32 master (one and the same in fp32), the fp32
    # gradient partitions (gradient_accumulation_dtype), the optimizer state.
    master = MASTER_BYTES * partition + (pb * partition if pb != MASTER_BYTES else 0) + \
        persistent * pb
    grad = MASTER_BYTES * partition
    # Gathered: what the reuse distance keeps from forward to backward (the trailing units
    # whose later parameters, gathered twice, stay under it), the module being computed (its
    # own parameters: about one tensor) and the prefetch bucket, capped by max_live_parameters
    # but never below that module; plus the reduce bucket and one gradient.
    kept, later = 0, 0
    for u, _ in reversed(expand(others)):
        if 2 * later >= d["max_reuse_distance"]:
            break
        kept += u.numel
        later += u.numel
    live = max(largest_tensor, min(d["max_live_parameters"],
                                   kept + largest_tensor + d["prefetch_bucket_size"], numel))
    gathered = live * pb + d["reduce_bucket_size"] * pb + largest_tensor * pb  # bucket: whole
    step = MASTER_BYTES * min(d["sub_group_size"], partition)   # flattened fp32 gradient
    total = master + grad + state + max(gathered, step)
    padding = partition * M - numel
    return {"master": int(master), "grad": int(grad), "optimizer": int(state),
            "gathered_peak": int(gathered), "optimizer_step_peak": int(step),
            "total": int(total), "peak_phase": "forward_backward" if gathered >= step
            else "optimizer_step", "padding": int(round(padding / M * MASTER_BYTES)),
            "padding_ratio": padding / max(1, numel)}


def traffic_zero3(root: Unit, others: list, setup: Setup) -> dict:
    """ZeRO-3: every parameter above the persistence threshold gathered in forward and, unless
    the reuse distance keeps it, again in backward; every gradient reduce-scattered, per
    micro-step; flat partitions of ceil(numel / W)."""
    M = setup.shard_size
    d = ZERO3_DEFAULTS
    gathered = reduced = kept = later = 0
    for u, _ in reversed(expand(others)):
        if 2 * later >= d["max_reuse_distance"]:
            break
        kept += sum(-(-t.numel // M) for t in u.tensors if t.numel >= d[
            "param_persistence_threshold"])
        later += u.numel
    for unit in ([root] if root.tensors else []) + list(others):
        for t in unit.tensors:
            part = -(-t.numel // M) * unit.repeat
            reduced += part
            if t.numel >= d["param_persistence_threshold"]:
                gathered += 2 * part
    gathered -= kept
    return setup.traffic(gathered, reduced)
