"""DeepSpeed ZeRO-3 (deepspeed/runtime/zero/stage3.py), estimated, not simulated: flat
partitions of ceil(numel / W) per parameter in the parameter dtype, the fp32 master and gradient
partitions, the optimizer state, the reduce bucket, and the gathered parameters DeepSpeed's
default prefetch, reuse-distance and live-parameter limits allow; and the bytes its collectives
move.

With offload, read from stage3.py (DeepSpeedZeroOptimizer_Stage3) and partition_parameters.py:
offload_optimizer's `ratio` puts the last sub-groups (of sub_group_size partition elements,
_create_fp16_sub_groups) on the host: `i >= int((1 - ratio) * n)` (_setup_for_real_optimizer);
their fp32 master, optimizer state and fp32 gradient buffer (`fp32_partitioned_groups_flat[i]
.grad`, pinned) are host memory, and so is the flat fp32 gradient accumulation buffer of every
partition (`grad_partitions_flat_buffer` on `self.device`, which is the CPU). The parameter
partitions in the compute dtype stay on the device, unless offload_param keeps them on the host
(`param_groups_fp16_flat_cpu_memory`, pinned) and copies each to the device for its all-gather
(`ds_tensor.to(device)`, partition_parameters.py).

With expert parallelism (DeepSpeed AutoEP), the expert tensors are partitioned over their
expert-data-parallel group (engine.py: `groups._get_expert_data_parallel_group`): here each
tensor's partition is ceil(numel / M) over its unit's shard group (Setup.group_size).
"""
from __future__ import annotations

from ..model_plan import DTYPE_BYTES
from ..optim_spec import is_muon_matrix, shampoo_statistics
from .request import MASTER_BYTES, Setup, add_traffic
from .units import Unit, expand

__all__ = ["ZERO3_DEFAULTS", "estimate_zero3", "traffic_zero3", "pcie_zero3", "sub_groups"]

# DeepSpeed ZeRO-3's defaults (deepspeed/runtime/zero/config.py): elements.
ZERO3_DEFAULTS = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                  "max_live_parameters": 1_000_000_000, "max_reuse_distance": 1_000_000_000,
                  "param_persistence_threshold": 100_000, "sub_group_size": 1_000_000_000}


