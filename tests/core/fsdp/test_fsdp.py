"""fully_shard on gloo with 2, 3 and 4 ranks: parity with single-process training of the same
global batch, zero-copy collectives, prefetch order, the awkward cases, and bad input."""
import contextlib
import itertools
import types

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from compare import relative
import fsdp_models as fm
from vescale_engine import optim as vopt
from vescale_engine.optim import adamw as adamw_module
from vescale_engine.optim.clip import clip_grad_norm_
from vescale_engine.shard.stats import STATS
from vescale_engine.fsdp import (MixedPrecisionPolicy, full_state_dict, fully_shard,
                                 gathered_parameters, no_sync, sharded_parameters,
                                 sharded_state_dict, unit_of)
from vescale_engine.shard.ragged import ragged_to_replicate
from vescale_engine.shard.ragged_dtensor import RaggedDTensor

GLOBAL_BATCH = 24
STEPS = 3
LR = dict(lr=1e-3, eps=1e-6, weight_decay=0.01)
# fp32 parity: losses and all parameters together to 1e-6 relative. A single small tensor (a
# LayerNorm bias a few steps from its zero init) can sit higher: Adam divides round-off-sized
# gradient differences by their own tiny magnitude, whatever the summation order.
PER_TENSOR = 5e-5


POOL_WORLDS = [2, 3, 4]  # (conftest.py's `pool`, once per size)


def shard_model(model, **kwargs):
    for unit in fm.units_of(model):
        fully_shard(unit, **kwargs)
    return fully_shard(model, **kwargs)


def reference_step(model, opt, kind, step):
    idx, tgt = fm.batch(kind, step, GLOBAL_BATCH)
    loss = model(idx, tgt)
    loss.backward()
    for p in model.parameters():  # data parallel semantics: an unused parameter gets zeros
        if p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    return loss.item()


