"""Distributed Muon on 1, 2, 3 and 4 gloo ranks: parameters after k steps equal torch.optim.Muon
(+ torch.optim.AdamW for the rest) in one process (bf16 Newton-Schulz, as torch), the fp32 mode
equals a float64 single-process reference, stacked 3-D experts are orthogonalized matrix by
matrix, the "tensor" mode needs no communication, roots are balanced, gathers run ahead of
Newton-Schulz, the engine builds it from a config, and bad input fails clearly."""
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from compare import relative
import fsdp_models as fm
from dist_harness import value_errors
from vescale_engine import initialize
from vescale_engine.fsdp import full_state_dict, fully_shard, sharded_parameters
from vescale_engine.shard.ragged import RaggedShard, ragged_to_replicate
from vescale_engine.optim import Muon, sharding_granularity
from vescale_engine.optim.muon import (DEFAULT_ADAMW_PATTERNS, ROUNDS_IN_FLIGHT, is_muon_matrix,
                                       ns_flops)

GLOBAL_BATCH = 12
STEPS = 3
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
OURS_ADAMW = dict(adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                  adamw_weight_decay=ADAMW["weight_decay"])


POOL_WORLDS = [1, 2, 3, 4]  # (conftest.py's `pool`, once per size)


class Stacked(nn.Module):
    """A dense matrix, a bias, a stacked 3-D expert tensor and a head (AdamW by name)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(40, 24) * 0.2)
        self.bias = nn.Parameter(torch.zeros(24))
        self.experts = nn.Parameter(torch.randn(4, 24, 16) * 0.2)
        self.head = nn.Linear(16, 10, bias=False)

    def forward(self, x, targets):
        y = torch.tanh(x @ self.w + self.bias)
        h = torch.tanh(torch.einsum("bi,eio->bo", y, self.experts))
        return F.cross_entropy(self.head(h), targets)


def make(kind, dtype=torch.float32):
    torch.manual_seed(0)
    model = fm.make(kind) if kind != "stacked" else Stacked()
    return model.to(dtype)


def batch(kind, step, size=GLOBAL_BATCH):
    if kind != "stacked":
        return fm.batch(kind, step, size)
    gen = torch.Generator().manual_seed(99 + step)
    return torch.randn(size, 40, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def ns64(g, coefficients=(3.4445, -4.7750, 2.0315), steps=5, eps=1e-7, dtype=torch.float64):
    """The test's own Newton-Schulz (the textbook quintic iteration), float64 by default."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


class Reference:
    """One process, no sharding: torch.optim.Muon on the matrices (its own bf16 Newton-Schulz,
    or the test's in float64 when `exact` is True, in float32 when it is "fp32"),
    torch.optim.AdamW on the rest; stacked 3-D tensors matrix by matrix (torch's Muon takes
    2-D only, so the same algorithm written out)."""

    def __init__(self, model, exact, muon_kwargs):
        self.model, self.exact, self.kw = model, exact, muon_kwargs
        named = list(model.named_parameters())
        flat = [p for n, p in named if is_muon_matrix(n, p.shape) and p.ndim == 2]
        self.stacked = [p for n, p in named if is_muon_matrix(n, p.shape) and p.ndim == 3]
        rest = [p for n, p in named if not is_muon_matrix(n, p.shape)]
        self.muon = torch.optim.Muon(flat, **muon_kwargs)
        self.adamw = torch.optim.AdamW(rest, **ADAMW)
        self.momentum = [torch.zeros_like(p) for p in self.stacked]

    def step(self):
        import torch.optim._muon as tm
        original = tm._zeropower_via_newtonschulz
        if self.exact:
            dtype = torch.float32 if self.exact == "fp32" else torch.float64
            tm._zeropower_via_newtonschulz = lambda g, coeff, steps, eps: ns64(g, coeff, steps,
                                                                              eps, dtype)
        try:
            self.muon.step()
        finally:
            tm._zeropower_via_newtonschulz = original
        self.adamw.step()
        kw = {**dict(momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn=None),
              **self.kw}
        with torch.no_grad():
            for p, buf in zip(self.stacked, self.momentum):
                buf.lerp_(p.grad, 1 - kw["momentum"])
                update = p.grad.lerp(buf, kw["momentum"]) if kw["nesterov"] else buf
                p.mul_(1 - kw["lr"] * kw["weight_decay"])
                for e in range(p.shape[0]):
                    o = ns64(update[e], dtype=torch.float32 if self.exact == "fp32" else
                             torch.float64) if self.exact else tm._zeropower_via_newtonschulz(
                        update[e], (3.4445, -4.7750, 2.0315), 5, 1e-7)
                    p[e].add_(o, alpha=-tm._adjust_lr(kw["lr"], kw["adjust_lr_fn"],
                                                       p[e].shape))
        self.model.zero_grad()


