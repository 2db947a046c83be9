"""RaggedShard: block math and boxes (pure), redistributions on 2, 3 and 4 gloo ranks."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist

from vescale_engine.shard.ragged import (
    RaggedShard, box_decomposition, ragged_to_ragged, ragged_to_replicate, ragged_to_root,
    ragged_to_roots, root_to_ragged, roots_to_ragged, shard_tensor,
)

SEED = 1234
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


# ----------------------------------------------------------------------------- block math

def test_the_redistributions_are_public_api():
    """docs/architecture.md ("Redistributions"): exported by vescale_engine.shard too."""
    import vescale_engine.shard as shard
    from vescale_engine.shard import ragged
    for name in ("ragged_to_replicate", "ragged_to_ragged", "ragged_to_root", "root_to_ragged",
                 "ragged_to_roots", "roots_to_ragged", "Redistribution"):
        assert name in shard.__all__ and getattr(shard, name) is getattr(ragged, name), name


def test_block_math_with_short_last_block():
    spec = RaggedShard((5, 7), block=10, local_units=(2, 0, 2))
    assert (spec.numel, spec.num_blocks, spec.world_size) == (35, 4, 3)
    assert spec.ranges() == [(0, 20), (20, 20), (20, 35)]  # last block has 5 elements
    assert [spec.local_numel(r) for r in range(3)] == [20, 0, 15]


def test_local_range_uneven_units_and_empty_shards():
    spec = RaggedShard((4, 6), block=6, local_units=(0, 3, 0, 1, 0))
    assert spec.ranges() == [(0, 0), (0, 18), (18, 18), (18, 24), (24, 24)]
    assert sum(spec.local_numel(r) for r in range(spec.world_size)) == spec.numel


@pytest.mark.parametrize("shape,block,units", [
    ((), 1, (0, 1)),                  # 0-d tensor: one element
    ((0, 3), 1, (0, 0)),              # empty tensor: zero blocks
    ((7,), 100, (1, 0)),              # block larger than the tensor
    ((3, 4, 5), 20, (1, 1, 1)),       # one 2-D slab per rank
    ((13,), 1, (5, 8)),               # element-wise
])
def test_ranges_tile_the_tensor(shape, block, units):
    spec = RaggedShard(shape, block, units)
    ends = [0]
    for start, end in spec.ranges():
        assert start == ends[-1] and end >= start
        ends.append(end)
    assert ends[-1] == spec.numel


@pytest.mark.parametrize("kwargs,message", [
    (dict(shape=(4,), block=0, local_units=(4,)), "block must be >= 1"),
    (dict(shape=(4, -1), block=1, local_units=(0,)), "negative dimension"),
    (dict(shape=(4,), block=1, local_units=()), "local_units is empty"),
    (dict(shape=(4,), block=1, local_units=(5, -1)), "negative count"),
    (dict(shape=(4,), block=3, local_units=(1, 0)), "sum to 1.*has 2 blocks"),
    (dict(shape=(4,), block=1, local_units=(2, 3)), "sum to 5"),
])
def test_validation_errors_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        RaggedShard(**kwargs)
    assert "\n" not in str(info.value)


def test_rank_out_of_range():
    spec = RaggedShard((4,), 1, (2, 2))
    for rank in (-1, 2):
        with pytest.raises(ValueError, match="outside world size 2"):
            spec.local_range(rank)


def test_normalises_to_tuples():
    spec = RaggedShard([2, 3], 3, [1, 1])
    assert spec == RaggedShard((2, 3), 3, (1, 1))
    assert hash(spec) == hash(RaggedShard((2, 3), 3, (1, 1)))
    assert isinstance(spec.shape, tuple) and isinstance(spec.local_units, tuple)


def test_even_gives_extra_blocks_to_first_ranks():
    assert RaggedShard.even((10, 3), 3, 4).local_units == (3, 3, 2, 2)
    assert RaggedShard.even((2,), 1, 4).local_units == (1, 1, 0, 0)
    assert RaggedShard.even((0,), 1, 3).local_units == (0, 0, 0)
    assert RaggedShard.even((7,), 3, 2).ranges() == [(0, 6), (6, 7)]
    for n in range(0, 40):
        for ws in range(1, 6):
            units = RaggedShard.even((n,), 2, ws).local_units
            assert max(units) - min(units) <= 1 and list(units) == sorted(units, reverse=True)


def test_on_rank_and_with_units():
    spec = RaggedShard.on_rank((4, 5), 5, 3, root=1)
    assert spec.local_units == (0, 4, 0)
    assert spec.ranges() == [(0, 0), (0, 20), (20, 20)]
    moved = spec.with_units([2, 0, 2])
    assert (moved.shape, moved.block, moved.local_units) == ((4, 5), 5, (2, 0, 2))
    with pytest.raises(ValueError, match="sum to 3"):
        spec.with_units((1, 1, 1))
    with pytest.raises(ValueError, match="root 3 is outside"):
        RaggedShard.on_rank((4,), 1, 3, root=3)


def test_shard_tensor_views_and_copies():
    full = torch.arange(24.0).reshape(4, 6)
    spec = RaggedShard((4, 6), 6, (1, 0, 3))
    pieces = [shard_tensor(full, spec, r) for r in range(3)]
    assert torch.equal(torch.cat(pieces), full.flatten())
    assert pieces[0].data_ptr() == full.data_ptr()  # a view, no copy
    transposed = full.t()  # non-contiguous: a row-major copy of the logical tensor
    tspec = RaggedShard((6, 4), 4, (3, 3))
    assert torch.equal(shard_tensor(transposed, tspec, 1), transposed.flatten()[12:])
    with pytest.raises(ValueError, match="does not match spec shape"):
        shard_tensor(full, tspec, 0)


# ----------------------------------------------------------------------------- boxes

def _check_boxes(shape, start, end):
    boxes = box_decomposition(shape, start, end)
    ndim = len(shape)
    assert len(boxes) <= max(1, 2 * ndim - 1)
    if start == end:
        assert boxes == []
        return
    cursor = start
    for offsets, sizes in boxes:
        assert len(offsets) == len(sizes) == ndim
        assert all(s > 0 for s in sizes)
        assert all(o + s <= d for o, s, d in zip(offsets, sizes, shape))
        marks = torch.zeros(shape, dtype=torch.int32)
        marks[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = 1
        hit = marks.flatten().nonzero().flatten()
        # each box is one contiguous flat run that begins where the previous box ended
        assert hit[0].item() == cursor and hit.numel() == math.prod(sizes)
        assert hit[-1].item() - hit[0].item() + 1 == hit.numel()
        cursor += hit.numel()
    assert cursor == end


def test_box_decomposition_examples():
    assert box_decomposition((4, 5), 3, 17) == [
        ((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    assert box_decomposition((4, 5), 5, 15) == [((1, 0), (2, 5))]
    assert box_decomposition((4, 5), 0, 20) == [((0, 0), (4, 5))]
    assert box_decomposition((4, 5), 6, 8) == [((1, 1), (1, 2))]
    assert box_decomposition((10,), 2, 9) == [((2,), (7,))]
    assert box_decomposition((), 0, 1) == [((), ())]
    assert box_decomposition((), 0, 0) == []
    assert box_decomposition((3, 0, 2), 0, 0) == []
    assert box_decomposition((2, 3, 4), 5, 21) == [
        ((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)), ((1, 0, 0), (1, 2, 4)),
        ((1, 2, 0), (1, 1, 1))]


def test_box_decomposition_random_shapes():
    rng = random.Random(SEED)
    for _ in range(600):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 6) for _ in range(ndim))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        end = rng.choice([start, numel, rng.randint(start, numel)])
        _check_boxes(shape, start, end)


def test_box_decomposition_every_range_of_small_tensors():
    for shape in [(1,), (5,), (3, 4), (2, 3, 4), (2, 2, 3, 2), (1, 3, 1, 2)]:
        numel = math.prod(shape)
        for start in range(numel + 1):
            for end in range(start, numel + 1):
                _check_boxes(shape, start, end)


def test_box_decomposition_rejects_bad_ranges():
    for start, end in [(-1, 3), (3, 2), (0, 21)]:
        with pytest.raises(ValueError, match="outside a tensor of 20 elements"):
            box_decomposition((4, 5), start, end)


# ----------------------------------------------------------------------------- on gloo ranks

def _random_units(rng, num_blocks, world_size):
    """Any split of num_blocks into world_size runs, zeros included."""
    cuts = sorted(rng.randint(0, num_blocks) for _ in range(world_size - 1))
    bounds = [0, *cuts, num_blocks]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _cases(world_size, count):
    """Layouts every rank builds identically: fixed corner cases, then random ones."""
    rng = random.Random(SEED + world_size)
    ws = world_size
    specs = [
        RaggedShard.even((12, 5), 5, ws),
        RaggedShard((12, 5), 5, (0,) * (ws - 1) + (12,)),           # only the last rank
        RaggedShard((12, 5), 5, (12,) + (0,) * (ws - 1)),           # only rank 0
        RaggedShard((12, 5), 5, (0, *(1,) * (ws - 2), 14 - ws)),    # rank 0 empty
        RaggedShard((12, 5), 5, (14 - ws, *(1,) * (ws - 2), 0)),    # last rank empty
        RaggedShard((23,), 4, (0, 6) + (0,) * (ws - 2)),            # short last block on rank 1
        RaggedShard((3, 4, 5), 20, RaggedShard.even((3,), 1, ws).local_units),
        RaggedShard((3, 4, 5), 7, (9,) + (0,) * (ws - 1)),
        RaggedShard((0, 4), 4, (0,) * ws),                          # empty tensor
        RaggedShard((), 1, (0,) * (ws - 1) + (1,)),                 # 0-d tensor
        RaggedShard((5,), 100, (0, 1) + (0,) * (ws - 2)),           # block > numel
    ]
    while len(specs) < count:
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        block = rng.choice([1, 2, 3, shape[-1], 2 * shape[-1], math.prod(shape)])
        num_blocks = -(-math.prod(shape) // block)
        specs.append(RaggedShard(shape, block, _random_units(rng, num_blocks, ws)))
    # a destination layout for each case, with its own block size
    dsts = []
    for spec in specs:
        block = rng.choice([1, spec.block, max(1, spec.numel // 3)])
        num_blocks = -(-spec.numel // block)
        dsts.append(RaggedShard(spec.shape, block, _random_units(rng, num_blocks, ws)))
    return list(zip(specs, dsts))


def _full(spec, dtype, index):
    gen = torch.Generator().manual_seed(SEED * 7 + index)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, spec.shape, generator=gen, dtype=dtype)


def _same(got, want):
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def run_round_trips(rank, world_size, count):
    checks = 0
    for index, (src, dst) in enumerate(_cases(world_size, count)):
        for dtype in DTYPES:
            full = _full(src, dtype, index)
            local = shard_tensor(full, src, rank).clone()
            want_dst = shard_tensor(full, dst, rank)

            assert _same(ragged_to_replicate(local, src), full), (src, dtype)
            moved = ragged_to_ragged(local, src, dst)
            assert _same(moved, want_dst), (src, dst, dtype)
            assert _same(ragged_to_ragged(moved, dst, src), local), (src, dst, dtype)
            checks += 3
            for root in range(world_size):
                gathered = ragged_to_root(local, src, root)
                if rank == root:
                    assert _same(gathered, full), (src, root, dtype)
                else:
                    assert gathered.shape == (0,) and gathered.dtype == dtype
                # off the root, `full` is either absent (dtype/device given) or ignored
                if rank == root:
                    back = root_to_ragged(gathered, src, root)
                elif root % 2:
                    back = root_to_ragged(None, src, root, dtype=dtype, device="cpu")
                else:
                    back = root_to_ragged(torch.zeros(1, dtype=dtype), src, root)
                assert _same(back, local), (src, root, dtype)
                checks += 2
    return checks


def run_async(rank, world_size, count):
    """Start every kind of redistribution for many cases at once, then wait in reverse."""
    pending = []
    for index, (src, dst) in enumerate(_cases(world_size, count)):
        dtype = DTYPES[index % len(DTYPES)]
        full = _full(src, dtype, index)
        local = shard_tensor(full, src, rank)
        root = index % world_size
        pending += [
            (ragged_to_replicate(local, src, async_op=True), full),
            (ragged_to_ragged(local, src, dst, async_op=True), shard_tensor(full, dst, rank)),
            (ragged_to_root(local, src, root, async_op=True),
             full if rank == root else torch.empty(0, dtype=dtype)),
            (root_to_ragged(full, src, root, async_op=True), local),
        ]
    for handle, want in reversed(pending):
        got = handle.wait()
        assert _same(got, want)
        assert handle.wait() is got  # waiting twice returns the same result
    assert len(pending) == 4 * count  # every case, four kinds each


def run_batched(rank, world_size, count):
    """ragged_to_roots / roots_to_ragged: many tensors of different layouts, a root holding
    none, one or several of them (what Muon's rounds move), each gathered whole onto its
    root and scattered back exactly; async handles waited out of order."""
    rng = random.Random(SEED + world_size)
    cases = [src for src, _ in _cases(world_size, count)]
    checks = 0
    for trial in range(6):
        dtype = DTYPES[trial % len(DTYPES)]
        picked = rng.sample(range(len(cases)), k=min(len(cases), 1 + trial * 2))
        specs = [cases[i] for i in picked]
        # trial 0..: one tensor; then roots drawn so that some rank roots several, some none
        roots = [rng.randrange(world_size) for _ in specs]
        fulls = [_full(spec, dtype, 100 * trial + i) for i, spec in enumerate(specs)]
        locals_ = [shard_tensor(full, spec, rank).clone() for full, spec in zip(fulls, specs)]
        gathered = ragged_to_roots(locals_, specs, roots, async_op=trial % 2 == 1)
        if trial % 2:
            gathered = gathered.wait()
        mine = [i for i, root in enumerate(roots) if root == rank]
        assert len(gathered) == len(mine), (roots, len(gathered))
        for i, got in zip(mine, gathered):
            assert _same(got, fulls[i]), (specs[i], roots)
        back = roots_to_ragged([gathered[mine.index(i)] if i in mine else None
                                for i in range(len(specs))], specs, roots,
                               dtype=dtype, device="cpu")
        assert len(back) == len(specs)
        for got, want in zip(back, locals_):
            assert _same(got, want), (roots,)
        checks += len(specs)
    assert ragged_to_roots([], [], []) == [] and roots_to_ragged([], [], [], dtype=torch.float32,
                                                                   device="cpu") == []
    return checks


def _expect_error(match, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as err:
        assert match in str(err), str(err)
        return
    raise AssertionError(f"{fn.__name__} did not raise ({match})")


def run_errors(rank, world_size):
    """Every rank raises before any collective; a later collective still lines up."""
    ws = world_size
    spec = RaggedShard.even((6, 4), 4, ws)
    full = torch.arange(24.0).reshape(6, 4)
    local = shard_tensor(full, spec, rank)
    wrong = torch.zeros(spec.local_numel(rank) + 1)
    other_shape = RaggedShard.even((4, 6), 6, ws)
    other_world = RaggedShard.even((6, 4), 4, ws + 1)

    _expect_error("expected 1-D with", ragged_to_replicate, wrong, spec)
    _expect_error("expected 1-D with", ragged_to_replicate, local.reshape(1, -1), spec)
    _expect_error("expected 1-D with", ragged_to_ragged, wrong, spec,
                  RaggedShard.even((6, 4), 1, ws))
    _expect_error("expected 1-D with", ragged_to_root, wrong, spec, 0, async_op=True)
    _expect_error("src shape [6, 4] and dst shape [4, 6] differ",
                  ragged_to_ragged, local, spec, other_shape)
    _expect_error(f"src is for {ws} ranks, dst for {ws + 1}", ragged_to_ragged, local, spec,
                  other_world)
    _expect_error(f"spec is for {ws + 1} ranks but the group has {ws}",
                  ragged_to_replicate, torch.zeros(other_world.local_numel(rank)), other_world)
    if rank == 0:  # only the root can see that its tensor is wrong, so only it calls
        _expect_error("root 0 needs the full tensor of shape [6, 4], got [4, 6]",
                      root_to_ragged, full.t(), spec, 0)
        _expect_error("root 0 needs the full tensor of shape [6, 4], got None",
                      root_to_ragged, None, spec, 0, dtype=torch.float32, device="cpu")
    if rank != ws - 1:
        _expect_error("needs `full` or both dtype=", root_to_ragged, None, spec, ws - 1)
    else:
        _expect_error("needs the full tensor", root_to_ragged, None, spec, ws - 1)
    # nothing was left half-started: this collective pairs with the same one on every rank
    assert _same(ragged_to_replicate(local, spec), full)


def run_in_subgroup(rank, world_size):
    """Ranks 1.. form a group; `rank` in the spec is the rank inside that group."""
    group = dist.new_group(ranks=list(range(1, world_size)))
    checks = 0
    if rank > 0:
        group_ws, group_rank = world_size - 1, dist.get_rank(group)
        assert group_rank == rank - 1
        full = torch.arange(35, dtype=torch.int64).reshape(5, 7)
        src = RaggedShard((5, 7), 7, (0,) * (group_ws - 1) + (5,))
        dst = RaggedShard.even((5, 7), 3, group_ws)
        local = shard_tensor(full, src, group_rank)
        assert _same(ragged_to_replicate(local, src, group=group), full)
        moved = ragged_to_ragged(local, src, dst, group=group)
        assert _same(moved, shard_tensor(full, dst, group_rank))
        gathered = ragged_to_root(moved, dst, 0, group=group)
        assert _same(root_to_ragged(gathered, src, 0, group=group, dtype=full.dtype,
                                    device="cpu"), local)
        checks = 4
    dist.barrier()
    dist.destroy_process_group(group)
    assert checks == (0 if rank == 0 else 4)


POOL_WORLDS = [2, 3, 4]  # (conftest.py's `pool`, once per size)


def test_round_trips(pool):
    checks = pool.run(run_round_trips, 40)
    assert len(set(checks)) == 1 and checks[0] >= 40 * len(DTYPES) * (3 + 2 * pool.world_size)


def test_async_matches_sync(pool):
    pool.run(run_async, 30)


def test_batched_roots_round_trip(pool):
    checks = pool.run(run_batched, 12)
    assert len(set(checks)) == 1 and checks[0] > 12, checks


def test_errors_before_any_collective(pool):
    pool.run(run_errors)


def test_subgroup_ranks(pool):
    pool.run(run_in_subgroup)
