"""fully_shard over DTensor (TP/EP) parameters on 4 gloo ranks: (dp 2, tp 2) Colwise/Rowwise
MLPs and a tiny transformers Llama, fused experts over (efsdp 2, ep 2) with the expert divisor,
each against one process on the same global batch; the forward parameter is a DTensor over the
DBuffer (zero copies); the gradient norm counts every piece once. The references are built as
in /work/shared/reference/fsdp2_tp_ep_check.py."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from dist_harness import RankPool
from vescale_engine import optim as vopt
from vescale_engine.fsdp import fully_shard, unit_of
from vescale_engine.fsdp.lookup import units_under
from vescale_engine.optim.clip import clip_grad_norm_
from vescale_engine.shard.dbuffer import STATS

WORLD = 4
STEPS = 5
TOL = 1e-6


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(WORLD)
    yield pool
    pool.close()


_MESHES = {}


def mesh(shape, names):
    """Meshes are made once per rank process (each makes process groups on every rank)."""
    if (shape, names) not in _MESHES:
        _MESHES[(shape, names)] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[(shape, names)]


# ---------------------------------------------------------------------------- comparisons

def reference_piece(sp, full: torch.Tensor) -> torch.Tensor:
    """This rank's flat piece of the one-process tensor `full` for sharded parameter `sp`:
    the TP/EP-local block of it, then the RaggedShard range."""
    t = full.detach()
    if sp.dtensor_spec is not None:
        spec = sp.dtensor_spec
        shape, offset = compute_local_shape_and_global_offset(t.shape, spec.mesh, spec.placements)
        for d, (n, o) in enumerate(zip(shape, offset)):
            t = t.narrow(d, o, n)
    begin, end = sp.flat_range
    return t.reshape(-1)[begin:end]


def managed(model):
    """(ShardedParameter, its dotted name in `model`) for every managed parameter."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for unit in units_under(model):
        for sp in unit.params:
            mod, attr = sp.registrations[0]
            prefix = names[id(mod)]
            out.append((sp, f"{prefix}.{attr}" if prefix else attr))
    return out