def shard(model, granularity):
    for unit in (fm.units_of(model) if not isinstance(model, Stacked) else []):
        fully_shard(unit, granularity=granularity)
    return fully_shard(model, granularity=granularity)


def local_batch(kind, step, rank, world):
    idx, tgt = batch(kind, step)
    per = GLOBAL_BATCH // world
    return idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per]


def give_gradients(model, reference):
    """The sharded model's gradients, gathered whole, become the reference's."""
    mine = dict(sharded_parameters(model))
    for name, p in reference.named_parameters():
        sp = mine[name]
        spec = RaggedShard(sp.shape, sp.block,
                           sp.buffer.layout.placements[sp.index].local_units(sp.buffer.world_size))
        p.grad = ragged_to_replicate(sp.sharded.grad.to_local(), spec).clone()


def run_parity(rank, world, kind, ns_dtype, mode, granularity, muon_kwargs, record=False,
               rounds_in_flight=ROUNDS_IN_FLIGHT):
    exact = ns_dtype == "fp32"
    reference = Reference(make(kind, torch.float64 if exact else torch.float32), exact,
                          {**HYPER, **muon_kwargs})
    policy = sharding_granularity({"type": "Muon", "params": {"mode": mode}},
                                  {"default": granularity, "overrides": {}})
    model = shard(make(kind), policy)
    opt = Muon(model.parameters(), **HYPER, **muon_kwargs, ns_dtype=ns_dtype, mode=mode,
               **OURS_ADAMW)
    opt.record_trace = record
    opt.rounds_in_flight = rounds_in_flight
    sent = []
    for step in range(STEPS):
        model(*local_batch(kind, step, rank, world)).backward()
        if exact:  # float64 reference: its own float64 forward and backward
            idx, tgt = batch(kind, step)
            reference.model(idx.double() if idx.is_floating_point() else idx, tgt).backward()
        else:  # torch's bf16 Newton-Schulz flips roundings on fp32 round-off differences of the
            # gradients (which test_fsdp bounds): give it the very gradients we step with
            give_gradients(model, reference.model)
        reference.step()
        opt.step()
        opt.zero_grad()
        total = torch.tensor(float(opt.bytes_sent))
        dist.all_reduce(total)
        sent.append(total.item())
    full, ref = full_state_dict(model), reference.model.state_dict()
    per_tensor = {k: relative(full[k], ref[k]) for k in ref}
    whole = relative(torch.cat([full[k].flatten() for k in ref]),
                     torch.cat([ref[k].flatten() for k in ref]))
    roots = [(m.param, m.root, m.one_hot) for m in opt._matrices]
    return whole, max(per_tensor.values()), max(per_tensor, key=per_tensor.get), sent, roots, \
        opt.ns_load, list(getattr(opt, "trace", []))


CASES = [  # kind, ns dtype, mode, granularity, torch.optim.Muon keyword arguments
    ("gpt", "bf16", "gather", "rows:1", {}),
    ("gpt", "bf16", "gather", "rows:16", {"adjust_lr_fn": "match_rms_adamw"}),
    ("gpt", "bf16", "tensor", "rows:1", {"nesterov": False, "adjust_lr_fn": "original"}),
    ("gpt", "fp32", "gather", "element", {}),
    ("gpt", "fp32", "tensor", "rows:1", {"adjust_lr_fn": "match_rms_adamw"}),
    ("stacked", "fp32", "gather", "rows:5", {}),
    ("stacked", "fp32", "tensor", "rows:1", {"nesterov": False}),
    ("stacked", "bf16", "gather", "element", {}),
]


def parity_rank(rank, world):
    return [(case, run_parity(rank, world, *case)) for case in CASES]


def test_parity_with_single_process_muon(pool):
    results = pool.run(parity_rank, timeout=900)
    communicated = []
    for (case, (whole, worst, name, sent, roots, load, _)), *others in zip(results[0],
                                                                          *results[1:]):
        kind, ns_dtype, mode, granularity, _ = case
        assert whole < 1e-5 and worst < 1e-5, (case, whole, worst, name)
        for _, other in others:  # every rank chose the same roots
            assert other[4] == roots
        gathered = any(not one_hot for _, _, one_hot in roots)
        if mode == "tensor" or pool.world_size == 1:
            assert not gathered, case
        assert (sent == [0.0] * STEPS) != gathered, (case, sent)  # bytes move iff gathered
        communicated.append(gathered)
    assert any(communicated) == (pool.world_size > 1)


