"""RaggedShard: a placement over a tensor's flattened row-major storage.

The storage is cut into atomic blocks of `block` elements (the last block may be shorter) and
rank r owns a contiguous run of `local_units[r]` whole blocks, right after the blocks of the
ranks before it. Runs may differ in length and may be empty. A local piece is always a 1-D
tensor of `spec.local_numel(rank)` elements.

Redistributions use only collectives that gloo and NCCL both accept with these shapes: an
equal-size all-gather (pieces padded to the longest), an all-to-all with uneven splits, and
async work handles. gloo rejects all_gather with unequal sizes, so it is never used.

The redistributions (ragged_to_replicate, ragged_to_ragged, ragged_to_root, root_to_ragged,
and their batched forms ragged_to_roots / roots_to_ragged that move many tensors, each to or
from its own root, in one all-to-all; also exported by `vescale_engine.shard`) are public API
for code holding sharded tensors and their RaggedShards (tests/core/shard/test_ragged.py). Muon
gathers each matrix onto the rank that orthogonalizes it and scatters the result back through the
batched forms; DBuffers gather and reduce whole buffers (collectives.py).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as dist

from . import collectives

__all__ = [
    "RaggedShard", "box_decomposition", "map_box", "shard_tensor", "Redistribution", "ragged_to_replicate",
    "ragged_to_ragged", "ragged_to_root", "root_to_ragged", "ragged_to_roots", "roots_to_ragged",
]


@dataclass(frozen=True)
class RaggedShard:
    shape: tuple[int, ...]        # global shape
    block: int                    # atomic block size in elements
    local_units: tuple[int, ...]  # whole blocks per rank, one entry per rank

    def __post_init__(self):
        # Normalise lists / numpy ints so that equal specs compare and hash equal.
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "local_units", tuple(int(u) for u in self.local_units))
        object.__setattr__(self, "block", int(self.block))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"RaggedShard shape {list(self.shape)} has a negative dimension")
        if self.block < 1:
            raise ValueError(f"RaggedShard block must be >= 1, got {self.block}")
        if not self.local_units:
            raise ValueError("RaggedShard local_units is empty (need one entry per rank)")
        if any(u < 0 for u in self.local_units):
            raise ValueError(
                f"RaggedShard local_units {list(self.local_units)} has a negative count")
        if sum(self.local_units) != self.num_blocks:
            raise ValueError(
                f"RaggedShard local_units {list(self.local_units)} sum to "
                f"{sum(self.local_units)}, but shape {list(self.shape)} with block {self.block} "
                f"has {self.num_blocks} blocks")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_blocks(self) -> int:
        return -(-self.numel // self.block)  # ceil: the last block may be short

    @property
    def world_size(self) -> int:
        return len(self.local_units)

    @cached_property
    def _first_blocks(self) -> tuple[int, ...]:
        # prefix sums, so local_range is O(1) even at thousands of ranks
        return tuple(itertools.accumulate(self.local_units, initial=0))

    def local_range(self, rank: int) -> tuple[int, int]:
        """Flat [start, end) owned by `rank`; the end is clipped to numel (short last block)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        start = min(self._first_blocks[rank] * self.block, self.numel)
        end = min(self._first_blocks[rank + 1] * self.block, self.numel)
        return start, end

    def local_numel(self, rank: int) -> int:
        start, end = self.local_range(rank)
        return end - start

    def ranges(self) -> list[tuple[int, int]]:
        """local_range of every rank, in rank order."""
        return [self.local_range(r) for r in range(self.world_size)]

    @classmethod
    def even(cls, shape, block: int, world_size: int) -> "RaggedShard":
        """Blocks spread as evenly as possible; the first ranks take one extra."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        num_blocks = -(-math.prod(shape) // block) if block >= 1 else 0
        base, extra = divmod(num_blocks, world_size)
        return cls(tuple(shape), block, tuple(base + (r < extra) for r in range(world_size)))

    @classmethod
    def on_rank(cls, shape, block: int, world_size: int, root: int) -> "RaggedShard":
        """One-hot: the whole tensor lives on `root`."""
        if not 0 <= root < world_size:
            raise ValueError(f"root {root} is outside world size {world_size}")
        num_blocks = -(-math.prod(shape) // block) if block >= 1 else 0
        return cls(tuple(shape), block,
                   tuple(num_blocks if r == root else 0 for r in range(world_size)))

    def with_units(self, local_units) -> "RaggedShard":
        return RaggedShard(self.shape, self.block, tuple(local_units))


def box_decomposition(shape, start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular boxes (offsets, sizes) that exactly cover the flat range [start, end).

    A flat range of a row-major tensor is a partial first row, some whole rows and a partial last
    row; each partial row is the same problem one dimension down. The boxes come in flat order,
    are disjoint, and number at most 2 * ndim - 1. DCP saves a ragged shard as these chunks.
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {numel} elements")
    if start == end:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]

    rest = shape[1:]
    row = math.prod(rest)  # > 0 since the range is non-empty
    first, first_off = divmod(start, row)
    last, last_off = divmod(end, row)

    def in_row(index, lo, hi):
        return [((index, *offs), (1, *sizes)) for offs, sizes in box_decomposition(rest, lo, hi)]

    if first == last:  # inside one row
        return in_row(first, first_off, last_off)
    boxes = []
    if first_off:
        boxes += in_row(first, first_off, row)
        first += 1
    if last > first:
        boxes.append(((first,) + (0,) * len(rest), (last - first, *rest)))
    if last_off:
        boxes += in_row(last, 0, last_off)
    return boxes


def _runs(index_map, begin: int, size: int) -> list[tuple[int, int, int]]:
    """[local begin, length, global begin] of the runs of consecutive global indices in
    index_map[begin:begin + size] (identity when index_map is None)."""
    if index_map is None:
        return [(begin, size, begin)]
    runs = []
    for i in range(begin, begin + size):
        g = int(index_map[i])
        if runs and runs[-1][2] + runs[-1][1] == g:
            runs[-1][1] += 1
        else:
            runs.append([i, 1, g])
    return [tuple(r) for r in runs]


def map_box(offsets, sizes, index_maps) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """A box (offsets, sizes) of a local tensor as boxes of the global tensor it is a piece of:
    [(local offsets, sizes, global offsets)]. `index_maps[d]` lists the global index of each
    local index along dim d (None: the same index). A dim whose local indices are not one run
    of global ones (TP's `_StridedShard`: a gate and an up segment) splits the box."""
    per_dim = [_runs(m, o, s) for m, o, s in zip(index_maps, offsets, sizes)]
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
            for combo in itertools.product(*per_dim)]


