"""Layout planner: lay the tensors of one FSDP unit into flat buffers of equal per-rank shards.

Problem (PAPER.md, "Planning problem"): place every tensor contiguously in a buffer of
`world_size * S` elements so that each shard boundary `k * S` that falls inside a tensor falls on
one of its block edges, and minimise the padding `world_size * S - sum(numel)`. It is NP-hard; we
solve it with a fast heuristic built from three observations:

1. For a fixed order and a fixed S, placing each tensor at its earliest feasible offset is optimal
   (feasible offsets only shrink as the start moves right), and that offset is O(1) arithmetic.
2. Any S can be tested in O(#tensors) that way. Runs of identical tensors whose size is a multiple
   of their block are placed as one item, so a layer of 256 experts costs a few items, not 768.
3. A tensor longer than 2S contains two boundaries, which forces S to be a multiple of its block:
   large tensors with different row lengths couple through the lcm of their blocks (the "lcm
   trap"). Splitting the unit into a few buffers, each with its own S, removes the coupling.

Pure Python: no torch, no torch.distributed, no modules.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

DEFAULT_ALIGN_BYTES = 16
DEFAULT_MAX_BUFFERS = 4
DEFAULT_SPLIT_GAIN = 0.0  # fraction of a unit's elements a split must save (0: any saving)
_SEARCH_EVALS = 48
_SWAP_TENSORS = 12  # buffers of at most this many tensors get a swap search over their order  # placement passes per (order, search start): bounds planning time


class PlanError(ValueError):
    """A plan (or its input) breaks an invariant."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place: its name, shape and atomic block size in elements."""
    name: str
    shape: tuple
    block: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Placement:
    """Where a tensor lives in a buffer, and which ranks hold how many of its blocks."""
    spec: TensorSpec
    offset: int
    first_rank: int   # the first rank holding any of its blocks
    units: tuple      # blocks held by first_rank, first_rank + 1, ... (ranks after: none)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def numel(self) -> int:
        return self.spec.numel

    @property
    def block(self) -> int:
        return self.spec.block

    def local_units(self, world_size: int) -> list:
        """Blocks per rank, one integer for every rank (zeros for ranks that hold none)."""
        full = [0] * world_size
        full[self.first_rank:self.first_rank + len(self.units)] = self.units
        return full


@dataclass(frozen=True)
class BufferLayout:
    """One flat buffer: `world_size` shards of `shard_size` elements each."""
    world_size: int
    shard_size: int
    align: int                 # elements; shard size and every offset are multiples of it
    placements: tuple

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.placements)

    @property
    def padding(self) -> int:
        return self.world_size * self.shard_size - self.numel


@dataclass(frozen=True)
class UnitPlan:
    """The layout of one FSDP unit: one or more buffers."""
    world_size: int
    buffers: tuple
    plan_seconds: float = field(default=0.0, compare=False)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    @property
    def padding(self) -> int:
        return sum(b.padding for b in self.buffers)

    @property
    def padding_ratio(self) -> float:
        return self.padding / max(1, self.numel)


# --------------------------------------------------------------------------------------------
# Placement of one ordered item list at a given shard size S.