def sharded_step(model, opt, kind, step, rank, world, accumulation=1, use_no_sync=False,
                 late_no_sync=False):
    """One optimizer step over this rank's share of the global batch. `late_no_sync`: the
    micro-steps before the last enter no_sync from a hook inside their backward, after the root
    unit's backward has begun (as a hook-driven trainer might)."""
    idx, tgt = fm.batch(kind, step, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // world
    idx, tgt = idx[rank * per_rank:(rank + 1) * per_rank], tgt[rank * per_rank:(rank + 1) * per_rank]
    micro = per_rank // accumulation
    total = 0.0
    for k in range(accumulation):
        sync = not use_no_sync or k == accumulation - 1
        with contextlib.nullcontext() if sync else no_sync(model):
            loss = model(idx[k * micro:(k + 1) * micro], tgt[k * micro:(k + 1) * micro])
            late = no_sync(model) if late_no_sync and k < accumulation - 1 else None
            if late is not None:
                loss.register_hook(lambda g: (late.__enter__(), g)[1])
            (loss / accumulation).backward()
            if late is not None:
                late.__exit__(None, None, None)
        total += loss.item() / accumulation
    opt.step()
    opt.zero_grad()
    mean = torch.tensor(total)
    dist.all_reduce(mean)
    return mean.item() / world


def compare(model, reference):
    """Per tensor relative error, and over all parameters together."""
    full = full_state_dict(model)
    ref = reference.state_dict()
    per_tensor = {k: relative(full[k], ref[k]) for k in ref}
    diff = torch.cat([(full[k] - ref[k]).flatten() for k in ref])
    whole = diff.norm().item() / torch.cat([ref[k].flatten() for k in ref]).norm().item()
    return whole, max(per_tensor.values()), max(per_tensor, key=per_tensor.get)


def run_parity(rank, world, kind, optimizer, accumulation, use_no_sync, granularity,
               native=False):
    reference = fm.make(kind)
    model = shard_model(fm.make(kind), granularity=granularity, native_collectives=native)
    ref_opt = torch.optim.AdamW(reference.parameters(), **LR)
    opt = (torch.optim.AdamW if optimizer == "torch" else vopt.AdamW)(model.parameters(), **LR)
    fused = adamw_module._FUSED
    if optimizer == "vescale-unfused":  # the op-by-op path, for torch builds without the kernel
        adamw_module._FUSED = None
    try:
        losses = []
        for step in range(STEPS):
            want = reference_step(reference, ref_opt, kind, step)
            got = sharded_step(model, opt, kind, step, rank, world, accumulation, use_no_sync)
            losses.append(abs(got - want) / abs(want))
    finally:
        adamw_module._FUSED = fused
    return (max(losses), *compare(model, reference))


# Every pair of settings (model, optimizer, accumulation, granularity) meets in at least one
# case, and in the native subset every model meets every optimizer and accumulation mode: nine
# cases instead of the full product's 36 (each costs a model and STEPS steps on every rank).
PARITY = [("gpt", "torch", (1, False), "rows:1"), ("gpt", "torch", (1, False), "rows:16"),
          ("moe", "vescale", (1, False), "tile:32x32"), ("gpt", "torch", (2, False), "rows:1"),
          ("gpt", "vescale", (2, False), "rows:16"), ("moe", "torch", (2, False), "tile:32x32"),
          ("moe", "vescale", (2, True), "rows:1"), ("moe", "torch", (2, True), "rows:16"),
          ("gpt", "vescale", (2, True), "tile:32x32")]
PARITY += [("gpt", "vescale-unfused", (2, True), "rows:16"), ("moe", "vescale-unfused", (1, False),
                                                                 "tile:32x32")]
# The backend's own collectives (what NCCL gets) on gloo: the same cases but one granularity
# fewer (uneven rows and 2-D tiles still cut the buffers unevenly), to keep the suite fast.
PARITY_NATIVE = [case for case in PARITY if case[3] != "rows:16"]


def test_parity_cases_cover_every_pair_of_settings():
    settings = [("gpt", "moe"), ("torch", "vescale"), ((1, False), (2, False), (2, True)),
                ("rows:1", "rows:16", "tile:32x32")]
    pairwise = [case for case in PARITY if case[1] != "vescale-unfused"]
    for x, y in itertools.combinations(range(4), 2):
        assert {(case[x], case[y]) for case in pairwise} == \
            set(itertools.product(settings[x], settings[y])), (x, y)
    for y in (1, 2):
        assert {(case[0], case[y]) for case in PARITY_NATIVE if case[1] != "vescale-unfused"} \
            == set(itertools.product(settings[0], settings[y])), y


def parity_rank(rank, world, native):
    results = []
    before = STATS.native
    for kind, optimizer, (accumulation, use_no_sync), granularity in (
            PARITY_NATIVE if native else PARITY):
        if accumulation > 1 and (GLOBAL_BATCH // world) % accumulation:
            continue
        results.append(((kind, optimizer, accumulation, use_no_sync, granularity),
                        run_parity(rank, world, kind, optimizer, accumulation, use_no_sync,
                                   granularity, native)))
    return results, STATS.native - before


@pytest.mark.parametrize("path", ["exchange", "native"])
def test_parity_with_single_process(pool, path):
    results, native_calls = pool.run(parity_rank, path == "native", timeout=900)[0]
    assert len(results) == len(PARITY if path == "exchange" else PARITY_NATIVE)
    # the spy: which collectives ran (gloo takes the exchange unless asked for its own)
    assert (native_calls > 0) == (path == "native"), native_calls
    for config, (loss, whole, worst, name) in results:
        assert loss < 1e-6, (config, "loss", loss)
        assert whole < 1e-6, (config, "parameters", whole)
        assert worst < PER_TENSOR, (config, name, worst)


# ------------------------------------------------------------------ zero copy and prefetch

def collective_path_rank(rank, world):
    model = shard_model(fm.make("gpt"))
    opt = vopt.AdamW(model.parameters(), **LR)
    STATS.reset()
    STATS.record = True
    for step in range(2):
        if step == 1:
            STATS.events.clear()
        sharded_step(model, opt, "gpt", step, rank, world)
    STATS.record = False
    events = list(STATS.events)
    # The full buffers are where the parameters live while unsharded, and where autograd
    # wrote the gradients: check the views' addresses against the buffers' storage.
    block = unit_of(model.blocks[0])
    buf = block.buffers[0]
    buf.all_gather(async_op=False)
    for p in block.params:
        if p.buffer is buf:
            view = buf.full_view(p.index)
            assert view.untyped_storage().data_ptr() == buf.full.untyped_storage().data_ptr()
            assert p.unsharded.data_ptr() == view.data_ptr()
    block.reshard()
    units = [unit_of(m).name for m in model.blocks]
    return STATS.bytes_copied, STATS.all_gathers, STATS.reduce_scatters, events, units


def test_zero_copy_and_prefetch_order(pool):
    copied, gathers, scatters, events, units = pool.run(collective_path_rank)[0]
    assert copied == 0
    assert gathers > 0 and scatters > 0

    def first(kind, unit, after=-1):
        return next(i for i, e in enumerate(events) if i > after and e[0] == kind and
                    (e[1] == unit or e[1].startswith(unit + "[")))

    # Forward (second step): block k+1's all-gather is issued before block k's forward runs.
    for k in range(len(units) - 1):
        assert first("all_gather", units[k + 1]) < first("forward", units[k]), events
    # Backward: block k's all-gather for backward is issued before block k+1's backward ends,
    # i.e. before block k's own backward starts, while block k+1 still computes.
    last_forward = max(i for i, e in enumerate(events) if e[0] == "forward")
    for k in range(len(units) - 1):
        regather = first("all_gather", units[k], after=last_forward)
        assert regather < first("backward", units[k]), events
        assert first("backward", units[k + 1]) < regather, events
    # The last block of the forward stays gathered into the backward, which starts with it.
    last = units[-1]
    assert not any(e[0] in ("reshard", "all_gather") and e[1].split("[")[0] == last
                   for e in events[first("forward", last):first("post_backward", last)]), events


def reuse_distance_rank(rank, world):
    """max_reuse_distance (DeepSpeed's stage3_max_reuse_distance): for each setting, which
    blocks stayed gathered from forward into backward, all-gathers per step, and parity."""
    block_numel = sum(p.numel() for p in fm.make("gpt").blocks[0].parameters())
    out = {}
    for keep in (1, 2, 4):  # the last `keep` blocks should stay gathered (4: all of them)
        distance = 0 if keep == 1 else 2 * (keep - 1) * block_numel + 1
        reference, model = fm.make("gpt"), shard_model(fm.make("gpt"),
                                                      max_reuse_distance=distance)
        ref_opt = torch.optim.AdamW(reference.parameters(), **LR)
        opt = vopt.AdamW(model.parameters(), **LR)
        losses = []
        for step in range(STEPS):
            STATS.reset()
            STATS.record = step == STEPS - 1
            want = reference_step(reference, ref_opt, "gpt", step)
            got = sharded_step(model, opt, "gpt", step, rank, world)
            losses.append(abs(got - want) / abs(want))
        STATS.record = False
        units = [unit_of(m).name for m in model.blocks]
        stayed = []
        for name in units:
            mine = [e[0] for e in STATS.events if e[1].split("[")[0] == name]
            between = mine[mine.index("forward"):mine.index("post_backward")]
            stayed.append(not any(e in ("reshard", "all_gather") for e in between))
        out[keep] = (stayed, STATS.all_gathers, max(losses), compare(model, reference)[0])
    return out


def test_max_reuse_distance_keeps_the_nearest_units_gathered_into_backward(pool):
    out = pool.run(reuse_distance_rank)[0]
    for keep, (stayed, gathers, loss, whole) in out.items():
        assert stayed == [False] * (4 - keep) + [True] * keep, (keep, stayed)
        assert loss < 1e-6 and whole < 1e-6, (keep, loss, whole)
    # one all-gather per buffer saved for every block kept gathered into backward
    saved = out[1][1] - out[4][1]
    assert saved > 0 and saved == 3 * (out[1][1] - out[2][1]), {k: v[1] for k, v in out.items()}


def exchange_rank(rank, world):
    """gloo's collectives replaced by point-to-point exchanges: the same results as gloo's own
    all-gather and reduce-scatter, with several of both in flight and waited in any order, in
    the whole group and in subgroups (of one rank, too)."""
    from vescale_engine.shard import collectives
    S = 1000 + 7 * world
    halves = [list(range(0, world, 2)), list(range(1, world, 2))]
    subgroups = [dist.new_group(ranks) for ranks in halves]  # every rank creates every group
    mine = subgroups[rank % 2]
    results = {}
    for label, group in (("world", dist.group.WORLD), ("half", mine)):
        W, r = dist.get_world_size(group), dist.get_rank(group)
        assert collectives.uses_exchange(group, torch.zeros(1))
        assert not collectives.uses_exchange(group, torch.zeros(1), native=True)
        # Integers in float64: every summation order gives the same exact sums.
        shards = [torch.arange(S, dtype=torch.float64) * (r + 1) + 10 * k for k in range(3)]
        fulls = [torch.arange(W * S, dtype=torch.float64) * (r + 2) - k for k in range(3)]
        gathered = [torch.full((W * S,), float("nan"), dtype=torch.float64) for _ in range(3)]
        reduced = [torch.full((S,), float("nan"), dtype=torch.float64) for _ in range(3)]
        handles = []
        for k in range(3):  # gathers and reduce-scatters interleaved, all in flight at once
            handles.append(collectives.all_gather(gathered[k], shards[k], group))
            handles.append(collectives.reduce_scatter(reduced[k], fulls[k], group))
        for h in reversed(handles):
            h.wait()
        want_gathered, want_reduced = [], []
        for k in range(3):
            want = torch.empty(W * S, dtype=torch.float64)
            dist.all_gather_into_tensor(want, shards[k], group=group)
            want_gathered.append(want)
            want = torch.empty(S, dtype=torch.float64)
            dist.reduce_scatter_tensor(want, fulls[k].clone(), group=group)
            want_reduced.append(want)
        # The caller's shard may already be its own range of the full buffer (mixed precision).
        in_place = torch.zeros(W * S, dtype=torch.float64)
        in_place[r * S:(r + 1) * S] = shards[0]
        collectives.all_gather(in_place, in_place[r * S:(r + 1) * S], group, async_op=False)
        results[label] = (
            all(torch.equal(a, b) for a, b in zip(gathered, want_gathered)),
            all(torch.equal(a, b) for a, b in zip(reduced, want_reduced)),
            torch.equal(in_place, want_gathered[0]), W)
    for label, (gathered, reduced, in_place, W) in results.items():
        assert gathered and reduced and in_place, (rank, label, W)
    assert results["half"][3] == len(range(rank % 2, world, 2))


def test_gloo_collectives_run_as_exchanges_with_gloos_results(pool):
    pool.run(exchange_rank)



# ------------------------------------------------------------------ the awkward cases

class Twice(torch.nn.Module):
    """A GPT variant whose blocks use checkpointing, a frozen position table, a buffer, and
    one block called twice in a forward."""

    def __init__(self, checkpointed):
        super().__init__()
        self.gpt = fm.make("gpt")
        self.gpt.wpe.weight.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(0.5))
        self.checkpointed = checkpointed

    def forward(self, idx, targets):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1])) * self.scale
        for i, block in enumerate(list(g.blocks) + [g.blocks[1]]):  # block 1 runs twice
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        logits = g.head(g.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def awkward_rank(rank, world, checkpointed):
    torch.manual_seed(0)
    reference = Twice(checkpointed)
    torch.manual_seed(0)
    model = Twice(checkpointed)
    for block in model.gpt.blocks:
        fully_shard(block)
    fully_shard(model)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, **LR)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **LR)
    losses = []
    for step in range(STEPS):
        want = reference_step(reference, ref_opt, "gpt", step)
        got = sharded_step(model, opt, "gpt", step, rank, world)
        losses.append(abs(got - want) / want)
    frozen = dict(sharded_parameters(model))["gpt.wpe.weight"]
    assert frozen.sharded.grad is None and not frozen.sharded.requires_grad
    loss, (whole, worst, name) = max(losses), compare(model, reference)
    assert loss < 1e-6 and whole < 1e-6 and worst < PER_TENSOR, (loss, whole, worst, name)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_tied_frozen_buffers_checkpointing_and_a_block_called_twice(pool, checkpointed):
    pool.run(awkward_rank, checkpointed)


