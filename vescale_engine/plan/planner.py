"""Layout planner: lay the tensors of one FSDP unit into flat buffers of equal per-rank shards.

Problem (docs/design.md, "The planning problem"): place every tensor contiguously in a buffer of
`world_size * S` elements so that each shard boundary `k * S` that falls inside a tensor falls on
one of its block edges, and minimise the padding `world_size * S - sum(numel)`. It is NP-hard; we
solve it with a fast heuristic built from three observations:

1. For a fixed order and a fixed S, placing each tensor at its earliest feasible offset is optimal
   (feasible offsets only shrink as the start moves right), and that offset is O(1) arithmetic.
2. Any S can be tested in O(#tensors) that way, and faster: a run of identical tensors is placed
   a shard at a time, and where its next tensor goes depends only on where the previous one
   ended within its shard, so the run turns periodic and whole periods are skipped. A layer of
   384 experts costs one step per shard boundary it meets at most, not one per tensor (1152).
3. A tensor longer than 2S contains two boundaries, which forces S to be a multiple of its block:
   large tensors with different row lengths couple through the lcm of their blocks (the "lcm
   trap"). Splitting the unit into a few buffers, each with its own S, removes the coupling.
   The split search tries many candidate buffers; each is searched once per multiset of tensor
   shapes (names do not change the result), and not at all when a lower bound on its shard
   size already shows the candidate cannot win.

Pure Python: no torch, no torch.distributed, no modules.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["TensorSpec", "Placement", "BufferLayout", "UnitPlan", "plan_unit", "plan_buffer",
           "shard_lower_bound", "check_plan", "PlanError", "DEFAULT_ALIGN_BYTES",
           "DEFAULT_MAX_BUFFERS"]

DEFAULT_ALIGN_BYTES = 16
DEFAULT_MAX_BUFFERS = 4
DEFAULT_SPLIT_GAIN = 0.0  # fraction of a unit's elements a split must save (0: any saving)
_SEARCH_EVALS = 48  # placement passes per (order, search start): bounds planning time
_SWAP_TENSORS = 12  # buffers of at most this many tensors get a swap search over their order


class PlanError(ValueError):
    """A plan (or its input) breaks an invariant."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place: its name, shape and atomic block size in elements."""
    name: str
    shape: tuple
    block: int

    def __post_init__(self):  # computed once: the search sums it over many candidate groups
        object.__setattr__(self, "numel", math.prod(self.shape))


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
        if n > 2 * S and n % step == 0:
            p = -(-p // align) * align
            off = _earliest_offset(p, n * count, g, S, step)
            if off is None:
                return None
            if offsets is not None:
                offsets.extend(off + i * n for i in range(count))
            p = off + n * count
        else:
            p = _place_run(p, n, g, count, S, align, step, offsets)
            if p is None:
                return None
    return p


def _place_run(p, n, g, count, S, align, step, offsets):
    """Place `count` identical tensors after p (where the last tensor placed ends), a shard at a
    time: one step places the tensor that meets the next boundary (`_earliest_offset`) and then,
    back to back, those that fit after it in the next shard. Where a step goes depends only on
    where it starts within its shard, so once that position repeats the run is periodic: jump
    over the remaining whole periods. Exactly what placing one tensor at a time would do."""
    stride = -(-n // align) * align      # from one tensor's start to the next one's, back to back
    seen = {}
    i = 0
    while i < count:
        start = -(-p // align) * align
        if seen is not None:
            if start % S in seen:
                i0, start0 = seen[start % S]
                period, advance = i - i0, start - start0    # advance is a multiple of S
                cycles = (count - i) // period
                if offsets is not None:
                    last = offsets[len(offsets) - period:]
                    offsets.extend(o + c * advance for c in range(1, cycles + 1) for o in last)
                p, i, seen = p + cycles * advance, i + cycles * period, None
                continue
            seen[start % S] = (i, start)
        if n > S - start % S:                       # meets the next boundary
            off = _earliest_offset(start, n, g, S, step)
            if off is None:
                return None
            if offsets is not None:
                offsets.append(off)
            p, i = off + n, i + 1
            start = -(-p // align) * align
        room = S - start % S
        if n <= room and i < count:                 # these fit before the next boundary
            k = min(count - i, (room - n) // stride + 1)
            if offsets is not None:
                offsets.extend(start + j * stride for j in range(k))
            p, i = start + (k - 1) * stride + n, i + k
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


def shard_lower_bound(items, world_size: int, align: int) -> int:
    """A shard size no one-buffer layout of items [(numel, block, count)] can beat: S is at
    least the fair share, and a multiple of the block of every tensor longer than 2S (the lcm
    trap). The split search uses it to skip trials that cannot pay off."""
    total = sum(n * count for n, _, count in items)
    S = _round_up(max(1, -(-total // world_size)), align)
    while True:
        forced = [(n, g) for n, g, _ in items if n > 2 * S]
        candidate = _round_up(S, math.lcm(align, *(g for _, g in forced)))
        drop = min((-(-n // 2) for n, _ in forced), default=None)
        if drop is None or candidate < drop:
            return candidate
        S = drop  # from here on the longest forced tensor no longer forces S


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
    count), each with its member tensors, so that the placement can handle them in one step."""
    runs, members = [], []
    for spec in specs:
        if members and members[-1][-1].shape == spec.shape and members[-1][-1].block == spec.block:
            runs[-1][2] += 1
            members[-1].append(spec)
        else:
            runs.append([spec.numel, spec.block, 1])
            members.append([spec])
    return [tuple(r) for r in runs], members


def _by_block(shape, block, numel):
    return -block, -numel, shape


def _by_size(shape, block, numel):
    return -numel, -block, shape


def _orders(specs, quick=False):
    if not quick:
        yield list(specs)                                                    # module order
    for key in (_by_block, _by_size):
        yield sorted(specs, key=lambda s: key(s.shape, s.block, s.numel))


def _search(specs, world_size, align, quick=False):
    """Best (S, runs, members) over the candidate orders, without building placements.
    `quick` skips module order: the sorted orders group identical tensors into few runs."""
    found = _best_order([_runs(order) for order in _orders(specs, quick)], world_size, align)
    if found is None:
        raise PlanError("no feasible layout found for tensors "
                        + ", ".join(s.name for s in specs))
    S, runs, members = found
    return S, runs, [spec for run in members for spec in run]


def _quick_shard(kinds, world_size, align):
    """The S that `_search(..., quick=True)` finds, from the multiset of tensor kinds alone
    (a Counter of (shape, block)): in the sorted orders identical tensors are adjacent, so each
    kind is one run and the tensors' names and module positions do not matter."""
    candidates = []
    for key in (_by_block, _by_size):
        order = sorted(kinds, key=lambda kind: key(*kind, math.prod(kind[0])))
        candidates.append(([(math.prod(shape), block, kinds[(shape, block)])
                            for shape, block in order], order))
    found = _best_order(candidates, world_size, align)
    if found is None:
        raise PlanError("no feasible layout found for tensors of shapes "
                        + ", ".join(str(list(shape)) for shape, _ in kinds))
    return found[0]


def _best_order(candidates, world_size, align):
    """Smallest S over candidate orders [(runs, one label per run)], the first on ties, then
    improved by swapping runs; returns (S, runs, labels) or None when no order is feasible."""
    best = None
    for runs, labels in candidates:
        S = _min_shard(runs, world_size, align)
        if S is not None and (best is None or S < best[0]):
            best = (S, runs, labels)
    return best if best is None else _swap_runs(best, world_size, align)


def _swap_runs(best, world_size, align):
    """Local search on the order of a few runs: swap two runs while that shrinks S. Which tensor
    straddles each shard boundary decides the padding, and the sorted orders can miss it."""
    S, runs, labels = best
    if sum(count for _, _, count in runs) > _SWAP_TENSORS:
        return best
    improved = True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(len(runs)), 2):
            order = list(range(len(runs)))
            order[i], order[j] = j, i
            candidate = [runs[k] for k in order]
            found = _min_shard(candidate, world_size, align)
            if found is not None and found < S:
                S, runs, labels = found, candidate, [labels[k] for k in order]
                improved = True
                break
    return S, runs, labels


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
    """Blocks per rank in closed form: a tensor that spans more than two shards has every
    boundary inside it on a block edge and S a multiple of its block (the plan's invariant), so
    every rank strictly inside holds S / block blocks; only the two end ranks are partial."""
    n, g = spec.numel, spec.block
    end = offset + n
    first, last = offset // S, (end - 1) // S
    if first == last:
        return Placement(spec, offset, first, (-(-n // g),))
    head = -(-((first + 1) * S - offset) // g)
    tail = -(-n // g) - -(-(last * S - offset) // g)
    middle = (S // g,) * (last - first - 1)
    return Placement(spec, offset, first, (head,) + middle + (tail,))


def _units_by_rank(spec: TensorSpec, offset: int, S: int) -> tuple:
    """Blocks per rank counted rank by rank, for the checker (independent of the closed form)."""
    end = offset + spec.numel
    units = []
    for r in range(offset // S, (end - 1) // S + 1):
        lo, hi = max(offset, r * S), min(end, (r + 1) * S)
        units.append(-(-(hi - offset) // spec.block) - (-(-(lo - offset) // spec.block)))
    return tuple(units)


def _kinds(specs) -> Counter:
    """The multiset of (shape, block) of a group: all that its quick search depends on."""
    return Counter((s.shape, s.block) for s in specs)


def _split_by_block(specs):
    classes = {}
    for spec in specs:
        classes.setdefault(spec.block, []).append(spec)
    return [classes[g] for g in sorted(classes, reverse=True)]


def _merge_classes(classes, max_buffers, padding_of, floor_of, tolerance):
    """Greedy agglomeration: merge the pair of buffers whose merge costs the least padding;
    merge while that costs at most `tolerance` elements (fewer collectives are worth a little
    padding) or while more than max_buffers remain. `padding_of` takes a group's kinds;
    `floor_of` is a lower bound of it that costs no search."""
    groups = [(c, _kinds(c)) for c in classes]
    groups = [(c, kinds, padding_of(kinds)) for c, kinds in groups]
    while len(groups) > 1:
        best = None
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                kinds = groups[i][1] + groups[j][1]
                if best is not None and floor_of(kinds) - groups[i][2] - groups[j][2] >= best[0]:
                    continue  # cannot beat the best pair so far
                cost = padding_of(kinds) - groups[i][2] - groups[j][2]
                if best is None or cost < best[0]:
                    best = (cost, i, j, kinds)
        cost, i, j, kinds = best
        if cost > tolerance and len(groups) <= max_buffers:
            break
        merged = groups[i][0] + groups[j][0]
        groups = [g for k, g in enumerate(groups) if k not in (i, j)] + [
            (merged, kinds, padding_of(kinds))]
    return [group for group, _, _ in groups]


def _move_tensors(groups, padding_of, floor_of, rounds: int = 3):
    """Local search over the split: move one tensor, or all tensors of one shape, from one
    buffer to another while that lowers the total padding (e.g. a tensor that fills another
    buffer's last shard exactly). Trials work on the groups' kinds; only an accepted move
    touches the tensor lists."""
    groups = [list(g) for g in groups]
    kinds = [_kinds(g) for g in groups]
    for _ in range(rounds):
        improved = False
        for i in range(len(groups)):
            for j in range(len(groups)):
                for kind in sorted(kinds[i]) if i != j else ():
                    have = kinds[i][kind]
                    for count in (1, have) if have > 1 else (1,):
                        if count == len(groups[i]):
                            continue
                        stay, into = kinds[i].copy(), kinds[j].copy()
                        stay[kind] -= count
                        into[kind] += count
                        stay += Counter()  # drop the kind if none is left
                        before = padding_of(kinds[i]) + padding_of(kinds[j])
                        if floor_of(stay) + floor_of(into) >= before or \
                                padding_of(stay) + floor_of(into) >= before:
                            continue  # the bounds show the move cannot lower the padding
                        if padding_of(stay) + padding_of(into) < before:
                            moved = [s for s in groups[i] if (s.shape, s.block) == kind][:count]
                            ids = {id(s) for s in moved}
                            groups[i] = [s for s in groups[i] if id(s) not in ids]
                            groups[j] = groups[j] + moved
                            kinds[i], kinds[j] = stay, into
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
    shard_of = {}

    def padding_of(kinds):  # one quick search per multiset of (shape, block), however named
        key = frozenset(kinds.items())
        if key not in shard_of:
            shard_of[key] = _quick_shard(kinds, world_size, align)
        return world_size * shard_of[key] - sum(
            math.prod(shape) * count for (shape, _), count in key)

    def floor_of(kinds):  # no search: padding_of(kinds) >= floor_of(kinds)
        items = [(math.prod(shape), block, count) for (shape, block), count in kinds.items()]
        return world_size * shard_lower_bound(items, world_size, align) - sum(
            n * count for n, _, count in items)

    groups = [specs]
    classes = _split_by_block(specs)
    whole = _kinds(specs)
    if max_buffers > 1 and len(classes) > 1 and padding_of(whole) > 0:
        tolerance = split_gain * sum(s.numel for s in specs)
        split = _merge_classes(classes, max_buffers, padding_of, floor_of, tolerance)
        if len(split) > 1:
            split = _move_tensors(split, padding_of, floor_of)
        if sum(padding_of(_kinds(g)) for g in split) < padding_of(whole) - tolerance:
            groups = sorted(split, key=lambda g: min(position[s.name] for s in g))
    buffers = tuple(_layout(_search(sorted(g, key=lambda s: position[s.name]), world_size,
                                    align), world_size, align) for g in groups)
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
        want = [0] * m
        counted = _units_by_rank(p.spec, off, S)
        want[off // S:off // S + len(counted)] = counted
        units = p.local_units(m)
        if sum(units) != -(-n // g) or units != want:
            raise PlanError(f"{where}: local_units of {p.name!r} do not match its placement")
