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
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..granularity import parse_granularity
from ..model_plan import DTYPE_BYTES
from ..optim_spec import (ADAMW8BIT_BLOCK, MUON_ROUNDS_IN_FLIGHT, QUANT_CHUNK_ELEMENTS,
                          is_muon_matrix)
from ..planner import TensorSpec, plan_unit
from .request import MASTER_BYTES, CapacityError, Setup
from .timeline import Timeline
from .units import Unit, expand

__all__ = ["ADAMW8BIT_STEP_BYTES_PER_ELEMENT", "ADAMW8BIT_TABLE_BYTES", "PlanCache",
           "simulate_ours", "traffic"]

# AdamW8bit's step, per element of the largest chunk it works on at a time (quantize.py), at
# its peak while quantizing a moment again: both moments restored to fp32 (8 B), the normalized
# values (4), the int32 keys (4), and the lookup `below[key]`: the int64 copy of the keys that
# indexing makes (8) and its int32 result (4). (Measured: benchmarks/capacity_check.py.)
ADAMW8BIT_STEP_BYTES_PER_ELEMENT = 28
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


class PlanCache:
    def __init__(self):
        self.plans = {}

    def plan(self, unit: Unit, setup: Setup) -> _Planned:
        granularity = parse_granularity(ADAMW8BIT_BLOCK if setup.optimizer == "AdamW8bit"
                                        else setup.granularity)
        itemsize = min(MASTER_BYTES, DTYPE_BYTES[setup.param_dtype])
        align = max(1, setup.align_bytes // itemsize)   # fully_shard's alignment rule
        try:
            specs = tuple(TensorSpec(t.name, t.shape, granularity.block_size(t.shape))
                          for t in unit.tensors)
        except ValueError as err:
            raise CapacityError(f"unit {unit.name!r}: {err}") from None
        key = (specs, setup.shard_size, align, setup.max_buffers)
        if key not in self.plans:
            self.plans[key] = plan_unit(list(specs), setup.shard_size, align, setup.max_buffers)
        layout = self.plans[key]
        rank0 = {}
        for buf in layout.buffers:
            for p in buf.placements:
                rank0[p.name] = max(0, min(p.offset + p.numel, buf.shard_size) - p.offset) \
                    if p.offset < buf.shard_size else 0
        shard = sum(b.shard_size for b in layout.buffers)
        return _Planned(unit, shard, shard * setup.shard_size, unit.numel, list(layout.buffers),
                        rank0)


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


def _ours_optimizer(planned: _Planned, setup: Setup) -> tuple:
    """(state bytes, step transient bytes) of the optimizer for one unit instance on rank 0."""
    S = planned.shard
    if setup.optimizer == "AdamW":   # two fp32 moments per buffer, a 0-d step; fused step
        return 2 * MASTER_BYTES * S + 4 * len(planned.buffers), 0
    if setup.optimizer == "AdamW8bit":
        state = peak = 0
        for buf in planned.buffers:
            segments = _segments_rank0(buf)
            # int8 + uint8 codes, two fp32 scales and one int64 length per segment, the step
            state += 2 * buf.shard_size + 2 * 4 * segments + 8 * segments + 4
            peak = max(peak, ADAMW8BIT_STEP_BYTES_PER_ELEMENT *
                       min(buf.shard_size, QUANT_CHUNK_ELEMENTS))
        return state, peak
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


def simulate_ours(root: Unit, others: list, setup: Setup, cache: PlanCache) -> dict:
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]
    M = setup.shard_size
    plans = {u.name: cache.plan(u, setup) for u in others}
    order = [(plans[u.name], i) for u, i in expand(others)]
    root_plan = cache.plan(root, setup) if root.tensors else None
    planned = ([root_plan] if root_plan else []) + list(plans.values())
    repeats = {id(p): p.unit.repeat for p in planned}
    tl = Timeline()
    optimizer_state = ADAMW8BIT_TABLE_BYTES if setup.optimizer == "AdamW8bit" else 0
    step_peak = 0
    for p in planned:
        state, peak = _ours_optimizer(p, setup)
        optimizer_state += state * repeats[id(p)]
        step_peak = max(step_peak, peak)
    master = sum(p.shard * repeats[id(p)] for p in planned) * MASTER_BYTES
    tl.alloc("master", master, "master")
    tl.alloc("optimizer", optimizer_state, "optimizer")
    units = ([(root_plan, 0)] if root_plan else []) + order
    for key in units:  # the previous step's gradient shards, released at the first forward
        tl.alloc(("grad", id(key[0]), key[1]), key[0].shard * MASTER_BYTES, "grad")

    def full(key):
        return ("full", id(key[0]), key[1])

    def gather(key):
        tl.alloc(full(key), key[0].full * pb)

    def reduce(key, accumulate):
        """fsdp post_backward: the reduce-scatter of `key`, its source freed one unit later."""
        p = key[0]
        if rb != pb:   # the reduce-scatter reads a cast copy: the full buffer goes at reshard
            tl.alloc(("cast",) + full(key)[1:], p.full * rb)
            tl.free(full(key))
        tl.alloc(("grad", id(p), key[1]), p.shard * MASTER_BYTES, "grad")
        if accumulate or rb != MASTER_BYTES:
            tl.alloc(("out",) + full(key)[1:], p.shard * rb)

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
    tl.phase = "optimizer_step"
    tl.spike(step_peak)
    padding = sum((p.full - p.numel) * repeats[id(p)] for p in planned)
    return tl.summary(master, padding / M * MASTER_BYTES,
                      padding / max(1, sum(p.numel * repeats[id(p)] for p in planned)))


def traffic(root: Unit, others: list, setup: Setup, cache: PlanCache) -> dict:
    """Ours, per rank per optimizer step: `all_gather` is what each rank receives ((M-1) of M
    shards of every gathered buffer, in the param dtype), `reduce_scatter` what it sends ((M-1)
    shards of every reduced buffer, in the reduce dtype); a unit is gathered in forward and
    again in backward when it is resharded after forward (not the root, nor the last unit,
    which backward starts with); `all_reduce` (HSDP) what a ring all-reduce of the gradient
    shard over the replicas sends. Gradient accumulation repeats all of it per micro-step."""
    plans = {u.name: cache.plan(u, setup) for u in others}
    order = [plans[u.name] for u, _ in expand(others)]
    gathered = reduced = 0
    units = ([(cache.plan(root, setup), 1)] if root.tensors else []) + \
        [(p, 2 if setup.reshard_after_forward and k + 1 < len(order) else 1)
         for k, p in enumerate(order)]
    for p, gathers in units:
        gathered += gathers * p.shard
        reduced += p.shard
    return setup.traffic(gathered, reduced)
