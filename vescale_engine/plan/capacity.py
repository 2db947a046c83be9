"""Capacity planning: per-rank memory and traffic of one training step, from a shapes file,
for our engine, PyTorch FSDP2 and DeepSpeed ZeRO-3 side by side (`vescale plan --memory`).

Ours and FSDP2 are *simulated*: one optimizer step (its gradient-accumulation micro-steps, then
the optimizer) is replayed as the sequence of allocations and frees their code makes, unit by
unit, and the largest sum of live bytes is the peak. Every term is what the code allocates:

- ours (fsdp.py, dbuffer.py, optim/): per DBuffer the fp32 master shard (S elements) and, from
  the first reduce-scatter of a step until the next step's first forward, the fp32 gradient
  shard; the full buffer (W x S in the compute dtype) from a unit's all-gather until its
  reduce-scatter has been waited for, which happens in the *next* unit's post-backward (so three
  full buffers are live in backward: the one reducing, the one computing, the one prefetched),
  gradients written in place over it; the gradient autograd makes for one tensor before it is
  added into that buffer; with a reduce dtype other than the compute dtype, the cast copy the
  reduce-scatter reads instead (the full buffer is freed once cast) and the staging shard; the
  root unit gathered from the first forward to the end of backward.
- FSDP2 (torch/distributed/fsdp/_fully_shard/): each parameter sharded on dim 0, padded to a
  multiple of W; the all-gather output, then the unsharded parameters it is copied out into
  (both W x padded), the output kept in forward until the next unit's copy-out; autograd's
  unsharded gradients, kept until the unit's reduce-scatter copies them into its input buffer,
  which lives until the next unit's reduce-scatter; the root's gradients kept to the end.
- ZeRO-3 (deepspeed/runtime/zero/stage3.py) is estimated, not simulated: flat partitions of
  ceil(numel / W) per parameter in the parameter dtype, the fp32 master and gradient partitions,
  the optimizer state, the reduce bucket, and the gathered parameters DeepSpeed's default
  prefetch, reuse-distance and live-parameter limits allow.

Activations (and the memory a collective library uses internally) are excluded: the output
says so. Pure Python: no torch, so the command starts at once.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .granularity import parse_granularity
from .model_plan import DTYPE_BYTES, ModelShapes, ShapesError
from .optim_spec import (ADAMW8BIT_BLOCK, MUON_ROUNDS_IN_FLIGHT, OPTIMIZERS, QUANT_CHUNK_ELEMENTS,
                         is_muon_matrix)
from .planner import DEFAULT_ALIGN_BYTES, DEFAULT_MAX_BUFFERS, TensorSpec, plan_unit

MASTER_BYTES = 4             # master weights, gradient shards and optimizer moments are fp32
ACTIVATIONS_NOTE = "activations excluded"
# AdamW8bit's step, per element of the largest chunk it works on at a time (quantize.py), at
# its peak while quantizing a moment again: both moments restored to fp32 (8 B), the normalized
# values (4), the int32 keys (4), and the lookup `below[key]`: the int64 copy of the keys that
# indexing makes (8) and its int32 result (4). (Measured: benchmarks/capacity_check.py.)
ADAMW8BIT_STEP_BYTES_PER_ELEMENT = 28
# ... and once per process and device, its lookup tables: for the signed and the unsigned code
# table, the midpoint count below each of the 2^17 float keys (int32), and the small tables
# (codes, midpoints) of at most 256 fp32 entries each.
ADAMW8BIT_TABLE_BYTES = 2 * ((1 << 17) * 4 + 3 * 256 * 4)
# DeepSpeed ZeRO-3's defaults (deepspeed/runtime/zero/config.py): elements.
ZERO3_DEFAULTS = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                  "max_live_parameters": 1_000_000_000, "max_reuse_distance": 1_000_000_000,
                  "param_persistence_threshold": 100_000, "sub_group_size": 1_000_000_000}


class CapacityError(ValueError):
    """A capacity request that cannot be estimated; the message names the problem."""


@dataclass(frozen=True)
class Setup:
    """What is being estimated: everything but the model."""
    world_size: int
    optimizer: str = "AdamW"
    param_dtype: str = "bf16"          # compute and all-gather dtype
    reduce_dtype: str | None = None    # gradient reduction dtype (None: the param dtype)
    grad_accum: int = 1                # micro-steps per optimizer step
    hsdp: int = 1                      # replicate size: shard over world_size / hsdp ranks
    reshard_after_forward: bool = True
    granularity: str = "rows:1"
    align_bytes: int = DEFAULT_ALIGN_BYTES
    max_buffers: int = DEFAULT_MAX_BUFFERS
    root: tuple | None = None          # groups the root unit owns (None: see default_root)

    @property
    def shard_size(self) -> int:
        return self.world_size // self.hsdp

    @property
    def reduce(self) -> str:
        return self.reduce_dtype or self.param_dtype


def check_setup(setup: Setup, model: ModelShapes | None = None) -> None:
    """Raise CapacityError (one line) for anything that cannot be estimated."""
    if setup.optimizer not in OPTIMIZERS:
        raise CapacityError(f"unknown optimizer {setup.optimizer!r} (expected one of "
                            f"{', '.join(OPTIMIZERS)})")
    for what, dtype in (("param", setup.param_dtype), ("reduce", setup.reduce)):
        if dtype not in DTYPE_BYTES:
            raise CapacityError(f"unknown {what} dtype {dtype!r} (expected one of "
                                f"{', '.join(DTYPE_BYTES)})")
    for what, value in (("world size", setup.world_size), ("gradient accumulation",
                                                          setup.grad_accum),
                        ("HSDP replicate size", setup.hsdp)):
        if not isinstance(value, int) or value < 1:
            raise CapacityError(f"{what} must be a positive integer, got {value!r}")
    if setup.world_size % setup.hsdp:
        raise CapacityError(f"HSDP replicate size {setup.hsdp} does not divide the world size "
                            f"{setup.world_size}")
    try:
        parse_granularity(setup.granularity)
    except ValueError as err:
        raise CapacityError(str(err)) from None
    if model is not None and setup.root is not None:
        names = [g.name for g in model.groups]
        unknown = [r for r in setup.root if r not in names]
        if unknown:
            raise CapacityError(f"root group {unknown[0]!r} is not a group of {model.path} "
                                f"(groups: {', '.join(names)})")
        repeated = [g.name for g in model.groups if g.name in setup.root and g.repeat > 1]
        if repeated:
            raise CapacityError(f"root group {repeated[0]!r} repeats: a repeated group is one "
                                "unit per repeat, not part of the root")


# --------------------------------------------------------------------------------------------
# Units: the root (gathered from the first forward to the end of backward) and the others.

@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple
    uses: int = 1      # how often forward uses it (a tied embedding: 2)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    name: str
    tensors: tuple
    repeat: int = 1
    late: tuple = ()   # root only: tensors whose gradients come first in backward (the head)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def default_root(model: ModelShapes) -> tuple:
    """The groups the root owns when the user names none: the non-repeated groups before the
    first repeated one and after the last (embeddings, final norm and head), as wrapping a
    Hugging Face model's decoder layers leaves them; every group if none repeats."""
    groups = model.groups
    repeated = [i for i, g in enumerate(groups) if g.repeat > 1]
    if not repeated:
        return tuple(g.name for g in groups)
    return tuple(g.name for i, g in enumerate(groups)
                 if (i < repeated[0] or i > repeated[-1]) and g.repeat == 1)