def grads_in_place_rank(rank, world):
    """Where backward puts full gradients: over the parameters (default, one full-size buffer
    per unit), or in a separate buffer (grads_in_place=False, and always under no_sync, even
    one entered mid-backward). All train like the single-process reference."""
    out = {}
    for in_place, mode in ((True, "sync"), (False, "sync"), (True, "no_sync"),
                           (True, "late no_sync")):
        reference, model = fm.make("gpt"), shard_model(fm.make("gpt"), grads_in_place=in_place)
        ref_opt = torch.optim.AdamW(reference.parameters(), **LR)
        opt = vopt.AdamW(model.parameters(), **LR)
        separate = []  # bytes of separate full-gradient storage, seen as each gradient lands
        gaps = []
        for step in range(STEPS):
            if step == 1:  # the full-shape parameters exist after the first step
                for _, p in sharded_parameters(model):
                    if p.sharded.requires_grad:
                        p.unsharded.register_post_accumulate_grad_hook(
                            lambda t, buf=p.buffer: separate.append(
                                buf.unreduced.bytes_held))
            want = reference_step(reference, ref_opt, "gpt", step)
            got = sharded_step(model, opt, "gpt", step, rank, world, 1 if mode == "sync" else 2,
                               mode == "no_sync", mode == "late no_sync")
            gaps.append(abs(got - want) / want)
        out[(in_place, mode)] = (max(gaps), compare(model, reference)[0], max(separate))
    for (in_place, mode), (loss, whole, separate_bytes) in out.items():
        assert loss < 1e-6 and whole < 1e-6, (in_place, mode, loss, whole)
        if mode != "late no_sync":  # there the root's gradients land in place, then move
            assert (separate_bytes == 0) == (in_place and mode == "sync"), (in_place, mode)