def worst_relative(model, reference, what="param"):
    """max over tensors and ranks of |ours - reference| / max|reference| (parameter values or
    sharded gradients)."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for sp, name in managed(model):
        ours = sp.sharded if what == "param" else sp.sharded.grad
        theirs = ref[name] if what == "param" else ref[name].grad
        piece = reference_piece(sp, theirs)
        if piece.numel():
            scale = theirs.detach().abs().max().item()
            worst = max(worst, (ours.detach() - piece).abs().max().item() / max(scale, 1e-12))
    t = torch.tensor(worst)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gradient_ratios(model, reference):
    """{name: |ours| / |reference|} of the sharded gradients (summed over ranks)."""
    ref = dict(reference.named_parameters())
    names = sorted({name for _, name in managed(model)})
    sums = torch.zeros(len(names), 2, dtype=torch.float64)
    for sp, name in managed(model):
        piece = reference_piece(sp, ref[name].grad)
        sums[names.index(name), 0] += sp.sharded.grad.double().square().sum()
        sums[names.index(name), 1] += piece.double().square().sum()
    dist.all_reduce(sums)
    return {n: (sums[i, 0] / sums[i, 1]).sqrt().item() for i, n in enumerate(names)}


def mean_over_ranks(loss):
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


# ---------------------------------------------------------------------------- (dp 2, tp 2) MLP

class MLP(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(x)))


class Net(nn.Module):
    """Two residual TP blocks and a plain head (replicated on the TP peers, dense unit)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MLP(), MLP()])
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def tp_mlp(grads_in_place=True, optimizer="vescale", granularity="rows:1", max_norm=None):
    mesh2d = mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    for b in model.blocks:
        parallelize_module(b, mesh2d["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for b in model.blocks:
        fully_shard(b, mesh=mesh2d["dp"], grads_in_place=grads_in_place, granularity=granularity)
    fully_shard(model, mesh=mesh2d["dp"], grads_in_place=grads_in_place, granularity=granularity)
    return mesh2d, ref, model


def make_optimizers(model, ref, optimizer):
    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(),
                                                                              lr=0.1)
    return (vopt.AdamW(model.parameters(), lr=1e-2),
            torch.optim.AdamW(ref.parameters(), lr=1e-2))


def tp_mlp_parity(rank, world, grads_in_place, optimizer, granularity, max_norm):
    mesh2d, ref, model = tp_mlp(grads_in_place, optimizer, granularity)
    opt, ref_opt = make_optimizers(model, ref, optimizer)
    g = torch.Generator().manual_seed(1)
    dp_rank = mesh2d["dp"].get_local_rank()
    loss_err, norm_err = 0.0, 0.0
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        sl = slice(4 * dp_rank, 4 * dp_rank + 4)  # TP peers share their dp rank's batch
        loss = F.mse_loss(model(x[sl]), y[sl])
        loss.backward()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        if max_norm is not None:
            norm = clip_grad_norm_(model.parameters(), max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            norm_err = max(norm_err, abs(norm.item() - ref_norm.item()) / ref_norm.item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(mean_over_ranks(loss) - ref_loss.item()))
    return loss_err, worst_relative(model, ref), norm_err


CASES = [(True, "vescale", "rows:1", None), (False, "vescale", "element", None),
         (True, "sgd", "element", 0.05)]


def tp_mlp_cases(rank, world):
    return [tp_mlp_parity(rank, world, *case) for case in CASES]


def test_tp_mlp_equals_one_process(pool):
    """(dp 2, tp 2): grads in place and preset .grad, our AdamW and torch SGD with clipping."""
    for case, (loss_err, param_err, norm_err) in zip(CASES, pool.run(tp_mlp_cases)[0]):
        assert loss_err < TOL, (case, "loss", loss_err)
        assert param_err < TOL, (case, "parameters", param_err)
        assert norm_err < TOL, (case, "clip norm", norm_err)


def tp_forward_faces(rank, world):
    """What the module holds in forward, and the copies on the collective path."""
    mesh2d, ref, model = tp_mlp()
    opt = vopt.AdamW(model.parameters(), lr=1e-2)
    seen = {}
    w1 = model.blocks[0].w1
    sp = next(p for p in unit_of(model.blocks[0]).params if p.fqn == "w1.weight")

    def look(mod, args):
        w = mod.weight
        full = sp.buffer.full
        begin = full.untyped_storage().data_ptr()
        end = begin + full.untyped_storage().nbytes()
        local = w._local_tensor if isinstance(w, DTensor) else None
        seen.update(
            type=type(w).__name__, is_dtensor=isinstance(w, DTensor),
            placements=tuple(getattr(w, "placements", ())) == (Shard(0),),
            mesh=getattr(w, "device_mesh", None) == mesh2d["tp"],
            shape=tuple(w.shape), local_shape=tuple(local.shape) if local is not None else None,
            inside=local is not None and begin <= local.data_ptr() < end,
            is_view=local is not None and local.data_ptr() == sp.buffer.full_view(sp.index).data_ptr(),
            grad_fn=w.grad_fn is None and (local is None or local.grad_fn is None))
    w1.register_forward_pre_hook(look)
    STATS.reset()
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        loss = F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 8, generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()
    spec = sp.dtensor_spec
    seen.update(spec_placements=tuple(spec.placements) == (Shard(0),),
                spec_mesh=spec.mesh == mesh2d["tp"], spec_shape=tuple(spec.shape),
                sharded_shape=tuple(sp.shape), copied=STATS.bytes_copied,
                gathers=STATS.all_gathers, scatters=STATS.reduce_scatters)
    return seen


def test_forward_parameter_is_dtensor_over_the_buffer(pool):
    for seen in pool.run(tp_forward_faces):
        assert seen["is_dtensor"] and seen["mesh"], seen
        assert seen["placements"] and seen["shape"] == (16, 8), seen
        assert seen["local_shape"] == (8, 8) and seen["inside"] and seen["is_view"], seen
        assert seen["grad_fn"], seen  # a leaf: no autograd edge to the buffer
        assert seen["spec_placements"] and seen["spec_mesh"] and seen["spec_shape"] == (16, 8)
        assert seen["sharded_shape"] == (8, 8), seen
        assert seen["copied"] == 0 and seen["gathers"] > 0 and seen["scatters"] > 0, seen
