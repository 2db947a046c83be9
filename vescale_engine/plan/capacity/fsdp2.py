"""PyTorch FSDP2 (torch/distributed/fsdp/_fully_shard/), simulated as ours is: one step's
allocations and frees replayed unit by unit; and the bytes its collectives move.

Each parameter sharded on dim 0, padded to a multiple of W; the all-gather output, then the
unsharded parameters it is copied out into (both W x padded), the output kept in forward until
the next unit's copy-out; autograd's unsharded gradients, kept until the unit's reduce-scatter
copies them into its input buffer, which lives until the next unit's reduce-scatter; the root's
gradients kept to the end.

With offload (any of Setup.offload_optimizer / offload_param: FSDP2's CPUOffloadPolicy is all
or nothing), read from _fsdp_param.py and _fsdp_collectives.py: the padded fp32 sharded
parameters (FSDPParam._init_sharded_param: `.cpu()`, pinned), their gradients and the
optimizer state (built over those CPU parameters, stepped there) are host memory. On the
device: each unshard copies the fp32 shards to the device and casts them
(FSDPParam.all_gather_inputs: `.to(device)`, then `_to_dtype_if_needed`), and each
reduce-scatter's output is cast to fp32 there before its copy to the host
(foreach_reduce: `_to_dtype_if_needed(reduce_output, orig_dtype)`, then `.to("cpu")`).
"""
from __future__ import annotations

import math

from ..model_plan import DTYPE_BYTES
from ..optim_spec import is_muon_matrix, shampoo_statistics
from .request import MASTER_BYTES, Setup, add_traffic
from .timeline import Timeline
from .units import Unit, expand

__all__ = ["simulate_fsdp2", "traffic_fsdp2", "pcie_fsdp2", "unit_shard"]


