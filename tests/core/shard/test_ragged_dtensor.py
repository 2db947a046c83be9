"""RaggedDTensor on 2 gloo ranks against one-process references: element-wise ops, torch AdamW
(foreach, fused, for-loop), clip_grad_norm_, reductions (over all or some dims), the gather and
redistribute, DCP save and load in other layouts, get_model_state_dict, zero copy, and the ops
it refuses."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from dist_harness import scratch_dir
from vescale_engine.shard.ragged import RaggedShard
from vescale_engine.shard.ragged_dtensor import (RaggedDTensor, RaggedPlacement,
                                                 distribute_ragged, fill_from_full,
                                                 mesh_of_group, ragged_dtensor)

# Uneven and empty pieces, short last blocks, ranges that are several boxes (2-D and 3-D).
LAYOUTS = {
    "W": RaggedShard((5, 6), 4, (5, 3)),     # rank 0: 3 rows + 2 elements, rank 1: the rest
    "E": RaggedShard((2, 3, 4), 5, (2, 3)),  # 3-D, both ranges cut rows
    "b": RaggedShard((7,), 1, (7, 0)),       # rank 1 holds none of it
    "s": RaggedShard((), 1, (0, 1)),         # a 0-d tensor on rank 1
}
# The same tensors laid out otherwise (for loading and redistribute).
OTHER = {
    "W": RaggedShard((5, 6), 6, (1, 4)),
    "E": RaggedShard((2, 3, 4), 1, (17, 7)),
    "b": RaggedShard((7,), 2, (1, 3)),
    "s": RaggedShard((), 1, (1, 0)),
}


def _mesh():
    return mesh_of_group(dist.group.WORLD, "cpu")


def _fulls(seed):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(layout.shape, generator=gen) for name, layout in LAYOUTS.items()}


def _shard(full, layout, rank, mesh):
    start, end = layout.local_range(rank)
    return ragged_dtensor(full.reshape(-1)[start:end].clone(), layout, mesh)


def _same_layout(x, like):
    return isinstance(x, RaggedDTensor) and x.placements == like.placements and \
        x.shape == like.shape and x._local_tensor.numel() == like._local_tensor.numel()


# ----------------------------------------------------------------------------- no ranks

def test_placement_is_a_value():
    a, b = RaggedPlacement(4, [5, 3]), RaggedPlacement(4, (5, 3))
    assert a == b and hash(a) == hash(b) and a != RaggedPlacement(4, (4, 4))
    assert a != Shard(0) and a.layout((5, 6)) == LAYOUTS["W"]
    assert RaggedPlacement.of(LAYOUTS["W"]) == a
    assert repr(a) == "RaggedPlacement(block=4, local_units=(5, 3))"
    with pytest.raises(AttributeError, match="immutable"):
        a.block = 2
    for block, units in ((0, (1,)), (1, ()), (1, (2, -1))):
        with pytest.raises(ValueError, match="RaggedPlacement"):
            RaggedPlacement(block, units)
    with pytest.raises(ValueError, match="sum to"):
        a.layout((5, 5))


# ----------------------------------------------------------------------------- on 2 ranks

def run_elementwise(rank, world):
    mesh = _mesh()
    A, B = _fulls(1), _fulls(2)
    checked = 0
    for name, layout in LAYOUTS.items():
        a, b, Af, Bf = _shard(A[name], layout, rank, mesh), _shard(B[name], layout, rank, mesh), \
            A[name], B[name]
        cases = [
            (a + b, Af + Bf), (a * 2.5, Af * 2.5), (a - 0.5 * b, Af - 0.5 * Bf),
            (torch.lerp(a, b, 0.3), torch.lerp(Af, Bf, 0.3)),
            (torch.addcdiv(a, b, b.abs() + 1, value=0.1),
             torch.addcdiv(Af, Bf, Bf.abs() + 1, value=0.1)),
            (a.abs().sqrt(), Af.abs().sqrt()), (torch.maximum(a, b), torch.maximum(Af, Bf)),
            (a * torch.tensor(3.0), Af * 3.0), (a.clone(), Af), (torch.zeros_like(a), 0 * Af),
            (a.to(torch.float64), Af.double()), (a > 0, Af > 0),
            (a.clone().neg_(), -Af), (a.clone().copy_(Bf), Bf), (a.clone().copy_(b), Bf),
            (a.clone().fill_(torch.tensor(2.0)), torch.full_like(Af, 2.0)),
            (a.clone().zero_(), 0 * Af), (a.view(-1), Af.reshape(-1)),
            (a.reshape(-1).reshape(a.shape), Af),
        ]
        cases += list(zip(torch._foreach_add([a, b], [b, a], alpha=2.0),
                          [Af + 2 * Bf, Bf + 2 * Af]))
        for got, want in cases:
            assert isinstance(got, RaggedDTensor), (name, type(got))
            assert got.shape == want.shape and got.placements == a.placements, name
            assert got.dtype == want.dtype, (name, got.dtype)
            assert torch.equal(got.full_tensor(), want), name
            checked += 1
        inplace = a.clone()
        assert inplace.mul_(3) is inplace  # in place returns the same object, as torch does
    assert checked == 4 * 21


def test_elementwise_ops_match_the_full_tensors(pool):
    pool.run(run_elementwise)


def run_zero_copy(rank, world):
    """Pieces of two tensors in one flat buffer (as a DBuffer's shard): the DTensors' local
    tensors are views of it, and parameter updates land in it."""
    mesh = _mesh()
    W, E = LAYOUTS["W"], LAYOUTS["E"]
    nw, ne = W.local_numel(rank), E.local_numel(rank)
    buffer = torch.zeros(nw + ne + 3)
    views = [buffer[:nw], buffer[nw:nw + ne]]
    w, e = ragged_dtensor(views[0], W, mesh), ragged_dtensor(views[1], E, mesh)
    assert w._local_tensor is views[0] and w.to_local() is views[0]
    params = [nn.Parameter(w), nn.Parameter(e)]
    assert all(isinstance(p, nn.Parameter) and isinstance(p, DTensor) for p in params)
    assert [p.to_local().data_ptr() for p in params] == [v.data_ptr() for v in views]
    with torch.no_grad():
        torch._foreach_add_(params, [1.0, 2.0])
        params[0].mul_(3)
    assert torch.equal(buffer, torch.cat([torch.full((nw,), 3.0), torch.full((ne,), 2.0),
                                          torch.zeros(3)]))
    for p in params:
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(params, lr=0.5, foreach=True).step()
    assert bool((buffer[:nw + ne] != torch.cat([torch.full((nw,), 3.0), torch.full((ne,), 2.0)])
                 ).all()) and bool((buffer[nw + ne:] == 0).all())


def test_local_tensors_are_the_buffer(pool):
    pool.run(run_zero_copy)


def run_adamw(rank, world, kind):
    """Ours, the same optimizer over the plain local pieces, and over the whole tensors."""
    mesh = _mesh()
    fulls = _fulls(3)
    names = list(LAYOUTS)
    ours = [nn.Parameter(_shard(fulls[n], LAYOUTS[n], rank, mesh)) for n in names]
    pieces = [nn.Parameter(p.to_local().clone()) for p in ours]
    ref = [nn.Parameter(fulls[n].clone()) for n in names]
    options = dict(lr=0.05, weight_decay=0.1, amsgrad=kind == "fused")
    options.update({"foreach": dict(foreach=True), "fused": dict(fused=True),
                    "for-loop": dict(foreach=False)}[kind])
    optimizers = [torch.optim.AdamW(group, **options) for group in (ours, pieces, ref)]
    for step in range(3):
        for p, q, r, g in zip(ours, pieces, ref, _fulls(100 + step).values()):
            p.grad = _shard(g, p.ragged_shard, rank, mesh)
            q.grad, r.grad = p.grad.to_local().clone(), g.clone()
        for optimizer in optimizers:
            optimizer.step()
    as_pieces = all(torch.equal(p.to_local(), q) for p, q in zip(ours, pieces))
    worst = max((p.full_tensor() - r).abs().max().item() for p, r in zip(ours, ref))
    exp_avg = optimizers[0].state[ours[0]]["exp_avg"]
    state_kept = _same_layout(exp_avg, ours[0]) and \
        exp_avg.to_local().data_ptr() != ours[0].to_local().data_ptr()
    assert as_pieces and state_kept
    assert worst <= (1e-7 if kind == "fused" else 0.0), worst


@pytest.mark.parametrize("kind", ["foreach", "fused", "for-loop"])
def test_torch_adamw_matches_unsharded(pool, kind):
    """Bitwise the optimizer on the local pieces; and the unsharded run bitwise too, except
    fused: torch's CPU fused kernel itself rounds a piece that starts mid-tensor differently
    in the last bit (the same on plain slices), hence 1e-7."""
    pool.run(run_adamw, kind)


def run_clip(rank, world, norm_type, foreach):
    mesh = _mesh()
    grads = _fulls(4)
    names = list(LAYOUTS)
    ours = [nn.Parameter(_shard(grads[n], LAYOUTS[n], rank, mesh)) for n in names]
    ref = [nn.Parameter(grads[n].clone()) for n in names]
    for p in ours:
        p.grad = p.detach().clone() * 3
    for p in ref:
        p.grad = p.detach().clone() * 3
    total = nn.utils.clip_grad_norm_(ours, 0.5, norm_type=norm_type, foreach=foreach)
    want = nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type, foreach=foreach)
    read = math.isclose(total.item(), want.item(), rel_tol=1e-6)  # no collective needed
    total = total.full_tensor()
    clipped = all(_same_layout(p.grad, p) and
                  torch.allclose(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=0)
                  for p, r in zip(ours, ref))
    assert (read and math.isclose(total.item(), want.item(), rel_tol=1e-6), clipped,
            want.item() > 0.5) == (True, True, True)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm_is_global(pool, norm_type, foreach):
    pool.run(run_clip, norm_type, foreach)


def run_reductions(rank, world):
    mesh = _mesh()
    fulls = _fulls(5)
    results = []
    for name, layout in LAYOUTS.items():
        a, A = _shard(fulls[name], layout, rank, mesh), fulls[name]
        cases = [(a.sum(), A.sum()), (a.mean(), A.mean()), (a.amax(), A.amax()),
                 (a.amin(), A.amin()), (torch.linalg.vector_norm(a, 3.0, keepdim=True),
                                        torch.linalg.vector_norm(A, 3.0, keepdim=True)),
                 (torch.linalg.vector_norm(a, math.inf), torch.linalg.vector_norm(A, math.inf)),
                 (torch.linalg.vector_norm(a, 0), torch.linalg.vector_norm(A, 0)),
                 (a.norm(), A.norm()), (torch._foreach_norm([a])[0], A.norm()),
                 (torch._foreach_max([a])[0], A.max()),
                 (torch.isfinite(a).all(), torch.isfinite(A).all()),
                 ((a > 1).all(), (A > 1).all()), ((a > 1).any(), (A > 1).any())]
        for got, want in cases:
            assert type(got) is DTensor and got.placements == (Replicate(),)  # reduced already
            got = got.full_tensor()
            assert got.shape == want.shape and got.dtype == want.dtype, (name, got, want)
            results.append(torch.equal(got, want) if want.dtype == torch.bool else
                           torch.allclose(got, want, rtol=1e-6, atol=1e-6))
        results.append(math.isclose(a.sum().item(), A.sum().item(), rel_tol=1e-6, abs_tol=1e-6))
    assert len(results) == 4 * 14 and all(results)


def test_reductions_over_all_elements_are_global(pool):
    pool.run(run_reductions)


def run_reductions_over_some_dims(rank, world):
    """Row norms, column sums and the like, over ranges that cut rows (and pieces that are
    empty): the full tensor's values, reduced already (Replicate)."""
    mesh = _mesh()
    fulls = _fulls(7)
    fulls["W"][1, 2] = 0.0  # a zero for the 0-norm to count
    wrong = []
    for name in ("W", "E"):
        a, A = _shard(fulls[name], LAYOUTS[name], rank, mesh), fulls[name]
        for dims in ([1], [0], [-1], [0, 2] if A.dim() == 3 else [0, -1]):
            for label, op in {
                    "norm": lambda x: torch.linalg.norm(x, dim=dims[0]),
                    "vector_norm": lambda x: torch.linalg.vector_norm(x, 2, dim=dims),
                    "norm3 keepdim": lambda x: torch.linalg.vector_norm(x, 3.0, dims, True),
                    "inf": lambda x: torch.linalg.vector_norm(x, math.inf, dim=dims),
                    "-inf": lambda x: torch.linalg.vector_norm(x, -math.inf, dim=dims),
                    "0": lambda x: torch.linalg.vector_norm(x, 0, dim=dims),
                    "Tensor.norm": lambda x: x.norm(p=1, dim=dims),
                    "sum": lambda x: x.sum(dim=dims),
                    "sum keepdim f64": lambda x: x.sum(dims, keepdim=True, dtype=torch.float64),
                    "mean": lambda x: x.mean(dim=dims),
                    "amax": lambda x: x.amax(dim=dims),
                    "amin keepdim": lambda x: x.amin(dim=dims, keepdim=True),
                    "int sum": lambda x: (x > 0).sum(dim=dims)}.items():
                got, want = op(a), op(A)
                ok = type(got) is DTensor and got.placements == (Replicate(),)
                got = got.full_tensor() if ok else got
                if not (ok and got.shape == want.shape and got.dtype == want.dtype and
                        torch.allclose(got, want, rtol=1e-6, atol=1e-6)):
                    wrong.append(f"{name} {label} dims={dims}: {got} != {want}")
    assert not wrong, "\n".join(wrong)


def test_reductions_over_some_dims_are_the_full_tensor_s(pool):
    pool.run(run_reductions_over_some_dims)


def run_gather_and_redistribute(rank, world):
    mesh = _mesh()
    fulls = _fulls(6)
    ok = []
    for name, layout in LAYOUTS.items():
        a, A = _shard(fulls[name], layout, rank, mesh), fulls[name]
        ok.append(type(a.full_tensor()) is torch.Tensor and torch.equal(a.full_tensor(), A))
        replicated = a.redistribute(mesh, [Replicate()])
        ok.append(type(replicated) is DTensor and replicated.placements == (Replicate(),)
                  and torch.equal(replicated.to_local(), A))
        other = a.redistribute(mesh, [RaggedPlacement.of(OTHER[name])])
        start, end = OTHER[name].local_range(rank)
        ok.append(_same_layout(other, _shard(A, OTHER[name], rank, mesh)) and
                  torch.equal(other.to_local(), A.reshape(-1)[start:end]))
        ok.append(a.redistribute(mesh, a.placements) is a)
        # Differentiable: each rank's gradient is its range of the whole tensor's.
        x = nn.Parameter(_shard(A, layout, rank, mesh))
        (x.full_tensor() ** 2).sum().backward()
        start, end = layout.local_range(rank)
        ok.append(_same_layout(x.grad, x) and
                  torch.equal(x.grad.to_local(), 2 * A.reshape(-1)[start:end]))
        x.grad = None
        (x.to_local() * 3).sum().backward()
        ok.append(_same_layout(x.grad, x) and bool((x.grad.to_local() == 3).all()))
    assert len(ok) == 4 * 6 and all(ok)


def test_full_tensor_and_redistribute(pool):
    pool.run(run_gather_and_redistribute)


def run_dcp(rank, world, path):
    mesh = _mesh()
    fulls = _fulls(7)
    saved = {name: _shard(fulls[name], layout, rank, mesh) for name, layout in LAYOUTS.items()}
    boxes = {name: len(t.__create_chunk_list__()) for name, t in saved.items()}
    dcp.save(saved, checkpoint_id=path)
    other = {name: _shard(torch.zeros(layout.shape), layout, rank, mesh)
             for name, layout in OTHER.items()}
    buffers = {name: t._local_tensor for name, t in other.items()}
    dcp.load(other, checkpoint_id=path)
    in_other_layout = all(torch.equal(t.full_tensor(), fulls[n]) and
                          t._local_tensor is buffers[n] for n, t in other.items())
    plain = {name: torch.zeros(layout.shape) for name, layout in LAYOUTS.items()}
    dcp.load(plain, checkpoint_id=path)
    return boxes, in_other_layout, all(torch.equal(t, fulls[n]) for n, t in plain.items())


def test_dcp_saves_boxes_and_loads_in_other_layouts(pool):
    path = scratch_dir()
    boxes, *loaded = zip(*pool.run(run_dcp, path))
    # rank 0's W range [0, 20) is rows 0-2 and 2 elements of row 3; E's [0, 10) of (2, 3, 4)
    # is rows 0-1 of [0] and 2 elements of its row 2, and rank 1's is the rest of that row and [1]
    assert boxes == ({"W": 2, "E": 2, "b": 1, "s": 0}, {"W": 2, "E": 2, "b": 0, "s": 1})
    assert loaded == [(True, True), (True, True)]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 5)
        self.out = nn.Linear(5, 7, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))