def test_gradients_in_place_of_parameters(pool):
    pool.run(grads_in_place_rank)


class DetachedReuse(torch.nn.Module):
    """Backward reads `w` through a detached use after w's own gradient is complete."""

    def __init__(self):
        super().__init__()
        self.v = torch.nn.Parameter(torch.randn(8, 8) * 0.3)
        self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x):
        h = torch.tanh(x @ self.v) @ self.w.detach()
        return (h @ self.w).square().mean()


def detached_reuse_rank(rank, world):
    x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    for in_place in (True, False):
        torch.manual_seed(0)
        reference = DetachedReuse()
        torch.manual_seed(0)
        model = fully_shard(DetachedReuse(), grads_in_place=in_place)
        reference(x).backward()
        try:
            model(x[rank * 4:(rank + 1) * 4]).backward()
        except RuntimeError as err:
            out[in_place] = str(err)
            continue
        for m in (model, reference):
            torch.optim.SGD(m.parameters(), lr=1.0).step()
        out[in_place] = compare(model, reference)[0]
    return out


def test_a_stale_parameter_read_fails_loudly_unless_grads_in_place_is_off(pool):
    out = pool.run(detached_reuse_rank)[0]
    assert "modified by an inplace operation" in out[True], out
    assert out[False] < 1e-6, out