def shard_tensor(full: torch.Tensor, spec: RaggedShard, rank: int) -> torch.Tensor:
    """Replicate -> ragged: this rank's flat slice (a view when `full` is contiguous)."""
    if tuple(full.shape) != spec.shape:
        raise ValueError(
            f"tensor shape {list(full.shape)} does not match spec shape {list(spec.shape)}")
    start, end = spec.local_range(rank)
    return full.reshape(-1)[start:end]


class Redistribution:
    """Handle for an asynchronous redistribution; `wait()` returns the result.

    Holds the work handles and every buffer the collectives touch, so nothing is freed while
    the communication is in flight.
    """

    def __init__(self, works: list, finish: Callable[[], torch.Tensor], buffers=()):
        self._works = works
        self._finish = finish
        self._buffers = buffers
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._works, self._finish, self._buffers = [], None, ()
        return self._result


def _done(handle: Redistribution, async_op: bool):
    return handle if async_op else handle.wait()


def _group_rank(spec: RaggedShard, group) -> int:
    world_size = dist.get_world_size(group)
    if spec.world_size != world_size:
        raise ValueError(f"spec is for {spec.world_size} ranks but the group has {world_size}")
    return dist.get_rank(group)


def _check_local(local: torch.Tensor, spec: RaggedShard, rank: int):
    expected = spec.local_numel(rank)
    if local.dim() != 1 or local.numel() != expected:
        raise ValueError(f"local piece on rank {rank} has shape {list(local.shape)}, "
                         f"expected 1-D with {expected} elements")


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def ragged_to_replicate(local: torch.Tensor, spec: RaggedShard, group=None, async_op: bool = False):
    """Gather the full tensor (shape `spec.shape`) on every rank.

    Pieces are padded to the longest one so a single equal-size all-gather serves every layout.
    """
    rank = _group_rank(spec, group)
    _check_local(local, spec, rank)
    sizes = [spec.local_numel(r) for r in range(spec.world_size)]
    width = max(sizes)
    if width == 0:  # every rank knows the tensor is empty: nothing to send
        return _done(Redistribution([], lambda: local.new_empty(spec.shape)), async_op)

    send = local.contiguous()
    if send.numel() < width:  # the padding is never read back
        send = local.new_empty(width)
        send[:local.numel()].copy_(local)
    gathered = local.new_empty(width * spec.world_size)
    work = collectives.all_gather(gathered, send, group, async_op=True)

    def finish():
        if all(size == width for size in sizes):
            flat = gathered  # no padding anywhere: the gathered buffer is the tensor
        else:
            flat = torch.cat([gathered[r * width:r * width + size] for r, size in enumerate(sizes)])
        return flat.view(spec.shape)

    return _done(Redistribution([work], finish, (send, gathered)), async_op)