def run_state_dict(rank, world):
    mesh = _mesh()
    torch.manual_seed(8)
    reference, model = _Net(), _Net()
    model.load_state_dict(reference.state_dict())
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            layout = RaggedShard.even(param.shape, 3, world)
            module._parameters[name] = nn.Parameter(_shard(param.detach(), layout, rank, mesh))
    sharded = model.state_dict()
    kept = all(isinstance(v, RaggedDTensor) and v.shape == reference.state_dict()[k].shape
               for k, v in sharded.items()) and list(sharded) == list(reference.state_dict())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    same = all(type(full[k]) is torch.Tensor and torch.equal(full[k], v)
               for k, v in reference.state_dict().items()) and set(full) == set(sharded)
    counts = sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in reference.parameters())
    # nn.Module.load_state_dict of whole plain tensors: copy_ takes this rank's range
    doubled = {k: 2 * v for k, v in reference.state_dict().items()}
    model.load_state_dict(doubled)
    loaded = all(torch.equal(p.full_tensor(), doubled[k]) for k, p in model.named_parameters())
    # torch.save and deepcopy keep the layout and the values
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False)["inner.weight"],
              copy.deepcopy(model.inner.weight)]
    kept_by_copies = all(_same_layout(c, model.inner.weight) and
                         torch.equal(c.full_tensor(), doubled["inner.weight"]) for c in copies)
    # a piece at an offset of a larger storage (a buffer's later parameter) deep-copies too
    storage = torch.arange(100, dtype=torch.float32)
    layout = RaggedShard.even((4, 5), 3, world)
    n = layout.local_numel(rank)
    later = nn.Parameter(ragged_dtensor(storage[7:7 + n], layout, mesh))
    copied = copy.deepcopy(later)
    kept_by_copies = kept_by_copies and _same_layout(copied, later) and \
        torch.equal(copied.to_local(), storage[7:7 + n]) and \
        copied.to_local().untyped_storage().data_ptr() != storage.untyped_storage().data_ptr()
    # Module-wide casts swap in cast copies; .data takes a RaggedDTensor of the same layout
    model.to(torch.float64)
    cast = all(p.dtype == p.to_local().dtype == torch.float64 and
               torch.equal(p.full_tensor(), doubled[k].double())
               for k, p in model.named_parameters())
    weight = model.inner.weight
    replacement = weight.detach() * 2
    weight.data = replacement
    cast = cast and weight._local_tensor is replacement._local_tensor and \
        torch.equal(weight.full_tensor(), 2 * doubled["inner.weight"].double())
    assert (kept, same, counts, loaded, kept_by_copies, cast,
            weight.layout is torch.strided) == (True,) * 7