def mixed_precision_rank(rank, world, native):
    reference = fm.make("gpt")
    model = shard_model(fm.make("gpt"), native_collectives=native, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    unit = unit_of(model.blocks[0])
    ref_opt = torch.optim.AdamW(reference.parameters(), **LR)
    opt = vopt.AdamW(model.parameters(), **LR)
    gaps = []
    for step in range(STEPS):
        want = reference_step(reference, ref_opt, "gpt", step)
        got = sharded_step(model, opt, "gpt", step, rank, world)
        gaps.append(abs(got - want) / want)
    masters = {p.sharded.dtype for p in unit.params}
    return max(gaps), unit.buffers[0].full.dtype, masters, compare(model, reference)[0]


@pytest.mark.parametrize("path", ["exchange", "native"])
def test_mixed_precision(pool, path):
    gap, full_dtype, masters, whole = pool.run(mixed_precision_rank, path == "native")[0]
    assert full_dtype == torch.bfloat16 and masters == {torch.float32}
    assert gap < 2e-2 and whole < 5e-2  # bf16 compute tracks fp32 closely, not exactly


def unused_expert_rank(rank, world):
    """Experts that no token of this step reaches on any rank: no hang, zero gradient."""
    model = shard_model(fm.make("moe"))
    idx, tgt = fm.batch("moe", 0, GLOBAL_BATCH // world)
    for layer in model.layers:
        with torch.no_grad():  # route every token to expert 0
            layer.router.weight.zero_()
    model(idx, tgt).backward()
    grads = {fqn: p.sharded.grad for fqn, p in sharded_parameters(model)}
    unused = [g for fqn, g in grads.items() if ".experts.3." in fqn]
    used = [g for fqn, g in grads.items() if ".experts.0.up" in fqn]
    return all(g is not None and not g.any() for g in unused), sum(g.abs().sum().item()
                                                                    for g in used)


def test_unused_experts_get_zero_gradients_without_hanging(pool):
    results = pool.run(unused_expert_rank, timeout=120)
    assert all(zero for zero, _ in results)
    assert sum(used for _, used in results) > 0


def clip_rank(rank, world):
    reference, model = fm.make("gpt"), shard_model(fm.make("gpt"))
    idx, tgt = fm.batch("gpt", 0, GLOBAL_BATCH)
    reference(idx, tgt).backward()
    per = GLOBAL_BATCH // world
    model(idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per]).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    got = clip_grad_norm_(model.parameters(), 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1.0)
    opt.step()
    ref_opt.step()
    norm_gap, whole = abs(got.item() - want.item()) / want.item(), compare(model, reference)[0]
    assert norm_gap < 1e-6 and whole < 1e-6


def test_global_grad_norm_and_clipping(pool):
    pool.run(clip_rank)


def _gather_peak(call):
    """(result of call(), the most full buffers alive at once while it gathered): a spy on
    every master all-gather counts the earlier full buffers whose storage is still alive."""
    from torch.multiprocessing.reductions import StorageWeakRef
    import vescale_engine.fsdp.state_dict as fsdp_module
    original, alive, peak = fsdp_module.all_gather_master, [], [0]

    def spy(full, buf):
        alive[:] = [ref for ref in alive if not ref.expired()]
        alive.append(StorageWeakRef(full.untyped_storage()))
        peak[0] = max(peak[0], len(alive))
        original(full, buf)
    fsdp_module.all_gather_master = spy
    try:
        return call(), peak[0]
    finally:
        fsdp_module.all_gather_master = original


def _inside(model):
    """What gathered_parameters shows: {fqn: (shape, device type, value)}."""
    return {k: (tuple(v.shape), v.device.type, v.detach().clone())
            for k, v in model.named_parameters()}


def gathered_rank(rank, world):
    reference, model = fm.make("gpt"), shard_model(fm.make("gpt"))
    ref = reference.state_dict()
    buffers = sum(len(unit_of(m).buffers) for m in model.modules() if unit_of(m) is not None)
    out = {}
    for rank0_only, cpu_offload in itertools.product([False, True], [False, True]):
        keeps = not rank0_only or rank == 0
        sd, peak = _gather_peak(lambda: full_state_dict(model, rank0_only=rank0_only,
                                                         cpu_offload=cpu_offload))
        same = sorted(sd) == sorted(ref) and all(torch.equal(sd[k], ref[k]) for k in ref) \
            if keeps else sd == {}
        on_cpu = all(v.device.type == "cpu" for v in sd.values())
        out["state", rank0_only, cpu_offload] = (same, on_cpu, peak)

        def inside():
            with gathered_parameters(model, rank0_only=rank0_only, cpu_offload=cpu_offload):
                return _inside(model)
        seen, peak = _gather_peak(inside)
        same = all(seen[k][0] == tuple(reference.get_parameter(k).shape) and
                   torch.equal(seen[k][2], reference.get_parameter(k)) for k in seen) \
            if keeps else all(isinstance(v, RaggedDTensor) for _, _, v in seen.values())
        out["inside", rank0_only, cpu_offload] = (same, peak)
    for cpu_offload in (False, True):
        with gathered_parameters(model, writeback=True, cpu_offload=cpu_offload):
            full_shape = tuple(model.blocks[0].fc.weight.shape)
            with torch.no_grad():
                model.blocks[0].fc.weight.fill_(0.25 + cpu_offload)
        full = full_state_dict(model)
        out["writeback", cpu_offload] = (full_shape, bool((full["blocks.0.fc.weight"] ==
                                                            0.25 + cpu_offload).all()))
    try:
        with gathered_parameters(model, writeback=True, rank0_only=True):
            pass
    except ValueError as err:
        out["writeback rank0_only"] = str(err)
    weight = model.blocks[0].fc.weight  # between steps: a RaggedDTensor of the global shape
    sharded_shape = (tuple(weight.shape), tuple(weight.to_local().shape))
    rebuilt = {fqn: ragged_to_replicate(local, spec)
               for fqn, (local, spec) in sharded_state_dict(model).items()}
    same = all(torch.equal(rebuilt[k], full[k]) for k in rebuilt)
    out["sharded"] = (sharded_shape, same,
                      sorted(rebuilt) == sorted(k for k in full if k != "head.weight"))
    assert buffers > 1
    for rank0_only, cpu_offload in itertools.product([False, True], [False, True]):
        keeps = not rank0_only or rank == 0
        same, on_cpu, peak = out["state", rank0_only, cpu_offload]
        assert same and on_cpu and peak == 1, (rank, rank0_only, cpu_offload, peak)
        same, peak = out["inside", rank0_only, cpu_offload]
        assert same, (rank, rank0_only, cpu_offload)
        assert peak == (buffers if keeps and not cpu_offload else 1), (rank, peak)
    for cpu_offload in (False, True):
        assert out["writeback", cpu_offload] == ((256, 64), True)
    assert out["writeback rank0_only"] == (
        "gathered_parameters: writeback=True needs the full parameters on every rank; it "
        "cannot be combined with rank0_only=True")
    sharded_shape, same, names = out["sharded"]
    assert sharded_shape[0] == (256, 64) and len(sharded_shape[1]) == 1 and same
    assert names  # the tied head is the embedding, listed once


def test_gathered_parameters_and_sharded_state_dict(pool):
    """Every option of full_state_dict and gathered_parameters gives the unsharded values, and
    gathers one DBuffer at a time: only gathered_parameters without cpu_offload, on a rank
    that keeps the result, holds every full buffer (as the parameters' storage)."""
    pool.run(gathered_rank)


def hsdp_rank(rank, world, native, avg=False):
    """`avg`: reduce as on NCCL, with AVG inside both collectives (gloo has it in torch 2.13)
    and no divide after."""
    from torch.distributed.device_mesh import init_device_mesh
    from vescale_engine.shard import collectives
    replicas = 2 if world % 2 == 0 else world  # odd worlds: every rank a replica (DDP-like)
    mesh = init_device_mesh("cpu", (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))
    reference = fm.make("gpt")
    avg_backends = collectives._AVG_BACKENDS
    if avg:
        collectives._AVG_BACKENDS = frozenset({"gloo"})
    try:
        model = shard_model(fm.make("gpt"), mesh=mesh, native_collectives=native)
    finally:
        collectives._AVG_BACKENDS = avg_backends
    reduction = unit_of(model.blocks[0]).buffers[0].comm.reduction
    ops = (reduction.reduce_scatter_op, reduction.all_reduce_op, reduction.post_divide)
    ref_opt = torch.optim.AdamW(reference.parameters(), **LR)
    opt = vopt.AdamW(model.parameters(), **LR)
    losses = []
    for step in range(STEPS):
        STATS.reset()
        STATS.record = step == STEPS - 1
        want = reference_step(reference, ref_opt, "gpt", step)
        losses.append(abs(sharded_step(model, opt, "gpt", step, rank, world) - want) / want)
    STATS.record = False
    whole = compare_hsdp(model, reference, mesh)
    return (max(losses), whole, unit_of(model.blocks[0]).buffers[0].world_size,
            overlapped_all_reduces(STATS.events, [unit_of(m).name for m in model.blocks]),
            STATS.native, ops)


def overlapped_all_reduces(events, units):
    """Per unit: is its replicas' all-reduce issued before, and finished after, another unit's
    post_backward (i.e. in flight while that unit's backward computed)?"""
    def unit(e):
        return e[1].split("[")[0]
    out = []
    for name in units:
        issued = min(i for i, e in enumerate(events) if e[0] == "all_reduce" and unit(e) == name)
        done = max(i for i, e in enumerate(events) if e[0] == "reduced" and unit(e) == name)
        out.append(any(e[0] == "post_backward" and unit(e) != name
                       for e in events[issued:done]))
    return out


def compare_hsdp(model, reference, mesh):
    with gathered_parameters(model):
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = reference.state_dict()
    return max(relative(full[k], ref[k]) for k in ref)


@pytest.mark.parametrize("path", ["exchange", "native", "native-avg"])
def test_hsdp_replicas(pool, path):
    loss, worst, shard_world, overlapped, native, (rs_op, ar_op, post) = pool.run(
        hsdp_rank, path != "exchange", path == "native-avg")[0]
    AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM
    want_rs = AVG if path == "native-avg" and shard_world > 1 else SUM
    assert (rs_op, ar_op) == (want_rs, AVG if path == "native-avg" else SUM)
    assert post == (1.0 if path == "native-avg" else pool.world_size)
    assert shard_world == (pool.world_size // 2 if pool.world_size % 2 == 0 else 1)
    assert loss < 1e-6 and worst < PER_TENSOR
    # the replicas' all-reduce of every block but the first (finished at the end of backward)
    # runs while the next unit's backward computes, not on the compute path
    assert overlapped[1:] == [True] * (len(overlapped) - 1), overlapped
    assert (native > 0) == (path != "exchange")


# ------------------------------------------------------------------ bad input

def bad_input_rank(rank, world):
    errors = {}
    cases = {
        "mixed devices": lambda: fully_shard(_mixed_devices()),
        "rank not in mesh": lambda: fully_shard(torch.nn.Linear(4, 4), mesh=_small_mesh(world)),
        "twice": lambda: fully_shard(fully_shard(torch.nn.Linear(4, 4))),
    }
    before = STATS.all_gathers + STATS.reduce_scatters
    for name, make in cases.items():
        try:
            make()
            errors[name] = None
        except (ValueError, RuntimeError, AssertionError) as err:  # (a second fully_shard:
            errors[name] = str(err)                                 # FSDP2's AssertionError)
    dist.barrier()
    return errors, STATS.all_gathers + STATS.reduce_scatters - before


def _mixed_devices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].to("meta")
    return model


def _small_mesh(world):
    """A mesh without rank 0 (a sub-mesh is fine for the ranks in it:
    tests/engine/test_tp_ep.py)."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh("cpu", list(range(1, world)))


def test_bad_input_fails_at_wrap_time(pool):
    errors, collectives = pool.run(bad_input_rank)[0]
    assert collectives == 0
    assert "1.weight is on the meta device but 0.weight is on cpu" in errors["mixed devices"]
    assert "rank 0 is not in the mesh" in errors["rank not in mesh"]
    assert "already applied" in errors["twice"]


def granularity_override_rank(rank, world):
    model = fm.make("gpt")
    fully_shard(model.blocks[0], granularity={"default": "element",
                                              "overrides": {"fc.*": "rows:16", "ln*": "tensor"}})
    blocks = {p.fqn: p.block for p in unit_of(model.blocks[0]).params}
    return blocks


def test_granularity_overrides_by_parameter_name(pool):
    blocks = pool.run(granularity_override_rank)[0]
    assert blocks["fc.weight"] == 16 * 64 and blocks["fc.bias"] == 16
    assert blocks["ln1.weight"] == 64 and blocks["qkv.weight"] == 1


# ------------------------------------------------------------------ host heap trimming

def test_heap_trim_waits_for_growth_past_the_warm_up_size(monkeypatch):
    """After the warm-up backwards, malloc_trim runs only once resident memory has grown past
    the largest warm-up size by GROWTH: not every step (page faults), not never (growth)."""
    from vescale_engine.shard import host_memory
    trims = []
    monkeypatch.setattr(host_memory, "_MALLOC_TRIM", lambda pad: trims.append(pad))
    sizes = iter([800, 1000, 980, 1000,     # warm-up: the limit becomes 1.1 x 1000
                  1050, 1099, 1101,         # the third one passes it
                  700, 900, 1099, 1200])
    monkeypatch.setattr(host_memory, "_resident_bytes", lambda: next(sizes))
    trimmer = host_memory._HeapTrimmer()
    trimmed = []
    for _ in range(11):
        before = len(trims)
        trimmer()
        trimmed.append(len(trims) > before)
    assert trimmed == [False] * 6 + [True] + [False] * 3 + [True]
    monkeypatch.setattr(host_memory, "_resident_bytes", lambda: None)  # cannot watch: every time
    trimmer()
    assert len(trims) == 3


# ------------------------------------------------------------------ closures

def closure_rank(rank, world):
    """torch.optim's closure convention on our optimizers: step() runs the closure with
    gradients enabled, steps on the gradients it made, and returns its loss."""
    from vescale_engine.optim.adamw8bit import AdamW8bit
    from vescale_engine.optim.muon import Muon
    makers = {"AdamW": lambda ps: vopt.AdamW(ps, **LR),
              "AdamW8bit": lambda ps: AdamW8bit(ps, block="rows:16"),
              "Muon": lambda ps: Muon(ps, lr=0.02)}
    out = {}
    for name, make in makers.items():
        model = shard_model(fm.make("gpt"), granularity="rows:16")
        opt = make(model.parameters())
        idx, tgt = fm.batch("gpt", 0, 4)
        before = full_state_dict(model)["blocks.0.fc.weight"]
        seen = []

        def closure():
            opt.zero_grad()
            loss = model(idx, tgt)
            loss.backward()
            seen.append(loss)
            return loss
        returned = opt.step(closure)
        moved = not torch.equal(full_state_dict(model)["blocks.0.fc.weight"], before)
        out[name] = (returned is seen[0], len(seen), moved)
    for name, (same_loss, calls, moved) in out.items():
        assert same_loss and calls == 1 and moved, name


def test_optimizers_follow_the_closure_convention(pool):
    pool.run(closure_rank)


# ------------------------------------------------------------------ backends and reductions

def test_the_tensors_device_picks_the_backend_and_the_path(monkeypatch):
    """Under NCCL the process group is "cpu:gloo,cuda:nccl": CPU tensors take gloo's exchange,
    CUDA tensors the native collectives; `native` forces gloo's own."""
    from vescale_engine.shard import collectives
    assert collectives.backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert collectives.backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert collectives.backend_for("gloo", "cuda") == "gloo"
    with pytest.raises(ValueError, match="no backend for cuda tensors"):
        collectives.backend_for("cpu:gloo", "cuda")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    cpu = torch.zeros(1)
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0))  # only its device is read
    assert collectives.uses_exchange(None, cpu)
    assert not collectives.uses_exchange(None, cpu, native=True)
    assert not collectives.uses_exchange(None, cuda)


