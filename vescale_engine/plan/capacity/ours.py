"""Ours, simulated: one optimizer step (its gradient-accumulation micro-steps, then the
optimizer) replayed unit by unit as the allocations and frees fsdp/, shard/dbuffer.py and
optim/ make, from the planner's layouts; and the bytes its collectives move.

Per DBuffer the fp32 master shard (S elements) and, from the first reduce-scatter of a step
until the next step's first forward, the fp32 gradient shard; the full buffer (W x S in the
compute dtype) from a unit's all-gather until its reduce-scatter has been waited for, which
happens in the *next* unit's post-backward (so three full buffers are live in backward: the one
reducing, the one computing, the one prefetched), gradients written in place over it; the
gradient autograd makes for one tensor before it is added into that buffer; with a reduce dtype
other than the compute dtype, the cast copy the reduce-scatter reads instead (the full buffer is
freed once cast) and the staging shard; the root unit gathered from the first forward to the end
of backward.

With offload (Setup.offload_optimizer = r > 0), as optim/offload.py does it: whole DBuffers,
largest optimizer state first, go to the host until at least r of the optimizer state bytes
are there (`offloaded_buffers`). An offloaded buffer's fp32 master, a gradient copy and its
optimizer state live on the host (one pinned allocation per buffer, with the staging tensor
the compute shard's refresh casts into when the compute dtype is not fp32), and so does its
gradient shard: each reduction's result (staged on the device, cast to fp32 there) is copied
to the host as the unit finishes reducing. The device keeps a compute-dtype shard the
all-gather sends (`param_shard`), which comes back after each step. With
offload_param as well the compute shard lives on the host (in place of the staging tensor) and
each all-gather copies it to the device instead. `pcie` counts those bytes. offload_param
without offload_optimizer moves nothing where there is an optimizer: ours is estimated without
offload then.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..granularity import parse_granularity
from ..model_plan import DTYPE_BYTES
from ..optim_spec import (MUON_ROUNDS_IN_FLIGHT, QUANT_CHUNK_ELEMENTS, is_muon_matrix,
                          shampoo_statistics)
from ..planner import TensorSpec, plan_unit
from ..quantization import quantization_block, shard_group_counts
from .request import MASTER_BYTES, CapacityError, Setup, add_traffic
from .timeline import Timeline
from .units import Unit, expand

__all__ = ["ADAMW8BIT_STEP_BYTES_PER_ELEMENT", "ADAMW8BIT_TABLE_BYTES", "UNITS_CHECK_BYTES",
           "PlanCache", "offloaded_buffers", "simulate_ours", "traffic", "pcie"]

# AdamW8bit's step, per element of the largest chunk it works on at a time (quantize.py), at
# its peak while quantizing a moment again: both moments restored to fp32 (8 B), the normalized
# values (4), the int32 keys (4), and the lookup `below[key]`: the int64 copy of the keys that
# indexing makes (8) and its int32 result (4). (Measured: benchmarks/capacity_check.py.)
ADAMW8BIT_STEP_BYTES_PER_ELEMENT = 28
UNITS_CHECK_BYTES = 16  # fsdp/unit.py's digest of the units a forward ran: one per forward
# ... and once per process and device, its lookup tables: for the signed and the unsigned code
# table, the midpoint count below each of the 2^17 float keys (int32), and the small tables
# (codes, midpoints) of at most 256 fp32 entries each.
ADAMW8BIT_TABLE_BYTES = 2 * ((1 << 17) * 4 + 3 * 256 * 4)


@dataclass
class _Planned:
    """One unit as fully_shard lays it out, with rank 0's share of it."""
    unit: Unit
    shard: int            # elements per rank, summed over the unit's buffers
    full: int             # elements of its full buffers (world x shard)
    numel: int
    buffers: list         # BufferLayout
    rank0: dict = field(default_factory=dict)  # tensor name -> rank 0's elements of it
    world: int = 1        # the ranks it is sharded over (its shard group)
    groups: int = 0       # quantized communication: scales per shard (the most any rank has)
    buffer_groups: tuple = ()  # the same per buffer (its collectives are one per buffer)