# ------------------------------------------------------------------ roots, overlap, stacks

TRACED = [("stacked", "element", ROUNDS_IN_FLIGHT), ("gpt", "rows:1", ROUNDS_IN_FLIGHT),
          ("gpt", "rows:1", 1)]


def trace_rank(rank, world):
    return [run_parity(rank, world, kind, "bf16", "gather", granularity, {}, record=True,
                       rounds_in_flight=ahead) for kind, granularity, ahead in TRACED]


def check_trace(trace, roots, rank, world, ahead):
    """Per step: each of this rank's roots orthogonalized once; every round gathered and
    scattered once, in order; never more than `ahead` rounds gathered ahead of the round being
    orthogonalized, and (ahead > 1) the next round's gather overlapping it. Returns (matrices
    orthogonalized, most rounds in a step)."""
    orthogonalized, most = [], 0
    for step in range(STEPS):
        events = trace[step * len(trace) // STEPS:(step + 1) * len(trace) // STEPS]
        ns = [k for what, k in events if what == "ns"]
        orthogonalized += ns
        assert sorted(ns) == [k for k, (_, root, _) in enumerate(roots) if root == rank]
        rounds = [j for what, j in events if what == "scatter"]
        assert [j for what, j in events if what == "gather"] == rounds == \
            list(range(len(rounds)))
        in_flight = list(itertools.accumulate(
            {"gather": 1, "scatter": -1}.get(what, 0) for what, _ in events))
        assert max(in_flight, default=0) == min(ahead, len(rounds)), events
        for i, (what, k) in enumerate(events):
            if what == "ns" and not roots[k][2]:  # a gathered matrix of round j:
                assert events[i + 1][0] == "scatter", events  # its result goes right back
                j = events[i + 1][1]
                if j + 1 < len(rounds) and ahead > 1:  # and the next round's gather overlaps it
                    assert events.index(("gather", j + 1)) < i, events
        most = max(most, len(rounds))
    return orthogonalized, most


def test_roots_balance_flops_and_communication_runs_ahead(pool):
    results = pool.run(trace_rank)
    whole, worst, _, _, roots, load, _ = results[0][0]
    assert whole < 1e-5
    # 1 dense 40x24 matrix and 4 expert matrices 24x16: the stack is split into its matrices.
    assert len(roots) == 5 and [p for p, _, _ in roots].count(1) == 4
    costs = [ns_flops(40, 24, 5)] + [ns_flops(24, 16, 5)] * 4
    assert sum(load) == sum(costs)
    if pool.world_size > 1:  # greedy largest-first: no rank above another by more than one job
        assert max(load) - min(load) <= max(costs), load
        assert len({r for _, r, _ in roots}) == min(pool.world_size, 5)
    orthogonalized = []
    for case, (kind, _, ahead) in enumerate(TRACED):
        case_roots = results[0][case][4]
        assert results[0][case][0] < 1e-5
        most = 0
        for rank, ranks_results in enumerate(results):
            done, rounds = check_trace(ranks_results[case][-1], case_roots, rank,
                                       pool.world_size, ahead)
            most = max(most, rounds)
            if case == 0:
                orthogonalized += done
        if case == 0:  # the stacked model's dense matrix is split over ranks
            assert (most > 0) == (pool.world_size > 1)
        if kind == "gpt" and pool.world_size == 2:  # 2 rounds: more than 1 allowed ahead
            assert most > ahead or ahead == ROUNDS_IN_FLIGHT, (kind, ahead, most)
    assert sorted(orthogonalized) == sorted(list(range(5)) * STEPS)  # each once per step


# ------------------------------------------------------------------ engine and bad input

ENGINE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.0,  # the reference does not clip (unset: DeepSpeed's 1.0)
    "optimizer": {"type": "Muon", "params": {**HYPER, "ns_coefficients": [3.4445, -4.775, 2.0315],
                                             "adamw_lr": ADAMW["lr"],
                                             "adamw_betas": list(ADAMW["betas"]),
                                             "adamw_weight_decay": ADAMW["weight_decay"],
                                             "ns_dtype": "fp32"}},
    "vescale": {"wrap_policy": {"module_classes": ["Block"]}, "granularity": {"default": "rows:1"}},
}