def sub_groups(root: Unit, others: list, setup: Setup) -> list:
    """[(partition elements, optimizer state bytes, host?)] per optimizer sub-group: partitions
    packed in the model's parameter order until one reaches sub_group_size
    (stage3._create_fp16_sub_groups), the last `ratio` of them on the host when the optimizer
    is offloaded."""
    limit = ZERO3_DEFAULTS["sub_group_size"]
    groups, numel, state = [], 0, 0
    late = set(root.late)   # the model's order: embeddings, the layers, then the head
    M0 = setup.group_size(root)
    tensors = [(t, M0) for t in root.tensors if t.name not in late] + \
        [(t, setup.group_size(u)) for u, _ in expand(others) for t in u.tensors] + \
        [(t, M0) for t in root.tensors if t.name in late]
    for k, (t, M) in enumerate(tensors):
        part = -(-t.numel // M)
        numel += part
        state += _state(t, part, setup)
        if numel >= limit or k == len(tensors) - 1:
            groups.append([numel, state])
            numel = state = 0
    first_host = int((1 - setup.offload_optimizer) * len(groups)) \
        if setup.offload_optimizer else len(groups)
    return [(n, st, i >= first_host) for i, (n, st) in enumerate(groups)]


def _state(t, part: int, setup: Setup) -> int:
    """Optimizer state bytes of one parameter partition."""
    if setup.optimizer == "AdamW":
        return 2 * MASTER_BYTES * part
    if setup.optimizer == "AdamW8bit":
        return 2 * part + 2 * 4 * -(-part // 256)
    if setup.optimizer == "Shampoo":  # DeepSpeed has none: our statistics, spread evenly
        share = shampoo_statistics(t.shape, t.numel // t.shape[-1], setup.shampoo_block) * part \
            // max(1, t.numel) if len(t.shape) >= 2 else 0
        return 2 * MASTER_BYTES * (part + share)
    return (1 if is_muon_matrix(t.name, t.shape) else 2) * MASTER_BYTES * part


def estimate_zero3(root: Unit, others: list, setup: Setup) -> dict:
    pb = DTYPE_BYTES[setup.param_dtype]
    d = ZERO3_DEFAULTS
    units = ([root] if root.tensors else []) + list(others)
    partition = persistent = numel = largest_tensor = 0
    state = 0
    padding = {}   # padded elements of all ranks, by shard group size
    for u in units:
        M = setup.group_size(u)
        for t in u.tensors:
            n = t.numel
            part = -(-n // M)
            padding[M] = padding.get(M, 0) + (part * M - n) * u.repeat
            partition += part * u.repeat
            numel += n * u.repeat
            largest_tensor = max(largest_tensor, n)
            if n < d["param_persistence_threshold"]:
                persistent += n * u.repeat     # kept gathered for the whole run
            state += _state(t, part, setup) * u.repeat
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
    host = None
    if setup.offloads:
        master, grad, state, step, gathered, host = _offload_zero3(
            root, others, setup, partition, persistent, gathered, largest_tensor)
    total = master + grad + state + max(gathered, step)
    result = {"master": int(master), "grad": int(grad), "optimizer": int(state),
              "gathered_peak": int(gathered), "optimizer_step_peak": int(step),
              "total": int(total), "peak_phase": "forward_backward" if gathered >= step
              else "optimizer_step",
              "padding": int(round(sum(pad / M for M, pad in padding.items()) * MASTER_BYTES)),
              "padding_ratio": sum(padding.values()) / max(1, numel)}
    if host is not None:
        result.update(host)
    return result


def _offload_zero3(root, others, setup, partition, persistent, gathered, largest_tensor):
    """(device master, grad, optimizer, step peak, gathered peak, {param_shard, host, ...})."""
    pb = DTYPE_BYTES[setup.param_dtype]
    groups = sub_groups(root, others, setup)
    on_host = [g for g in groups if g[2]]
    on_device = [g for g in groups if not g[2]]
    host_numel, host_state = sum(g[0] for g in on_host), sum(g[1] for g in on_host)
    dev_numel, dev_state = sum(g[0] for g in on_device), sum(g[1] for g in on_device)
    param = pb * partition   # the compute-dtype partitions (lp_param_buffer)
    if setup.offload_optimizer:
        # Device: the fp32 master and gradient buffer of the device sub-groups (the hybrid
        # torch AdamW steps them; its foreach step: one fp32 temporary of the largest), and
        # partition_grads' device copy of one partition's fp32 gradient at a time.
        master = MASTER_BYTES * dev_numel
        grad = MASTER_BYTES * dev_numel
        step = MASTER_BYTES * max((g[0] for g in on_device), default=0)
        gathered += MASTER_BYTES * -(-largest_tensor // setup.shard_size)   # no EP here
        host = {"master": MASTER_BYTES * host_numel,
                "grad": MASTER_BYTES * partition + MASTER_BYTES * host_numel,
                "optimizer": host_state}
    else:   # offload_param alone: the fp32 master is a copy of its own on the device
        master, grad, step = MASTER_BYTES * partition, MASTER_BYTES * partition, \
            MASTER_BYTES * min(ZERO3_DEFAULTS["sub_group_size"], partition)
        host = {"master": 0, "grad": 0, "optimizer": 0}
    host["param"] = param if setup.offload_param else 0
    host["optimizer_step_peak"] = 0   # DeepSpeedCPUAdam steps in place
    device_param = 0 if setup.offload_param else param
    master += device_param + persistent * pb
    return master, grad, dev_state, step, gathered, {
        "param_shard": device_param, "offloaded_ratio": host_state / max(1, host_state +
                                                                        dev_state),
        "host": {**host, "total": sum(host.values())}}


def traffic_zero3(root: Unit, others: list, setup: Setup) -> dict:
    """ZeRO-3: every parameter above the persistence threshold gathered in forward and, unless
    the reuse distance keeps it, again in backward; every gradient reduce-scattered, per
    micro-step; flat partitions of ceil(numel / W), each over its unit's shard group."""
    gathered = _gathered_partitions(root, others, setup)
    by_group = {}
    for unit in ([root] if root.tensors else []) + list(others):
        M = setup.group_size(unit)
        by_group[M] = by_group.get(M, 0) + sum(-(-t.numel // M) * unit.repeat
                                               for t in unit.tensors)
    return add_traffic(setup.traffic(0, 0), *(setup.traffic(gathered.get(M, 0), r, M)
                                              for M, r in sorted(by_group.items())))


def _gathered_partitions(root: Unit, others: list, setup: Setup) -> dict:
    """{shard group size: partition elements ZeRO-3 all-gathers per micro-step}
    (traffic_zero3)."""
    d = ZERO3_DEFAULTS
    gathered, later = {}, 0
    for u, _ in reversed(expand(others)):
        if 2 * later >= d["max_reuse_distance"]:
            break
        M = setup.group_size(u)
        gathered[M] = gathered.get(M, 0) - sum(-(-t.numel // M) for t in u.tensors if t.numel >= d[
            "param_persistence_threshold"])
        later += u.numel
    for unit in ([root] if root.tensors else []) + list(others):
        M = setup.group_size(unit)
        for t in unit.tensors:
            part = -(-t.numel // M) * unit.repeat
            if t.numel >= d["param_persistence_threshold"]:
                gathered[M] = gathered.get(M, 0) + 2 * part
    return gathered


def pcie_zero3(root: Unit, others: list, setup: Setup) -> dict:
    """ZeRO-3 offload, bytes per rank per optimizer step across host<->device. Optimizer
    offload, every micro-step (stage3.partition_grads): each gradient partition into the host's
    fp32 accumulation buffer (non-blocking `copy_`: cast on the device, 4 B per element) and
    back to the device (`grad_buffer.to(device)`; accumulating micro-steps: to the device,
    add, back), then at the boundary (_offload_grad_partition_at_boundary) the host
    sub-groups' fp32 gradients once more to the host; after the step
    (_reassign_or_swap_out_partitioned_parameters) each host sub-group's parameters in the
    compute dtype to the device (blocking `copy_`: cast on the host). Parameter offload: each
    all-gather's partition to the device in the compute dtype, as often as traffic_zero3
    gathers, plus the persistent parameters' re-gather after the step (_post_step); a device
    sub-group's updated fp32 master goes to the host partition (blocking: 4 B per element)."""
    pb = DTYPE_BYTES[setup.param_dtype]
    M, n = setup.shard_size, setup.grad_accum
    groups = sub_groups(root, others, setup)
    partition = sum(g[0] for g in groups)
    host_numel = sum(g[0] for g in groups if g[2])
    h2d = d2h = 0
    if setup.offload_optimizer:
        d2h += n * MASTER_BYTES * partition + MASTER_BYTES * host_numel
        h2d += n * MASTER_BYTES * partition
        if not setup.offload_param:
            h2d += pb * host_numel
    if setup.offload_param:
        gathered = sum(_gathered_partitions(root, others, setup).values())
        persistent = sum(-(-t.numel // M) * u.repeat
                         for u in ([root] if root.tensors else []) + list(others)
                         for t in u.tensors
                         if t.numel < ZERO3_DEFAULTS["param_persistence_threshold"])
        h2d += n * gathered * pb + persistent * pb
        d2h += MASTER_BYTES * (partition - host_numel)
    return {"host_to_device": h2d, "device_to_host": d2h}