def _earliest_offset(p: int, n: int, g: int, S: int, step: int) -> int | None:
    """Earliest offset >= p (p, S multiples of the alignment) where a tensor of n elements with
    blocks of g has every shard boundary inside it on a block edge; None if there is none.

    `step` is lcm(g, alignment): the offsets that put a block edge on a boundary B are B - j*step.
    """
    first = (p // S + 1) * S                    # first boundary after p
    if p + n <= first:
        return p                                # fits in the current shard
    many = S % g == 0                           # then every later boundary is on an edge too
    j = (first - p) // step                     # straddle `first` as early as possible
    if j >= 1 and (many or j * step >= n - S):
        return first - j * step
    if n <= S or many:
        return first                            # start right on the boundary
    j = S // step                               # straddle the next boundary once, from inside
    if j >= 1 and j * step >= n - S:
        return first + S - j * step
    return None                                 # needs two boundaries but S is not a multiple of g


def _place(runs, S: int, align: int, offsets: list | None = None):
    """Greedy earliest placement of runs [(numel, block, count)] in order; returns the end of
    the last tensor (None if some tensor cannot be placed) and appends each tensor's offset to
    `offsets` when given. A run of tensors longer than 2S that tile their blocks exactly is
    placed in one step: each must start on a block edge, so back to back is what the greedy
    would do one by one."""
    p = 0
    for n, g, count in runs:
        step = math.lcm(g, align)
        together = count if n > 2 * S and n % step == 0 else 1
        for _ in range(count // together):
            p = -(-p // align) * align
            off = _earliest_offset(p, n * together, g, S, step)
            if off is None:
                return None
            if offsets is not None:
                offsets.extend(off + i * n for i in range(together))
            p = off + n * together
    return p


# --------------------------------------------------------------------------------------------
# Search for the smallest feasible S for one order.

def _forced_multiple(items, S: int, align: int) -> int:
    """S must be a multiple of the block of every item longer than 2S (and of the alignment)."""
    m = align
    for n, g, _ in items:
        if n > 2 * S and g > 1:
            m = math.lcm(m, g)
    return m


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _min_shard_from(items, world_size: int, align: int, start: int, evals: int):
    """Walk S upward from `start`, jumping by the shortfall, until the items fit in
    world_size * S; returns S, or None when the evaluation budget runs out."""
    S = _round_up(max(start, align), align)
    prev_bad = None
    for _ in range(evals):
        S = _round_up(S, _forced_multiple(items, S, align))
        end = _place(items, S, align)
        if end is not None and end <= world_size * S:
            return _refine_down(items, world_size, align, prev_bad, S)
        prev_bad = S
        if end is None:   # some tensor fits no shard boundary pattern: grow S geometrically
            S += _round_up(max(1, S // 16), align)
        else:             # jump by the shortfall spread over the ranks
            S += max(align, _round_up(-(-(end - world_size * S) // world_size), align))
    return None


def _refine_down(items, world_size, align, bad, good):
    """The shortfall jump may overshoot: bisect (bad, good] for a smaller feasible S."""
    if bad is None:
        return good
    lo, hi = bad // align, good // align     # in units of the alignment; lo is infeasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        S = _round_up(mid * align, _forced_multiple(items, mid * align, align))
        end = _place(items, S, align) if S < good else None
        if end is not None and end <= world_size * S:
            hi, good = S // align, S
        else:
            lo = mid
    return good


def _min_shard(items, world_size: int, align: int) -> int:
    """Smallest S found for this order: the shortfall walk from the lower bound, and from the
    lcm-aligned candidates that make large tensors tile the shards exactly (paper: lcm of block
    sizes of prefixes by size)."""
    total = sum(n * count for n, _, count in items)
    lower = _round_up(max(1, -(-total // world_size)), align)
    best = _min_shard_from(items, world_size, align, lower, _SEARCH_EVALS)
    multiple = align
    for n, g, _ in sorted(items, reverse=True):
        if n <= lower or (best is not None and multiple >= best):
            break
        multiple = math.lcm(multiple, g)
        start = _round_up(lower, multiple)
        if best is None or start < best:
            found = _min_shard_from(items, world_size, align, start, 4)
            if found is not None and (best is None or found < best):
                best = found
    if best is None:  # S a multiple of every block: each tensor then fits at an aligned offset
        multiple = math.lcm(align, *(g for _, g, _ in items))
        room = sum(count * (n + math.lcm(g, align)) for n, g, count in items)
        best = _min_shard_from(items, world_size, align,
                               _round_up(-(-room // world_size), multiple), 1)
    return best


# --------------------------------------------------------------------------------------------
# Orders, run compression, and the buffer split.

def _runs(specs):
    """Group consecutive identical tensors (same shape and block) into runs (numel, block,
    count) with their members, so that the placement can handle them in one step."""
    runs, members = [], []
    for spec in specs:
        if members and members[-1][-1].shape == spec.shape and members[-1][-1].block == spec.block:
            runs[-1][2] += 1
            members[-1].append(spec)
        else:
            runs.append([spec.numel, spec.block, 1])
            members.append([spec])
    return [tuple(r) for r in runs], [m for run in members for m in run]


def _orders(specs, quick=False):
    if not quick:
        yield list(specs)                                                    # module order
    yield sorted(specs, key=lambda s: (-s.block, -s.numel, s.shape))         # by block size
    yield sorted(specs, key=lambda s: (-s.numel, -s.block, s.shape))         # by size


def _search(specs, world_size, align, quick=False):
    """Best (S, runs, members) over the candidate orders, without building placements.
    `quick` skips module order: the sorted orders group identical tensors into few runs."""
    best = None
    for order in _orders(specs, quick):
        runs, members = _runs(order)
        S = _min_shard(runs, world_size, align)
        if S is not None and (best is None or S < best[0]):
            best = (S, runs, members)
    if best is None:
        raise PlanError("no feasible layout found for tensors "
                        + ", ".join(s.name for s in specs))
    return _swap_runs(best, world_size, align)


def _swap_runs(best, world_size, align):
    """Local search on the order of a few runs: swap two runs while that shrinks S. Which tensor
    straddles each shard boundary decides the padding, and the sorted orders can miss it."""
    S, runs, members = best
    if len(members) > _SWAP_TENSORS:
        return best
    groups = []
    for n, _, count in runs:
        groups.append(members[sum(len(g) for g in groups):][:count])
    improved = True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(len(runs)), 2):
            order = list(range(len(runs)))
            order[i], order[j] = j, i
            candidate = [runs[k] for k in order]
            found = _min_shard(candidate, world_size, align)
            if found is not None and found < S:
                S, runs, groups = found, candidate, [groups[k] for k in order]
                improved = True
                break
    return S, runs, [spec for group in groups for spec in group]


def plan_buffer(specs, world_size: int, align: int = 1) -> BufferLayout:
    """Lay `specs` into one buffer with the smallest shard size the heuristic finds."""
    return _layout(_search(specs, world_size, align), world_size, align)


def _layout(found, world_size, align) -> BufferLayout:
    S, runs, members = found
    offsets = []
    _place(runs, S, align, offsets)
    placements = tuple(_placement(spec, off, S) for spec, off in zip(members, offsets))
    return BufferLayout(world_size, S, align, placements)


def _placement(spec: TensorSpec, offset: int, S: int) -> Placement:
    end = offset + spec.numel
    first, last = offset // S, (end - 1) // S
    units = []
    for r in range(first, last + 1):
        lo, hi = max(offset, r * S), min(end, (r + 1) * S)
        units.append(-(-(hi - offset) // spec.block) - (-(-(lo - offset) // spec.block)))
    return Placement(spec, offset, first, tuple(units))


def _split_by_block(specs):
    classes = {}
    for spec in specs:
        classes.setdefault(spec.block, []).append(spec)
    return [classes[g] for g in sorted(classes, reverse=True)]


def _merge_classes(classes, max_buffers, padding_of, tolerance):
    """Greedy agglomeration: merge the pair of buffers whose merge costs the least padding;
    merge while that costs at most `tolerance` elements (fewer collectives are worth a little
    padding) or while more than max_buffers remain."""
    groups = [(c, padding_of(c)) for c in classes]
    while len(groups) > 1:
        best = None
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                merged = groups[i][0] + groups[j][0]
                cost = padding_of(merged) - groups[i][1] - groups[j][1]
                if best is None or cost < best[0]:
                    best = (cost, i, j, merged)
        cost, i, j, merged = best
        if cost > tolerance and len(groups) <= max_buffers:
            break
        groups = [g for k, g in enumerate(groups) if k not in (i, j)] + [(merged, padding_of(merged))]
    return [group for group, _ in groups]


def _move_tensors(groups, padding_of, rounds: int = 3):
    """Local search over the split: move one tensor, or all tensors of one shape, from one
    buffer to another while that lowers the total padding (e.g. a tensor that fills another
    buffer's last shard exactly)."""
    groups = [list(g) for g in groups]
    for _ in range(rounds):
        improved = False
        for i in range(len(groups)):
            shapes = sorted({(s.shape, s.block) for s in groups[i]})
            for j in range(len(groups)):
                for shape in shapes if i != j else ():
                    same = [s for s in groups[i] if (s.shape, s.block) == shape]
                    for moved in ([same[0]], same) if len(same) > 1 else ([same[0]],):
                        if len(moved) == len(groups[i]):
                            continue
                        stay = [s for s in groups[i] if s not in moved]
                        before = padding_of(groups[i]) + padding_of(groups[j])
                        if padding_of(stay) + padding_of(groups[j] + moved) < before:
                            groups[i], groups[j] = stay, groups[j] + moved
                            improved = True
                            break
                    if improved:
                        break
                if improved:
                    break
        if not improved:
            break
    return groups


def plan_unit(specs, world_size: int, align: int = 1, max_buffers: int = DEFAULT_MAX_BUFFERS,
              split_gain: float = DEFAULT_SPLIT_GAIN) -> UnitPlan:
    """Plan one FSDP unit: one buffer, or up to `max_buffers` when splitting saves more than
    `split_gain` (a fraction of the unit's elements) of padding."""
    t0 = time.perf_counter()
    specs = list(specs)
    _check_specs(specs, world_size, align, max_buffers)
    position = {s.name: i for i, s in enumerate(specs)}
    found = {}

    def search(group, quick=True):
        key = (frozenset(s.name for s in group), quick)
        if key not in found:
            ordered = sorted(group, key=lambda s: position[s.name])
            found[key] = _search(ordered, world_size, align, quick)
        return found[key]

    def padding_of(group):
        return world_size * search(group)[0] - sum(s.numel for s in group)

    groups = [specs]
    classes = _split_by_block(specs)
    if max_buffers > 1 and len(classes) > 1 and padding_of(specs) > 0:
        tolerance = split_gain * sum(s.numel for s in specs)
        split = _merge_classes(classes, max_buffers, padding_of, tolerance)
        if len(split) > 1:
            split = _move_tensors(split, padding_of)
        if sum(map(padding_of, split)) < padding_of(specs) - tolerance:
            groups = sorted(split, key=lambda g: min(position[s.name] for s in g))
    buffers = tuple(_layout(search(g, quick=False), world_size, align) for g in groups)
    return UnitPlan(world_size, buffers, time.perf_counter() - t0)


def _check_specs(specs, world_size, align, max_buffers):
    if not specs:
        raise PlanError("a unit needs at least one tensor")
    if world_size < 1 or align < 1 or max_buffers < 1:
        raise PlanError(f"world size ({world_size}), alignment ({align}) and max buffers "
                        f"({max_buffers}) must be positive")
    names = set()
    for s in specs:
        if s.name in names:
            raise PlanError(f"tensor {s.name!r} appears twice in one unit")
        names.add(s.name)
        if any(d <= 0 for d in s.shape):
            raise PlanError(f"tensor {s.name!r} has a non-positive dimension: {list(s.shape)}")
        if s.block < 1:
            raise PlanError(f"tensor {s.name!r} has block size {s.block} (must be >= 1)")


# --------------------------------------------------------------------------------------------
# The invariant checker: for tests, and for anyone who wants to verify a plan.

def check_plan(plan: UnitPlan, specs) -> None:
    """Raise PlanError naming the first broken invariant; return None when the plan is valid."""
    expected = {s.name: s for s in specs}
    seen = set()
    for b, buf in enumerate(plan.buffers):
        check_buffer(buf, f"buffer {b}")
        for p in buf.placements:
            if p.name not in expected or expected[p.name] != p.spec:
                raise PlanError(f"buffer {b}: tensor {p.name!r} is not in the unit as given")
            if p.name in seen:
                raise PlanError(f"tensor {p.name!r} is placed twice")
            seen.add(p.name)
    if seen != set(expected):
        raise PlanError(f"tensors not placed: {sorted(set(expected) - seen)}")


def check_buffer(buf: BufferLayout, where: str = "buffer") -> None:
    S, m = buf.shard_size, buf.world_size
    if S <= 0 or S % buf.align:
        raise PlanError(f"{where}: shard size {S} is not a positive multiple of {buf.align}")
    end = 0
    for p in sorted(buf.placements, key=lambda p: p.offset):
        n, g, off = p.numel, p.block, p.offset
        if off < end:
            raise PlanError(f"{where}: {p.name!r} at {off} overlaps the previous tensor")
        if off % buf.align:
            raise PlanError(f"{where}: {p.name!r} offset {off} is not aligned to {buf.align}")
        end = off + n
        if end > m * S:
            raise PlanError(f"{where}: {p.name!r} ends at {end}, past the buffer ({m} x {S})")
        for k in range(off // S + 1, (end - 1) // S + 1):
            if (k * S - off) % g:
                raise PlanError(f"{where}: shard boundary {k * S} cuts a block of {p.name!r} "
                                f"(offset {off}, block {g})")
        units = p.local_units(m)
        if sum(units) != -(-n // g) or units != _placement(p.spec, off, S).local_units(m):
            raise PlanError(f"{where}: local_units of {p.name!r} do not match its placement")