def engine_rank(rank, world, mode):
    config = {**ENGINE, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
              "optimizer": {"type": "Muon", "params": {**ENGINE["optimizer"]["params"],
                                                       "mode": mode}}}
    # fp32 Newton-Schulz on both sides: bf16 would flip roundings on the gradients' fp32
    # round-off differences (the parity test above compares bf16 on identical gradients).
    reference = Reference(make("gpt"), "fp32", dict(HYPER))
    engine, opt, _, _ = initialize(model=make("gpt"), config=config)
    assert isinstance(opt, Muon) and opt.mode == mode
    for step in range(2):
        idx, tgt = fm.batch("gpt", step, GLOBAL_BATCH)
        reference.model(idx, tgt).backward()
        reference.step()
        loss = engine(*local_batch("gpt", step, rank, world))
        engine.backward(loss)
        engine.step()
    full, ref = full_state_dict(engine.module), reference.model.state_dict()
    one_hot = all(m.one_hot for m in opt._matrices)
    whole = relative(torch.cat([full[k].flatten() for k in ref]),
                     torch.cat([ref[k].flatten() for k in ref]))
    assert whole < 1e-5, (mode, whole)
    assert one_hot or (mode == "gather" and world > 1)


def test_engine_builds_muon_from_config(pool):
    for mode in ("gather", "tensor"):
        pool.run(engine_rank, mode)


class OnlyVectors(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.ones(8))


def bad_input_rank(rank, world):
    return value_errors((
        lambda: sharding_granularity({"type": "Muon", "params": {}}, {"default": "rows:1"},
                                     OnlyVectors()),
        lambda: Muon(fully_shard(OnlyVectors()).parameters()),
        lambda: Muon(shard(make("gpt"), "rows:1").parameters(), adjust_lr_fn="sqrt"),
        lambda: Muon(shard(make("gpt"), "rows:1").parameters(), mode="scatter"),
        lambda: Muon(make("gpt").parameters()),
        lambda: initialize(model=OnlyVectors(), config={
            **ENGINE, "optimizer": {"type": "Muon", "params": {"momentum": 0.9}}}),
        lambda: initialize(model=make("gpt"), config={
            **ENGINE, "optimizer": {"type": "Muon", "params": {"ns_step": 5}}})))


def test_bad_input_is_a_clear_error(pool):
    errors = pool.run(bad_input_rank)[0]
    assert all(e is not None for e in errors), errors
    no_matrix, no_matrix_opt, adjust, mode, plain, engine_vectors, misspelt = errors
    for message in (no_matrix, no_matrix_opt, engine_vectors):
        assert "no 2-D" in message and "norm.weight" in message and "scale [8]" in message
    assert "sqrt" in adjust and "scatter" in mode and "torch.optim.Muon" in plain
    assert "ns_step" in misspelt and "ns_steps" in misspelt


def test_default_patterns_send_embeddings_head_norms_and_biases_to_adamw():
    named = dict(make("gpt").named_parameters())
    muon = sorted(n for n, p in named.items() if is_muon_matrix(n, p.shape))
    assert muon == sorted(f"blocks.{i}.{w}.weight" for i in range(4)
                          for w in ("qkv", "proj", "fc", "out"))
    assert "head.*" in DEFAULT_ADAMW_PATTERNS and not is_muon_matrix("lm_head.weight", (4, 4))


# ------------------------------------------------------------------ checkpoints

def checkpoint_rank(rank, world, directory):
    """Save after 2 steps, train 2 more; a fresh engine loading the checkpoint and training the
    same 2 steps ends bit-identical (Muon momentum and AdamW moments all restored)."""
    config = {**ENGINE, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world}

    def train(engine, steps):
        for step in steps:
            engine.backward(engine(*local_batch("gpt", step, rank, world)))
            engine.step()

    engine, _, _, _ = initialize(model=make("gpt"), config=config)
    train(engine, range(2))
    engine.save_checkpoint(directory, tag="two")
    train(engine, range(2, 4))
    want = full_state_dict(engine.module)
    torch.manual_seed(7)
    again, _, _, _ = initialize(model=fm.GPT(), config=config)
    again.load_checkpoint(directory, tag="two")
    train(again, range(2, 4))
    got = full_state_dict(again.module)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert differ == []


def test_checkpoint_round_trip_is_exact(pool):
    from dist_harness import scratch_dir
    pool.run(checkpoint_rank, scratch_dir())