def ragged_to_ragged(local: torch.Tensor, src: RaggedShard, dst: RaggedShard, group=None,
                     async_op: bool = False):
    """Move this rank's piece from layout `src` to layout `dst` with one uneven all-to-all.

    Rank i sends rank j the intersection of its src range with j's dst range. Ranges are ordered
    and contiguous, so the sends are consecutive slices of `local` and the receives consecutive
    slices of the output: no packing is needed.
    """
    if src.shape != dst.shape:
        raise ValueError(f"src shape {list(src.shape)} and dst shape {list(dst.shape)} differ")
    if src.world_size != dst.world_size:
        raise ValueError(f"src is for {src.world_size} ranks, dst for {dst.world_size}")
    rank = _group_rank(src, group)
    _check_local(local, src, rank)
    src_ranges, dst_ranges = src.ranges(), dst.ranges()
    send_sizes = [_overlap(src_ranges[rank], d) for d in dst_ranges]
    recv_sizes = [_overlap(s, dst_ranges[rank]) for s in src_ranges]
    if src.numel == 0:  # known on every rank: no rank sends anything
        return _done(Redistribution([], lambda: local.new_empty(0)), async_op)
    handle = _uneven_all_to_all(local.contiguous(), send_sizes, recv_sizes, group,
                                lambda out: out, local.dtype, local.device)
    return _done(handle, async_op)


def ragged_to_root(local: torch.Tensor, spec: RaggedShard, root: int, group=None,
                   async_op: bool = False):
    """Gather the whole tensor on `root` (shaped there; an empty 1-D tensor elsewhere)."""
    handle = ragged_to_roots([local], [spec], [root], group=group, async_op=True)

    def finish():
        mine = handle.wait()
        return mine[0] if mine else local.new_empty(0)
    return _done(Redistribution([], finish, (handle,)), async_op)


def root_to_ragged(full: torch.Tensor | None, spec: RaggedShard, root: int, group=None,
                   async_op: bool = False, *, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None):
    """Scatter `root`'s full tensor into `spec`'s layout; returns this rank's local piece.

    Off the root the contents of `full` are ignored, but the result needs a dtype and device:
    they come from `full` when it is a tensor, else from `dtype=` and `device=`.
    """
    if full is not None and dtype is None and device is None:
        dtype, device = full.dtype, full.device
    handle = roots_to_ragged([full], [spec], [root], group=group, async_op=True, dtype=dtype,
                             device=device)
    return _done(Redistribution([], lambda: handle.wait()[0], (handle,)), async_op)


def _check_batch(specs, roots, group) -> int:
    """This rank's number in `group` after checking that the specs and roots agree with it."""
    if len(specs) != len(roots):
        raise ValueError(f"{len(specs)} specs but {len(roots)} roots")
    world_size = dist.get_world_size(group)
    for spec, root in zip(specs, roots):
        _group_rank(spec, group)
        if not 0 <= root < world_size:
            raise ValueError(f"root {root} is outside world size {world_size}")
    return dist.get_rank(group)


def _uneven_all_to_all(source, send_sizes, recv_sizes, group, finish, dtype, device):
    """One uneven all-to-all of `source` (send_sizes[d] elements to rank d, in rank order)
    into a new buffer (recv_sizes[s] from rank s); `finish(received)` shapes the result."""
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    work = dist.all_to_all_single(out, source, output_split_sizes=recv_sizes,
                                  input_split_sizes=send_sizes, group=group, async_op=True)
    return Redistribution([work], lambda: finish(out), (source, out))


