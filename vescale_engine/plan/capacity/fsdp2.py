"""PyTorch FSDP2 (torch/distributed/fsdp/_fully_shard/), simulated as ours is: one step's
allocations and frees replayed unit by unit; and the bytes its collectives move.

Each parameter sharded on dim 0, padded to a multiple of W; the all-gather output, then the
unsharded parameters it is copied out into (both W x padded), the output kept in forward until
the next unit's copy-out; autograd's unsharded gradients, kept until the unit's reduce-scatter
copies them into its input buffer, which lives until the next unit's reduce-scatter; the root's
gradients kept to the end.
"""
from __future__ import annotations

import math

from ..model_plan import DTYPE_BYTES
from ..optim_spec import is_muon_matrix
from .request import MASTER_BYTES, Setup
from .timeline import Timeline
from .units import Unit, expand

__all__ = ["simulate_fsdp2", "traffic_fsdp2"]


def _dim0_shard(shape, world: int) -> int:
    """Elements of rank 0's padded dim-0 shard (every rank stores the padded size)."""
    return -(-shape[0] // world) * math.prod(shape[1:])


def _fsdp2_optimizer(unit: Unit, setup: Setup, world: int) -> tuple:
    """torch.optim.AdamW (fused): two moments and a step per parameter over rank 0's local
    shard (the full chunk). AdamW8bit/Muon have no FSDP2 implementation: the estimate is an
    element-wise 8-bit optimizer over the same shards (codes plus one fp32 scale per 256
    elements, per moment), and Muon with fp32 momentum that gathers one whole matrix."""
    state = largest = 0
    for t in unit.tensors:
        local = _dim0_shard(t.shape, world)
        if setup.optimizer == "AdamW":
            state += 2 * MASTER_BYTES * local + 4
        elif setup.optimizer == "AdamW8bit":
            state += 2 * local + 2 * 4 * -(-local // 256) + 4
        elif is_muon_matrix(t.name, t.shape):
            state += MASTER_BYTES * local
            largest = max(largest, t.numel)
        else:
            state += 2 * MASTER_BYTES * local + 4
    return state, 2 * MASTER_BYTES * largest


def simulate_fsdp2(root: Unit, others: list, setup: Setup) -> dict:
    M = setup.shard_size
    pb = DTYPE_BYTES[setup.param_dtype]
    rb = DTYPE_BYTES[setup.reduce]
    mixed = setup.param_dtype not in ("fp32", "float32")
    tl = Timeline()
    units = ([root] if root.tensors else []) + list(others)
    repeat = {u.name: u.repeat for u in units}
    S = {u.name: sum(_dim0_shard(t.shape, M) for t in u.tensors) for u in units}
    master = sum(S[u.name] * repeat[u.name] for u in units) * MASTER_BYTES
    state, step_peak = 0, 0
    for u in units:
        s, peak = _fsdp2_optimizer(u, setup, M)
        state += s * repeat[u.name]
        step_peak = max(step_peak, peak)
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
        tl.alloc(name("ag", key), M * S[key[0].name] * pb)
        if mixed:
            tl.spike(S[key[0].name] * pb)

    def copy_out(key, keep_output):
        if name("unsharded", key) in tl.live:
            return
        tl.alloc(name("unsharded", key), M * S[key[0].name] * pb)
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
            rs_state = _fsdp2_reduce(tl, key, name, S, M, rb, rs_state, accumulate, grad_kind)
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
            rs_state = _fsdp2_reduce(tl, rkey, name, S, M, rb, rs_state, accumulate, grad_kind,
                                     extra=rootgrads)
        if rs_state:
            tl.free(rs_state)
    tl.phase = "optimizer_step"
    tl.spike(step_peak)
    numel = sum(u.numel * u.repeat for u in units)
    padding = sum((M * S[u.name] - u.numel) * u.repeat for u in units)
    return tl.summary(master, padding / M * MASTER_BYTES, padding / max(1, numel))


def _fsdp2_reduce(tl, key, name, S, M, rb, rs_state, accumulate, grad_kind, extra=()):
    """post_backward: reshard, free the previous reduce-scatter input, copy the gradients into
    this one's input, free them, reduce into a shard, cast it to fp32 if needed."""
    tl.free(name("unsharded", key))
    if rs_state:
        tl.free(rs_state)
    tl.alloc(name("rs_in", key), M * S[key[0].name] * rb)
    tl.free(name("grads", key))
    for k in extra:
        tl.free(k)
    shard = S[key[0].name]
    if accumulate:   # reduce-scatter output (cast to fp32), added into the gradient
        tl.spike(shard * rb + (shard * MASTER_BYTES if rb != MASTER_BYTES else 0))
    else:
        if rb != MASTER_BYTES:
            tl.alloc(name("rs_out", key), shard * rb)
        tl.alloc(name("grad", key), shard * MASTER_BYTES, grad_kind)
        tl.free(name("rs_out", key))
    return name("rs_in", key)


def traffic_fsdp2(root: Unit, others: list, setup: Setup) -> dict:
    """FSDP2: every unit gathered in forward, the non-root ones again in backward when resharded
    (the last one too), W x the dim-0 padded shard; one reduce-scatter per unit."""
    M = setup.shard_size
    gathered = reduced = 0
    for unit, is_root in ([(root, True)] if root.tensors else []) + [(u, False) for u in others]:
        shard = sum(_dim0_shard(t.shape, M) for t in unit.tensors) * unit.repeat
        gathered += shard * (2 if setup.reshard_after_forward and not is_root else 1)
        reduced += shard
    return setup.traffic(gathered, reduced)