def tensor_uses(path: str) -> dict:
    """{(group, tensor): uses} for tensors with a "uses" count in the shapes file (an optional
    key: a tied embedding, used by the embedding and the output head, says 2)."""
    with open(path) as f:
        data = json.load(f)
    uses = {}
    for group in data.get("groups", []):
        for tensor in group.get("tensors", []):
            count = tensor.get("uses", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ShapesError(f"{path}: group {group.get('name')!r}, tensor "
                                  f"{tensor.get('name')!r}: 'uses' must be a positive integer")
            if count != 1:
                uses[(group.get("name"), tensor.get("name"))] = count
    return uses


def model_units(model: ModelShapes, root: tuple, uses: dict) -> tuple:
    """(root unit, [other units in forward order])."""
    first_other = next((i for i, g in enumerate(model.groups) if g.name not in root), None)
    root_tensors, late, others = [], [], []
    for i, group in enumerate(model.groups):
        tensors = [Tensor(name, shape, uses.get((group.name, name), 1))
                   for name, shape in group.tensors]
        if group.name in root:
            qualified = [Tensor(f"{group.name}.{t.name}", t.shape, t.uses) for t in tensors]
            root_tensors += qualified
            if first_other is None or i > first_other:
                late += [t.name for t in qualified]
        else:
            others.append(Unit(group.name, tuple(tensors), group.repeat))
    return Unit("root", tuple(root_tensors), 1, tuple(late)), others


# --------------------------------------------------------------------------------------------
# The timeline both simulations run on.

class _Timeline:
    """Live bytes by name and kind; the peak of everything and of the transient part."""

    PERSISTENT = ("master", "grad", "optimizer")

    def __init__(self):
        self.live = {}
        self.total = 0
        self.peak = 0
        self.transient = 0
        self.peak_transient = {"forward_backward": 0, "optimizer_step": 0}
        self.phase = "forward_backward"
        self.at_peak = {}

    def alloc(self, key, nbytes: int, kind: str = "transient") -> None:
        if key in self.live or nbytes <= 0:
            return
        self.live[key] = (nbytes, kind)
        self.total += nbytes
        if kind not in self.PERSISTENT:
            self.transient += nbytes
            self.peak_transient[self.phase] = max(self.peak_transient[self.phase],
                                                  self.transient)
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = {"phase": self.phase}

    def free(self, key) -> None:
        if key in self.live:
            nbytes, kind = self.live.pop(key)
            self.total -= nbytes
            if kind not in self.PERSISTENT:
                self.transient -= nbytes

    def spike(self, nbytes: int) -> None:
        """A temporary that is made and dropped before anything else happens."""
        self.alloc(("spike",), nbytes)
        self.free(("spike",))

    def bytes_of(self, kind: str) -> int:
        return sum(n for n, k in self.live.values() if k == kind)


def _expand(units) -> list:
    """Forward order with repeats expanded: [(unit, instance index)]."""
    return [(u, i) for u in units for i in range(u.repeat)]


# --------------------------------------------------------------------------------------------
# Ours.

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
    order = [(plans[u.name], i) for u, i in _expand(others)]
    root_plan = cache.plan(root, setup) if root.tensors else None
    planned = ([root_plan] if root_plan else []) + list(plans.values())
    repeats = {id(p): p.unit.repeat for p in planned}
    tl = _Timeline()
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
    return _result(tl, master, padding / M * MASTER_BYTES,
                   padding / max(1, sum(p.numel * repeats[id(p)] for p in planned)))


def _result(tl: _Timeline, master: int, padding_bytes: float, padding_ratio: float) -> dict:
    grad = sum(n for key, (n, k) in tl.live.items() if k == "grad")
    optimizer = tl.bytes_of("optimizer")
    return {"master": int(master), "grad": int(grad), "optimizer": int(optimizer),
            "gathered_peak": int(tl.peak_transient["forward_backward"]),
            "optimizer_step_peak": int(tl.peak_transient["optimizer_step"]),
            "total": int(tl.peak), "peak_phase": tl.at_peak.get("phase"),
            "padding": int(round(padding_bytes)), "padding_ratio": padding_ratio}


# --------------------------------------------------------------------------------------------
# PyTorch FSDP2.

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
    tl = _Timeline()
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
    order = _expand(others)
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
    return _result(tl, master, padding / M * MASTER_BYTES, padding / max(1, numel))


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


# --------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 (estimate from its allocation sites and default limits).

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
    for u, _ in reversed(_expand(others)):
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


# --------------------------------------------------------------------------------------------
# Traffic: bytes each rank moves per optimizer step.

def traffic(root: Unit, others: list, setup: Setup, cache: PlanCache) -> dict:
    """Ours, per rank per optimizer step: `all_gather` is what each rank receives ((M-1) of M
    shards of every gathered buffer, in the param dtype), `reduce_scatter` what it sends ((M-1)
    shards of every reduced buffer, in the reduce dtype); a unit is gathered in forward and
    again in backward when it is resharded after forward (not the root, nor the last unit,
    which backward starts with); `all_reduce` (HSDP) what a ring all-reduce of the gradient
    shard over the replicas sends. Gradient accumulation repeats all of it per micro-step."""
    M, R = setup.shard_size, setup.hsdp
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]
    plans = {u.name: cache.plan(u, setup) for u in others}
    order = [plans[u.name] for u, _ in _expand(others)]
    gathered = reduced = 0
    units = ([(cache.plan(root, setup), 1)] if root.tensors else []) + \
        [(p, 2 if setup.reshard_after_forward and k + 1 < len(order) else 1)
         for k, p in enumerate(order)]
    for p, gathers in units:
        gathered += gathers * p.shard
        reduced += p.shard
    n = setup.grad_accum
    return {"all_gather": n * (M - 1) * gathered * pb,
            "reduce_scatter": n * (M - 1) * reduced * rb,
            "all_reduce": n * (2 * (R - 1) * reduced * rb // R if R > 1 else 0)}


def traffic_fsdp2(root: Unit, others: list, setup: Setup) -> dict:
    """FSDP2: every unit gathered in forward, the non-root ones again in backward when resharded
    (the last one too), W x the dim-0 padded shard; one reduce-scatter per unit."""
    M, R = setup.shard_size, setup.hsdp
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]
    gathered = reduced = 0
    for unit, is_root in ([(root, True)] if root.tensors else []) + [(u, False) for u in others]:
        shard = sum(_dim0_shard(t.shape, M) for t in unit.tensors) * unit.repeat
        gathered += shard * (2 if setup.reshard_after_forward and not is_root else 1)
        reduced += shard
    n = setup.grad_accum
    return {"all_gather": n * (M - 1) * gathered * pb,
            "reduce_scatter": n * (M - 1) * reduced * rb,
            "all_reduce": n * (2 * (R - 1) * reduced * rb // R if R > 1 else 0)}


def traffic_zero3(root: Unit, others: list, setup: Setup) -> dict:
    """ZeRO-3: every parameter above the persistence threshold gathered in forward and, unless
    the reuse distance keeps it, again in backward; every gradient reduce-scattered, per
    micro-step; flat partitions of ceil(numel / W)."""
    M = setup.shard_size
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce]
    d = ZERO3_DEFAULTS
    gathered = reduced = kept = later = 0
    for u, _ in reversed(_expand(others)):
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
    n, R = setup.grad_accum, setup.hsdp
    return {"all_gather": n * (M - 1) * gathered * pb,
            "reduce_scatter": n * (M - 1) * reduced * rb,
            "all_reduce": n * (2 * (R - 1) * reduced * rb // R if R > 1 else 0)}


# --------------------------------------------------------------------------------------------
# The whole estimate.

def estimate(model: ModelShapes, setup: Setup, uses: dict | None = None,
             cache: PlanCache | None = None, device_memory_gb: float | None = None) -> dict:
    """{"memory": {ours, fsdp2, zero3}, "traffic": {...}, ...} in bytes per rank. With
    `device_memory_gb`, each system also gets `headroom`: what its peak leaves of the device."""
    check_setup(setup, model)
    root_groups = setup.root if setup.root is not None else default_root(model)
    uses = tensor_uses(model.path) if uses is None else uses
    root, others = model_units(model, root_groups, uses)
    cache = cache or PlanCache()
    memory = {"ours": simulate_ours(root, others, setup, cache),
              "fsdp2": simulate_fsdp2(root, others, setup),
              "zero3": estimate_zero3(root, others, setup)}
    if device_memory_gb is not None:
        for system in memory.values():
            system["headroom"] = int(device_memory_gb * 1e9) - system["total"]
    return {
        "memory": memory,
        "traffic": {**traffic(root, others, setup, cache),
                    "fsdp2": traffic_fsdp2(root, others, setup),
                    "zero3": traffic_zero3(root, others, setup)},
        "setup": {"world_size": setup.world_size, "shard_group_size": setup.shard_size,
                  "hsdp": setup.hsdp, "optimizer": setup.optimizer,
                  "param_dtype": setup.param_dtype, "reduce_dtype": setup.reduce,
                  "grad_accum": setup.grad_accum,
                  "reshard_after_forward": setup.reshard_after_forward,
                  "granularity": ADAMW8BIT_BLOCK if setup.optimizer == "AdamW8bit"
                  else str(parse_granularity(setup.granularity)),
                  "root": list(root_groups), "activations": "excluded"},
        "activations": ACTIVATIONS_NOTE,
    }