class PlanCache:
    def __init__(self):
        self.plans = {}

    def plan(self, unit: Unit, setup: Setup) -> _Planned:
        # the engine's granularity: the one given, else the optimizer's (AdamW8bit's
        # quantization block, Shampoo's shampoo:B: check_setup refuses a given one that cuts a
        # Shampoo block); AdamW8bit quantizes in the blocks it is sharded with
        granularity = parse_granularity(setup.layout_granularity)
        itemsize = min(MASTER_BYTES, DTYPE_BYTES[setup.param_dtype])
        align = max(1, setup.align_bytes // itemsize)   # fully_shard's alignment rule
        M = setup.group_size(unit)
        group = setup.quantization_group if setup.quantized else None
        try:
            specs = tuple(TensorSpec(t.name, t.shape, _block(
                math.lcm(granularity.block_size(t.shape), t.cut), t, group))
                          for t in unit.tensors)
        except ValueError as err:
            raise CapacityError(f"unit {unit.name!r}: {err}") from None
        key = (specs, M, align, setup.max_buffers)
        if key not in self.plans:
            self.plans[key] = plan_unit(list(specs), M, align, setup.max_buffers)
        layout = self.plans[key]
        rank0 = {}
        for buf in layout.buffers:
            for p in buf.placements:
                rank0[p.name] = max(0, min(p.offset + p.numel, buf.shard_size) - p.offset) \
                    if p.offset < buf.shard_size else 0
        shard = sum(b.shard_size for b in layout.buffers)
        per_buffer = tuple(max(shard_group_counts(b, group)) if group else 0
                           for b in layout.buffers)
        return _Planned(unit, shard, shard * M, unit.numel, list(layout.buffers), rank0, M,
                        sum(per_buffer), per_buffer)


def _block(block: int, tensor, group) -> int:
    """The planner block fully_shard gives a tensor (quantized: joined up to a group)."""
    return block if group is None else min(quantization_block(block, group),
                                           max(1, tensor.numel))


def _segments_rank0(buf) -> int:
    """AdamW8bit's quantization segments in rank 0's shard of `buf` (adamw8bit.shard_segments:
    each tensor piece cut into its blocks, every gap a segment of its own)."""
    S, count, cursor = buf.shard_size, 0, 0
    for p in sorted(buf.placements, key=lambda p: p.offset):
        start, end = p.offset, min(p.offset + p.numel, S)
        if start >= S:
            break
        if start > cursor:
            count += 1
        count += -(-(end - start) // p.block)
        cursor = end
    return count + (1 if S > cursor else 0)


def _buffer_optimizer(buf, setup: Setup) -> tuple:
    """(state bytes, step transient bytes) of AdamW or AdamW8bit for one buffer on rank 0."""
    if setup.optimizer == "AdamW":   # two fp32 moments, a 0-d step; fused step: in place
        return 2 * MASTER_BYTES * buf.shard_size + 4, 0
    segments = _segments_rank0(buf)
    # int8 + uint8 codes, two fp32 scales and one int64 length per segment, the step
    return (2 * buf.shard_size + 2 * 4 * segments + 8 * segments + 4,
            ADAMW8BIT_STEP_BYTES_PER_ELEMENT * min(buf.shard_size, QUANT_CHUNK_ELEMENTS))


def _ours_optimizer(planned: _Planned, setup: Setup) -> tuple:
    """(state bytes, step transient bytes) of the optimizer for one unit instance on rank 0."""
    if setup.optimizer in ("AdamW", "AdamW8bit"):
        steps = [_buffer_optimizer(buf, setup) for buf in planned.buffers]
        return sum(s for s, _ in steps), max((p for _, p in steps), default=0)
    if setup.optimizer == "Shampoo":
        return _shampoo_state(planned, setup.shampoo_block)
    # Muon: fp32 momentum for its matrices, AdamW moments and a step for every other non-empty
    # piece. The step makes each matrix's update (fp32) and keeps the Newton-Schulz results
    # (bf16) of this rank's pieces, gathers whole matrices on their roots a few rounds ahead and
    # orthogonalizes one at a time: bounded by the largest matrix.
    state = muon_local = largest = 0
    for t in planned.unit.tensors:
        local = planned.rank0.get(t.name, 0)
        if is_muon_matrix(t.name, t.shape):
            state += MASTER_BYTES * local
            muon_local += local
            largest = max(largest, t.shape[-2] * t.shape[-1])
        elif local:
            state += 2 * MASTER_BYTES * local + 4
    ns = 2 * largest * (MUON_ROUNDS_IN_FLIGHT + 4)
    return state, (MASTER_BYTES + 2) * muon_local + ns


def _shampoo_state(planned: _Planned, block: int) -> tuple:
    """Shampoo on rank 0: fp32 grafting v and momentum m per element, two steps per tensor, and
    for its blocks fp32 L, R, QL, QR (rank 0 holds each tensor's first rows: whole row runs).
    The step's transients: the denominators and directions (2 per element), the stacked
    gradient, Adam and preconditioned blocks (3 per element) and the G G^T / G^T G products
    (the statistics' size), plus float64 eigendecompositions (input, vectors, output: 3 x 8
    bytes per statistic element) at a root recomputation."""
    elements = statistics = 0
    state = 0
    for t in planned.unit.tensors:
        local = planned.rank0.get(t.name, 0)  # every parameter has a state, even empty
        elements += local
        state += 2 * MASTER_BYTES * local + 16   # v, m; int64 step and roots step
        if len(t.shape) >= 2:
            statistics += shampoo_statistics(t.shape, local // max(1, t.shape[-1]), block)
    state += 2 * MASTER_BYTES * statistics  # L and R, QL and QR
    return state, MASTER_BYTES * (5 * elements + statistics) + 3 * 8 * statistics // 2


def offloaded_buffers(units: list, setup: Setup) -> dict:
    """{(id(planned), instance): {buffer index}}: the DBuffers whose master and optimizer state
    live on the host. Every buffer of every unit instance in `units` (the root, then forward
    order) ranked by its optimizer state bytes, largest first (ties in that order), taken while
    less than `offload_optimizer` of all the optimizer state bytes are: 1 takes all, 0 none."""
    ranked = [(_buffer_optimizer(buf, setup)[0], (id(p), i), b)
              for p, i in units for b, buf in enumerate(p.buffers)]
    target = setup.offload_optimizer * sum(r[0] for r in ranked)
    chosen, taken = {}, 0
    for state, key, b in sorted(ranked, key=lambda r: -r[0]):   # stable: ties keep order
        if taken >= target:
            break
        chosen.setdefault(key, set()).add(b)
        taken += state
    return chosen


def _units(root: Unit, others: list, setup: Setup, cache: PlanCache) -> tuple:
    """(root key or None, [keys in forward order], [planned units, the root first]); a key is
    (planned unit, instance)."""
    plans = {u.name: cache.plan(u, setup) for u in others}
    order = [(plans[u.name], i) for u, i in expand(others)]
    root_key = (cache.plan(root, setup), 0) if root.tensors else None
    return root_key, order, ([root_key[0]] if root_key else []) + list(plans.values())


def _offloaded(key, chosen) -> int:
    """Elements of rank 0's shards of `key` that are offloaded."""
    return sum(key[0].buffers[b].shard_size for b in chosen.get((id(key[0]), key[1]), ()))


def simulate_ours(root: Unit, others: list, setup: Setup, cache: PlanCache) -> dict:
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]
    root_key, order, planned = _units(root, others, setup, cache)
    root_plan = root_key[0] if root_key else None
    repeats = {id(p): p.unit.repeat for p in planned}
    units = ([root_key] if root_key else []) + order
    chosen = offloaded_buffers(units, setup) if setup.offload_optimizer else {}
    off = {(id(k[0]), k[1]): _offloaded(k, chosen) for k in units}
    tl = Timeline()
    optimizer_state = host_state = step_peak = host_step_peak = 0
    on_device = on_host = False
    for key in units:
        picked = chosen.get((id(key[0]), key[1]), set())
        if not picked:
            state, peak = _ours_optimizer(key[0], setup)
            optimizer_state += state
            step_peak = max(step_peak, peak)
            on_device = True
            continue
        for b, buf in enumerate(key[0].buffers):
            state, peak = _buffer_optimizer(buf, setup)
            if b in picked:
                host_state += state
                host_step_peak = max(host_step_peak, peak)
                on_host = True
            else:
                optimizer_state += state
                step_peak = max(step_peak, peak)
                on_device = True
    if setup.optimizer == "AdamW8bit":   # its lookup tables, once per process and device
        optimizer_state += ADAMW8BIT_TABLE_BYTES if on_device else 0
        host_state += ADAMW8BIT_TABLE_BYTES if on_host else 0
    offloaded = sum(off.values())
    # an offloaded buffer's master is on the host; the device keeps its compute-dtype shard
    # (none with offload_param); a buffer left on the device has no compute shard of its own:
    # the all-gather casts its master
    master = (sum(p.shard * repeats[id(p)] for p in planned) - offloaded) * MASTER_BYTES
    param_shard = 0 if setup.offload_param else offloaded * pb
    tl.alloc("master", master, "master")
    tl.alloc("param_shard", param_shard, "param")
    # hpZ: every unit but the root keeps 1/N of its full buffers (compute dtype) for life
    tl.alloc("hpz_secondary", sum(k[0].full for k in order) // setup.hpz * pb
             if setup.hpz > 1 else 0, "param")
    tl.alloc("optimizer", optimizer_state, "optimizer")

    def device_shard(key):  # an offloaded buffer's gradient shard is in host memory
        return key[0].shard - off[(id(key[0]), key[1])]

    for key in units:  # the previous step's gradient shards, released at the first forward
        tl.alloc(("grad", id(key[0]), key[1]), device_shard(key) * MASTER_BYTES, "grad")

    def full(key):
        return ("full", id(key[0]), key[1])

    def gather(key):
        """A unit's all-gather. Quantized weights arrive as 1 byte per element and the
        gathered scales, held until dequantized into the full buffer (before that unit
        computes, so one at a time); fp8_matmul keeps them as long as the full buffer."""
        p = key[0]
        payload = (p.full + 4 * p.groups * p.world
                   if setup.quantized_weights else 0)
        tl.free(("payload",))
        if setup.fp8_matmul:
            tl.alloc(full(key), p.full * pb + payload)
        else:
            tl.alloc(full(key), p.full * pb)
            tl.alloc(("payload",), payload)

    def reduce(key, accumulate):
        """fsdp post_backward: the reduce-scatter of `key`, its source freed one unit later."""
        p = key[0]
        if rb != pb:   # the reduce-scatter reads a cast copy: the full buffer goes at reshard
            tl.alloc(("cast",) + full(key)[1:], p.full * rb)
            tl.free(full(key))
        tl.alloc(("grad", id(p), key[1]), device_shard(key) * MASTER_BYTES, "grad")
        # the reduce-scatter output: staged for a shard that is added to or cast, and always
        # for an offloaded one (then cast to fp32 on the device before its copy to the host)
        staged = device_shard(key) if accumulate or rb != MASTER_BYTES else 0
        offloaded_here = off[(id(p), key[1])]
        tl.alloc(("out",) + full(key)[1:], (staged + offloaded_here) * rb +
                 (offloaded_here * MASTER_BYTES if rb != MASTER_BYTES else 0))

    def finish(key):
        for kind in ("full", "cast", "out"):
            tl.free((kind,) + full(key)[1:])

    def largest(p, names=None):
        return max((t.numel for t in p.unit.tensors if names is None or t.name in names),
                   default=0) * pb

    late = set(root.late)
    early_tied = [t for t in root.tensors if t.name not in late and t.uses > 1]
    for micro in range(setup.grad_accum):
        accumulate = micro > 0
        if micro == 0:
            for key in units:
                tl.free(("grad", id(key[0]), key[1]))
        # forward: the root first (kept to the end of backward), each unit prefetching the next
        if root_plan:
            gather((root_plan, 0))
        if order:
            gather(order[0])
        for k, key in enumerate(order):
            if k + 1 < len(order):
                gather(order[k + 1])
            if setup.reshard_after_forward and k + 1 < len(order):
                tl.free(full(key))
        # backward: the head's gradients, then each unit with the one before it prefetched and
        # the one after it still reducing
        if root_plan:
            tl.spike(largest(root_plan, late))
            for t in early_tied:   # the head's use of a tied weight: held until the embedding's
                tl.alloc(("tied", t.name), t.numel * pb)
        reducing = None
        for k in range(len(order) - 1, -1, -1):
            key = order[k]
            if k > 0:
                gather(order[k - 1])
            tl.spike(largest(key[0]))
            if reducing:
                finish(reducing)
            reduce(key, accumulate)
            reducing = key
        if root_plan:
            early = [t.numel for t in root.tensors if t.name not in late and t.uses == 1]
            tl.spike(max(early, default=0) * pb)
            for t in early_tied:   # the embedding's gradient, and its sum with the held one
                tl.alloc(("tied", "new", t.name), t.numel * pb)
                tl.spike(t.numel * pb)
                tl.free(("tied", "new", t.name))
                tl.free(("tied", t.name))
            if reducing:
                finish(reducing)
            reduce((root_plan, 0), accumulate)
            reducing = (root_plan, 0)
        if reducing:
            finish(reducing)
        tl.free(("payload",))
    tl.phase = "optimizer_step"
    tl.spike(step_peak)
    padding = {}   # padded elements of all ranks, by shard group size
    for p in planned:
        padding[p.world] = padding.get(p.world, 0) + (p.full - p.numel) * repeats[id(p)]
    result = tl.summary(master, sum(pad / M for M, pad in padding.items()) * MASTER_BYTES,
                        sum(padding.values()) / max(1, sum(p.numel * repeats[id(p)]
                                                           for p in planned)))
    if setup.offloads:
        # host "param": the compute shard (offload_param) or the staging tensor its refresh
        # casts into, in the buffer's allocation; neither with fp32 compute (the master serves)
        host = {"master": offloaded * MASTER_BYTES, "grad": offloaded * MASTER_BYTES,
                "optimizer": host_state, "param": offloaded * pb if pb != MASTER_BYTES else 0,
                "optimizer_step_peak": host_step_peak}
        result.update(param_shard=param_shard, offloaded_ratio=host_state / max(
            1, host_state + optimizer_state), host={**host, "total": sum(host.values())})
    return result


def traffic(root: Unit, others: list, setup: Setup, cache: PlanCache) -> dict:
    """Ours, per rank per optimizer step: `all_gather` is what each rank receives ((M-1) of M
    shards of every gathered buffer, in the param dtype), `reduce_scatter` what it sends ((M-1)
    shards of every reduced buffer, in the reduce dtype); a unit is gathered in forward and
    again in backward when it is resharded after forward (not the root, nor the last unit,
    which backward starts with); `all_reduce` (HSDP) what a ring all-reduce of the gradient
    shard over the replicas sends. Gradient accumulation repeats all of it per micro-step.
    Each unit's collectives run over its own shard group (experts: efsdp)."""
    plans = {u.name: cache.plan(u, setup) for u in others}
    order = [plans[u.name] for u, _ in expand(others)]
    # shard group size -> [gathered, reduced, their quantization groups, hpZ's full elements]
    by_group = {}
    units = ([(cache.plan(root, setup), 1)] if root.tensors else []) + \
        [(p, 2 if setup.reshard_after_forward and k + 1 < len(order) else 1)
         for k, p in enumerate(order)]
    for p, gathers in units:
        moved = by_group.setdefault(p.world, [0, 0, 0, 0, 0])
        in_group = gathers == 2 and setup.hpz > 1  # backward's gather: from the copies
        over_all = 1 if in_group else gathers
        moved[0] += over_all * p.shard
        moved[1] += p.shard
        moved[2] += over_all * p.groups
        moved[3] += p.groups
        moved[4] += p.full if in_group else 0
    out = add_traffic(setup.traffic(0, 0), *(
        setup.traffic(g, r, M, (gg, rg) if setup.quantized else None, h)
        for M, (g, r, gg, rg, h) in sorted(by_group.items())))
    M = setup.shard_size  # each forward's check that every rank ran the same units: a ring
    if M > 1:             # all-reduce of two int64 over the root's shard group (fsdp/unit.py)
        out["all_reduce"] += setup.grad_accum * 2 * (M - 1) * UNITS_CHECK_BYTES // M
    return out


def pcie(root: Unit, others: list, setup: Setup, cache: PlanCache) -> dict:
    """Ours with offload, bytes per rank per optimizer step across host<->device, as
    optim/offload.py moves them (and counts them in its stats, once the first step has filled
    the compute shards): `device_to_host` each offloaded buffer's fp32 gradient shard once per
    reduction (every micro-step, as each unit finishes reducing), `host_to_device` its compute
    shard: once after the step, or with offload_param at each of
    its all-gathers (as `traffic` counts them: the root and the last unit once per micro-step,
    the others twice when resharded after forward)."""
    root_key, order, _ = _units(root, others, setup, cache)
    units = ([root_key] if root_key else []) + order
    chosen = offloaded_buffers(units, setup) if setup.offload_optimizer else {}
    pb = DTYPE_BYTES[setup.param_dtype]
    back = down = 0
    for key in units:
        elements = _offloaded(key, chosen)
        down += setup.grad_accum * elements * MASTER_BYTES
        gathers = 1
        if setup.offload_param:
            resharded = key is not root_key and setup.reshard_after_forward and \
                key is not order[-1]
            gathers = setup.grad_accum * (2 if resharded else 1)
        back += gathers * elements * pb
    return {"host_to_device": back, "device_to_host": down}