def ragged_to_roots(pieces, specs, roots, group=None, async_op: bool = False):
    """Gather several tensors, each whole onto its own root, with one uneven all-to-all.

    Tensor i has layout `specs[i]`, this rank's 1-D piece `pieces[i]`, and goes to
    `roots[i]`; every rank passes the same specs and roots, and pieces of one dtype and
    device. The result (after `wait()` when async) is the list of the tensors this rank is
    root of, in the order given, each shaped: a rank that roots one tensor gets the receive
    buffer itself (pieces arrive in rank order, which is the tensor's order), so gathering
    one tensor per root (Muon's rounds, ragged_to_root) copies nothing on arrival.
    """
    rank = _check_batch(specs, roots, group)
    for piece, spec in zip(pieces, specs):
        _check_local(piece, spec, rank)
    world_size = dist.get_world_size(group)
    mine = [i for i, root in enumerate(roots) if root == rank]
    if all(spec.numel == 0 for spec in specs):  # known on every rank: nothing moves
        return _done(Redistribution([], lambda: [pieces[i].new_empty(specs[i].shape)
                                                 for i in mine]), async_op)
    by_root = sorted(range(len(specs)), key=lambda i: roots[i])  # stable: given order per root
    send_sizes = [0] * world_size
    for i in by_root:
        send_sizes[roots[i]] += pieces[i].numel()
    source = (pieces[0].contiguous() if len(pieces) == 1 else
              torch.cat([pieces[i] for i in by_root]))
    sizes = [[specs[i].local_numel(s) for i in mine] for s in range(world_size)]

    def finish(received):
        if len(mine) == 1:
            return [received.view(specs[mine[0]].shape)]
        parts = [chunk.split(sizes[s]) for s, chunk in enumerate(received.split(
            [sum(row) for row in sizes]))]
        return [torch.cat([parts[s][j] for s in range(world_size)]).view(specs[i].shape)
                for j, i in enumerate(mine)]

    handle = _uneven_all_to_all(source, send_sizes, [sum(row) for row in sizes], group, finish,
                                source.dtype, source.device)
    return _done(handle, async_op)


def roots_to_ragged(fulls, specs, roots, group=None, async_op: bool = False, *,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None):
    """Scatter several tensors, each from its root, into their layouts with one uneven
    all-to-all: the inverse of ragged_to_roots. `fulls[i]` is read on `roots[i]` only (it may
    be None elsewhere); the result is this rank's piece of every tensor, in the order given,
    views of one receive buffer. The dtype and device come from a full tensor this rank
    roots, else from `dtype=` and `device=`. A root that scatters one tensor sends it as it
    is (its ranks' ranges are consecutive in rank order): no packing."""
    rank = _check_batch(specs, roots, group)
    world_size = dist.get_world_size(group)
    mine = [i for i, root in enumerate(roots) if root == rank]
    for i in mine:
        full = fulls[i]
        if full is None or tuple(full.shape) != specs[i].shape:
            got = None if full is None else list(full.shape)
            raise ValueError(f"root {rank} needs the full tensor of shape "
                             f"{list(specs[i].shape)}, got {got}")
    if mine:
        dtype, device = fulls[mine[0]].dtype, fulls[mine[0]].device
    elif dtype is None or device is None:
        raise ValueError(f"root_to_ragged on non-root rank {rank} needs `full` or both dtype= "
                         "and device= to know what it receives")
    recv = [[specs[i].local_numel(rank) for i, root in enumerate(roots) if root == s]
            for s in range(world_size)]

    def finish(received):
        out = [None] * len(specs)
        chunks = received.split([sum(row) for row in recv])
        for s, chunk in enumerate(chunks):
            senders = [i for i, root in enumerate(roots) if root == s]
            for i, part in zip(senders, chunk.split(recv[s])):
                out[i] = part
        return out

    if all(spec.numel == 0 for spec in specs):  # known on every rank: nothing moves
        return _done(Redistribution([], lambda: finish(torch.empty(0, dtype=dtype,
                                                                   device=device))), async_op)
    flats = [fulls[i].reshape(-1) for i in mine]
    send_sizes = [sum(specs[i].local_numel(d) for i in mine) for d in range(world_size)]
    if len(mine) == 1:
        source = flats[0].contiguous()
    elif mine:
        source = torch.cat([flat[slice(*specs[i].local_range(d))] for d in range(world_size)
                            for i, flat in zip(mine, flats)])
    else:
        source = torch.empty(0, dtype=dtype, device=device)
    handle = _uneven_all_to_all(source, send_sizes, [sum(row) for row in recv], group, finish,
                                dtype, device)
    return _done(handle, async_op)