def test_gradient_reduction_factors():
    """fp32/bf16: AVG in the collective where the backend has it (NCCL), else SUM and one
    divide; fp16: divide by the power of two nearest below sqrt(W) before, the rest after."""
    from vescale_engine.shard.collectives import gradient_reduction
    AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM
    nccl = gradient_reduction(torch.bfloat16, 8, 4, "nccl", "nccl")
    assert (nccl.pre_divide, nccl.reduce_scatter_op, nccl.all_reduce_op, nccl.post_divide) == \
        (1.0, AVG, AVG, 1.0)
    gloo = gradient_reduction(torch.float32, 8, 4, "gloo", "gloo")
    assert (gloo.reduce_scatter_op, gloo.all_reduce_op, gloo.post_divide) == (SUM, SUM, 32.0)
    exchange = gradient_reduction(torch.float32, 8, 1, "gloo", exchange=True)
    assert (exchange.reduce_scatter_op, exchange.post_divide) == (SUM, 8.0)
    mixed = gradient_reduction(torch.float32, 8, 4, "nccl", "gloo")  # AVG over shards only
    assert (mixed.reduce_scatter_op, mixed.all_reduce_op, mixed.post_divide) == (AVG, SUM, 4.0)
    for world, pre in ((2, 1), (4, 2), (64, 8), (1000, 16), (1024, 32)):
        fp16 = gradient_reduction(torch.float16, world, 1, "nccl")
        assert (fp16.pre_divide, fp16.reduce_scatter_op, fp16.post_divide) == \
            (pre, SUM, world / pre), world
    assert gradient_reduction(torch.float16, 1, 1, "nccl").post_divide == 1.0
    # a divide factor other than the group's size (experts over efsdp, divided by the dense
    # data-parallel size): SUM and one divide after, even where AVG exists
    experts = gradient_reduction(torch.bfloat16, 2, 1, "nccl", divide_factor=8)
    assert (experts.reduce_scatter_op, experts.post_divide) == (SUM, 8.0)
    assert gradient_reduction(torch.float32, 1, 1, "gloo", divide_factor=4).post_divide == 4.0
    assert gradient_reduction(torch.bfloat16, 8, 1, "nccl", divide_factor=8) == nccl.__class__(
        1.0, AVG, SUM, 1.0)  # the factor equal to the group: the average, as without it
    fp16 = gradient_reduction(torch.float16, 4, 1, "nccl", divide_factor=16)
    assert (fp16.pre_divide, fp16.post_divide) == (2.0, 8.0)
    with pytest.raises(ValueError, match="gradient_divide_factor"):
        gradient_reduction(torch.float32, 2, 1, "gloo", divide_factor=0)


def test_fp16_reduction_at_large_world_does_not_overflow_where_sum_then_divide_would():
    """1024 ranks, each with a loss-scaled fp16 gradient of 128 (and a tiny one, 2^-10):
    summing in fp16 then dividing overflows to inf; the pre/post factors keep the sum finite
    and give the average (exactly, for these powers of two) without losing the tiny one."""
    from vescale_engine.shard.collectives import gradient_reduction
    world = 1024
    grads = torch.tensor([128.0, 2.0 ** -10], dtype=torch.float16).expand(world, 2)

    def reduce(pre, post):  # what a SUM collective does in fp16, rank by rank
        total = torch.zeros(2, dtype=torch.float16)
        for g in grads:
            total += g / pre
        return total / post

    plan = gradient_reduction(torch.float16, world, 1, "nccl")
    assert torch.isinf(reduce(1, world)).any()  # sum then divide: 131072 > 65504
    assert torch.equal(reduce(plan.pre_divide, plan.post_divide), grads[0])