def _dim0_shard(shape, world: int, dim: int = 0) -> int:
    """Elements of rank 0's padded shard on `dim` (every rank stores the padded size)."""
    return -(-shape[dim] // world) * (math.prod(shape) // shape[dim])


def _shard(t, unit: Unit, setup: Setup) -> int:
    """Rank 0's padded shard of tensor `t` of `unit`, over the unit's shard group."""
    world = setup.group_size(unit)
    return _dim0_shard(t.shape, world, 1 if unit.expert and world > t.shape[0] else 0)


def unit_shard(unit: Unit, setup: Setup) -> int:
    """Elements of rank 0's padded shards of one instance of `unit` (FSDP2's all-gather input:
    every rank's is this size)."""
    return sum(_shard(t, unit, setup) for t in unit.tensors)


def _fsdp2_optimizer(unit: Unit, setup: Setup) -> tuple:
    """torch.optim.AdamW (fused): two moments and a step per parameter over rank 0's local
    shard (the full chunk). AdamW8bit/Muon have no FSDP2 implementation: the estimate is an
    element-wise 8-bit optimizer over the same shards (codes plus one fp32 scale per 256
    elements, per moment), and Muon with fp32 momentum that gathers one whole matrix. Shampoo:
    the blocks of each rank's dim-0 shard (cut at shard boundaries, as Meta's
    DistributedShampoo does under FSDP2)."""
    state = largest = 0
    for t in unit.tensors:
        local = _shard(t, unit, setup)
        if setup.optimizer == "AdamW":
            state += 2 * MASTER_BYTES * local + 4
        elif setup.optimizer == "AdamW8bit":
            state += 2 * local + 2 * 4 * -(-local // 256) + 4
        elif setup.optimizer == "Shampoo":  # blocks of each rank's dim-0 shard (Meta's
            # DistributedShampoo's default under FSDP2): moments plus L, R, QL, QR
            state += 2 * MASTER_BYTES * local + 4 + (2 * MASTER_BYTES * shampoo_statistics(
                t.shape, local // t.shape[-1], setup.shampoo_block) if len(t.shape) >= 2 else 0)
        elif is_muon_matrix(t.name, t.shape):
            state += MASTER_BYTES * local
            largest = max(largest, t.numel)
        else:
            state += 2 * MASTER_BYTES * local + 4
    return state, 2 * MASTER_BYTES * largest


def simulate_fsdp2(root: Unit, others: list, setup: Setup) -> dict:
    pb = DTYPE_BYTES[setup.param_dtype]
    rb = DTYPE_BYTES[setup.reduce]
    mixed = setup.param_dtype not in ("fp32", "float32")
    offload = setup.offloads
    tl = Timeline()
    units = ([root] if root.tensors else []) + list(others)
    repeat = {u.name: u.repeat for u in units}
    W = {u.name: setup.group_size(u) for u in units}   # each unit's shard group
    S = {u.name: sum(_shard(t, u, setup) for t in u.tensors) for u in units}
    master = sum(S[u.name] * repeat[u.name] for u in units) * MASTER_BYTES
    state, step_peak = 0, 0
    for u in units:
        s, peak = _fsdp2_optimizer(u, setup)
        state += s * repeat[u.name]
        step_peak = max(step_peak, peak)
    largest_shard = max((_shard(t, u, setup) for u in units for t in u.tensors), default=0)
    host = {}
    if offload:
        # torch.optim.AdamW over CPU tensors: neither fused nor foreach by default
        # (optim/optimizer.py _default_to_fused_or_foreach), so _single_tensor_adamw, one
        # parameter at a time: `exp_avg_sq.sqrt() / bias_correction2_sqrt` holds two fp32
        # temporaries of the largest shard at once.
        host_step = 2 * MASTER_BYTES * largest_shard if setup.optimizer == "AdamW" else step_peak
        host = {"master": master, "grad": master, "optimizer": state, "param": 0,
                "optimizer_step_peak": host_step}
        master, state, step_peak = 0, 0, 0
    tl.alloc("master", master, "master")
    tl.alloc("optimizer", state, "optimizer")
    order = expand(others)
    rkey = (root, 0) if root.tensors else None
    seq = ([rkey] if rkey else []) + order

    def name(kind, key):
        return (kind, key[0].name, key[1])

    def all_gather(key):
        """unshard(): the all-gather output (and, with a compute dtype, its cast input)."""
        if name("unsharded", key) in tl.live or name("ag", key) in tl.live:
            return
        tl.alloc(name("ag", key), W[key[0].name] * S[key[0].name] * pb)
        if offload:   # the cast inputs, and the fp32 device copy of the one being cast
            tl.spike(S[key[0].name] * pb + (max(_shard(t, key[0], setup) for t in key[0].tensors)
                                            * MASTER_BYTES if mixed else 0))
        elif mixed:
            tl.spike(S[key[0].name] * pb)

    def copy_out(key, keep_output):
        if name("unsharded", key) in tl.live:
            return
        tl.alloc(name("unsharded", key), W[key[0].name] * S[key[0].name] * pb)
        if not keep_output:
            tl.free(name("ag", key))

    grad_kind = "grad"
    for micro in range(setup.grad_accum):
        accumulate = micro > 0
        kept = None   # forward keeps the last all-gather output until the next copy-out
        for key in seq:
            all_gather(key)
            if kept is not None:
                tl.free(kept)
            copy_out(key, keep_output=True)
            kept = name("ag", key)
            if key is not rkey and setup.reshard_after_forward:
                tl.free(name("unsharded", key))
        if kept is not None:
            tl.free(kept)   # the root's post-forward frees the last output
        if rkey:   # root pre-backward prefetches the last unit; the head's gradients stay
            if order:
                all_gather(order[-1])
            late = set(root.late)
            for t in root.tensors:
                if t.name in late or t.uses > 1:
                    tl.alloc(("rootgrad", t.name), t.numel * pb)
        rs_state = None
        for k in range(len(order) - 1, -1, -1):
            key = order[k]
            all_gather(key)
            copy_out(key, keep_output=False)
            if k > 0:
                all_gather(order[k - 1])
            numel = key[0].numel
            tl.alloc(name("grads", key), numel * pb)     # autograd's unsharded gradients
            rs_state = _fsdp2_reduce(tl, key, name, S, W, rb, rs_state, accumulate or offload,
                                     grad_kind)
        if rkey:
            for t in root.tensors:
                if t.name not in set(root.late):
                    tl.alloc(("rootgrad", t.name), t.numel * pb)
            for t in root.tensors:
                if t.uses > 1:   # the embedding's gradient and its sum with the held one,
                    tl.alloc(("rootgrad", "new", t.name), t.numel * pb)  # which replaces it
                    tl.spike(t.numel * pb)
                    tl.free(("rootgrad", "new", t.name))
            rootgrads = [k for k in tl.live if k[0] == "rootgrad"]
            rs_state = _fsdp2_reduce(tl, rkey, name, S, W, rb, rs_state, accumulate or offload,
                                     grad_kind, extra=rootgrads)
        if rs_state:
            tl.free(rs_state)
    tl.phase = "optimizer_step"
    tl.spike(step_peak)
    numel = sum(u.numel * u.repeat for u in units)
    padding = {}   # padded elements of all ranks, by shard group size
    for u in units:
        padding[W[u.name]] = padding.get(W[u.name], 0) + \
            (W[u.name] * S[u.name] - u.numel) * u.repeat
    result = tl.summary(master, sum(pad / M for M, pad in padding.items()) * MASTER_BYTES,
                        sum(padding.values()) / max(1, numel))
    if offload:
        result.update(param_shard=0, offloaded_ratio=1.0,
                      host={**host, "total": sum(host.values())})
    return result


def _fsdp2_reduce(tl, key, name, S, W, rb, rs_state, accumulate, grad_kind, extra=()):
    """post_backward: reshard, free the previous reduce-scatter input, copy the gradients into
    this one's input, free them, reduce into a shard, cast it to fp32 if needed."""
    tl.free(name("unsharded", key))
    if rs_state:
        tl.free(rs_state)
    tl.alloc(name("rs_in", key), W[key[0].name] * S[key[0].name] * rb)
    tl.free(name("grads", key))
    for k in extra:
        tl.free(k)
    shard = S[key[0].name]
    # accumulating: the reduce-scatter output (cast to fp32), added into the gradient; with
    # offload always so: the fp32 copy goes to the host and its device memory is freed
    if accumulate:
        tl.spike(shard * rb + (shard * MASTER_BYTES if rb != MASTER_BYTES else 0))
    else:
        if rb != MASTER_BYTES:
            tl.alloc(name("rs_out", key), shard * rb)
        tl.alloc(name("grad", key), shard * MASTER_BYTES, grad_kind)
        tl.free(name("rs_out", key))
    return name("rs_in", key)


def _gathered_and_reduced(root: Unit, others: list, setup: Setup) -> dict:
    """{shard group size: [shard elements all-gathered, reduce-scattered]} per micro-step:
    every unit gathered in forward, the non-root ones again in backward when resharded (the
    last one too), the padded shard; one reduce-scatter per unit."""
    by_group = {}
    for unit, is_root in ([(root, True)] if root.tensors else []) + [(u, False) for u in others]:
        shard = sum(_shard(t, unit, setup) for t in unit.tensors) * unit.repeat
        moved = by_group.setdefault(setup.group_size(unit), [0, 0])
        moved[0] += shard * (2 if setup.reshard_after_forward and not is_root else 1)
        moved[1] += shard
    return by_group


def traffic_fsdp2(root: Unit, others: list, setup: Setup) -> dict:
    """FSDP2's collectives: W x each gathered shard, one reduce-scatter per unit, each over
    the unit's shard group."""
    return add_traffic(setup.traffic(0, 0), *(
        setup.traffic(g, r, M)
        for M, (g, r) in sorted(_gathered_and_reduced(root, others, setup).items())))


def pcie_fsdp2(root: Unit, others: list, setup: Setup) -> dict:
    """FSDP2 with CPUOffloadPolicy, bytes per rank per optimizer step across host<->device:
    `host_to_device`: each all-gather's input, the fp32 padded shards of the unit (copied
    before the cast, FSDPParam.all_gather_inputs), as often as traffic_fsdp2 gathers;
    `device_to_host`: each reduce-scatter's output cast to fp32 (foreach_reduce), every
    micro-step. Nothing comes back after the step: the parameters are the host's."""
    moved = _gathered_and_reduced(root, others, setup).values()
    h2d, d2h = sum(g for g, _ in moved), sum(r for _, r in moved)
    n = setup.grad_accum
    return {"host_to_device": n * h2d * MASTER_BYTES, "device_to_host": n * d2h * MASTER_BYTES}