def test_get_model_state_dict_full(pool):
    pool.run(run_state_dict)


def run_refusals(rank, world):
    mesh = _mesh()
    fulls = _fulls(9)
    a = _shard(fulls["W"], LAYOUTS["W"], rank, mesh)
    b = _shard(fulls["W"], OTHER["W"], rank, mesh)
    attempts = {
        "aten.mm": lambda: torch.matmul(a, torch.ones(6, 2)),
        "aten.t": lambda: a.t(),
        "aten.select": lambda: a[0],
        "aten.max.dim": lambda: a.max(dim=0),  # values and indices: not a reduction of ours
        "aten.add.Tensor": lambda: a + fulls["W"],
        "aten.mul.Tensor": lambda: a * b,
        "aten.bernoulli_.Tensor": lambda: a.bernoulli_(torch.full((5, 6), 0.5)),
        "aten.randn_like": lambda: torch.randn_like(a),
        "aten.cat": lambda: torch.cat([a, a]),
        "aten.add.out": lambda: torch.add(a, a, out=a.clone()),
        "aten._foreach_mul_": lambda: torch._foreach_mul_([a], [b]),
        "redistribute": lambda: a.redistribute(mesh, [Shard(0)]),
        "RaggedDTensor.data": lambda: setattr(nn.Parameter(a), "data", fulls["W"]),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except NotImplementedError as err:
            messages[name] = str(err)
    for op, message in messages.items():
        assert message is not None, f"{op} did not raise"
        assert op in message and "Ragged" in message, message


def test_unsupported_ops_raise_naming_the_op(pool):
    pool.run(run_refusals)


def run_random_fills(rank, world):
    """nn.init on RaggedDTensors under a seed: the same values, and the generator as far on,
    as the same calls on the full tensors."""
    mesh = _mesh()
    fulls = _fulls(3)
    got, want = {}, {}
    for side in ("ragged", "full"):
        torch.manual_seed(5)
        for name, layout in LAYOUTS.items():
            t = _shard(fulls[name], layout, rank, mesh) if side == "ragged" else \
                fulls[name].clone()
            nn.init.trunc_normal_(t, std=0.02)   # uniform_ then point-wise ops
            t.normal_(1.0, 2.0)
            t.uniform_(-3, 3).bernoulli_(0.4).exponential_()
            nn.init.kaiming_uniform_(t) if t.dim() >= 2 else t.random_(0, 7)
            (got if side == "ragged" else want)[name] = \
                t.full_tensor() if side == "ragged" else t
        (got if side == "ragged" else want)["next draw"] = torch.rand(3)
    equal = {k: torch.equal(got[k], want[k]) for k in want}
    assert all(equal.values()), equal


def test_random_fills_draw_the_unsharded_values(pool):
    pool.run(run_random_fills)


def run_distribute(rank, world):
    """distribute_ragged: the values of mesh rank src_data_rank (rank 1 passes other data), or
    each rank's own with None; fill_from_full writes a rank's range in place."""
    mesh, layout = _mesh(), LAYOUTS["W"]
    mine = torch.arange(30.0).reshape(5, 6) + 100 * rank
    out = {}
    for src in (0, 1, None):
        t = distribute_ragged(mine, mesh, [RaggedPlacement.of(layout)], src_data_rank=src)
        assert isinstance(t, RaggedDTensor) and t.shape == mine.shape
        owner = rank if src is None else src
        want = (torch.arange(30.0) + 100 * owner)[slice(*layout.local_range(rank))]
        out[src] = torch.equal(t._local_tensor, want)
    target = _shard(torch.zeros(5, 6), layout, rank, mesh)
    local = target._local_tensor
    fill_from_full(target, mine)
    out["in place"] = target._local_tensor is local and \
        torch.equal(local, mine.reshape(-1)[slice(*layout.local_range(rank))])
    assert all(out.values()), out


def test_distribute_ragged_takes_the_source_ranks_values(pool):
    pool.run(run_distribute)
