"""torch's FSDP2 user code on our fully_shard, against torch's own fully_shard (2 gloo ranks,
fp32, the same initial values): torch.nn.utils.clip_grad_norm_ in the loop (losses, norms,
parameters), torch.optim.AdamW (foreach and fused) on our sharded parameters, `.grad` after
backward, get_model_state_dict(full_state_dict, cpu_offload), and model.state_dict() through
dcp.save / dcp.load into a differently seeded model."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dist_harness import scratch_dir

STEPS = 3
TOL = 1e-6


class Tiny(nn.Module):
    # Uneven sizes: our pieces of each tensor differ between the ranks (torch's are Shard(0)).
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 3)
        self.scale = nn.Parameter(torch.rand(3) + 0.5)  # the root unit's own parameter

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def _make(seed):
    torch.manual_seed(seed)
    return Tiny()


def _ours(model):
    from vescale_engine.fsdp import fully_shard
    fully_shard(model.a)
    fully_shard(model.b)
    return fully_shard(model)


def _torch(model):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch_fully_shard(model.a, mesh=mesh)
    torch_fully_shard(model.b, mesh=mesh)
    return torch_fully_shard(model, mesh=mesh)


def _batch(step, rank, world):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=gen), 5 * torch.randn(8, 3, generator=gen)
    per = len(x) // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _value(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, rank, world, fused=False, clip=True):
    """3 steps of torch user code; (losses, norms, full parameters, .grad types)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None)
    losses, norms, grads = [], [], []
    for step in range(STEPS):
        x, y = _batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads = [(type(p.grad).__name__, tuple(p.grad.shape), tuple(p.shape))
                 for p in model.parameters()]
        if clip:
            norms.append(float(_value(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: _value(v).detach().clone() for k, v in model.named_parameters()}
    return losses, norms, params, grads


def _close(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].shape == b[k].shape and torch.allclose(a[k], b[k], rtol=0, atol=TOL) for k in a)


def train_rank(rank, world, fused, clip):
    losses, norms, params, grads = _train(_ours(_make(0)), rank, world, fused, clip)
    t_losses, t_norms, t_params, t_grads = _train(_torch(_make(0)), rank, world, fused, clip)
    # the norms first: on plain 1-D pieces clip_grad_norm_ returns each rank's own norm
    assert norms == pytest.approx(t_norms, abs=TOL)
    assert losses == pytest.approx(t_losses, abs=TOL)
    if clip:
        assert max(norms) > 1.0  # clipping did scale the gradients
    assert _close(params, t_params)
    # `.grad` after backward: a DTensor of the parameter's global shape, as torch's
    assert all(name == "RaggedDTensor" and g == s for name, g, s in grads), grads
    assert [(g, s) for _, g, s in grads] == [(g, s) for _, g, s in t_grads]


@pytest.mark.parametrize("fused,clip", [(False, True), (True, True), (False, False)],
                         ids=["foreach-clip", "fused-clip", "foreach"])
def test_torch_training_loop_matches_torch_fsdp2(pool, fused, clip):
    pool.run(train_rank, fused, clip)


def state_dict_rank(rank, world, path):
    ours, theirs = _ours(_make(0)), _torch(_make(0))
    _train(ours, rank, world)
    _train(theirs, rank, world)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full, t_full = get_model_state_dict(ours, options=options), \
        get_model_state_dict(theirs, options=options)
    shapes = {k: (type(v).__name__, tuple(v.shape)) for k, v in ours.state_dict().items()}
    t_shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    # DCP round trip: model.state_dict() saved, loaded into a differently seeded model
    dcp.save(ours.state_dict(), checkpoint_id=path)
    other = _ours(_make(7))
    before = {k: v.full_tensor() for k, v in other.state_dict().items()}
    loaded = other.state_dict()
    dcp.load(loaded, checkpoint_id=path)
    after = {k: v.full_tensor() for k, v in other.state_dict().items()}
    saved = {k: v.full_tensor() for k, v in ours.state_dict().items()}
    # and training goes on from the loaded values as from the saved ones
    x, y = _batch(0, rank, world)
    resumed = (nn.functional.mse_loss(other(x), y).item(),
               nn.functional.mse_loss(ours(x), y).item())
    out = dict(full=full, t_full=t_full, shapes=shapes, t_shapes=t_shapes,
               changed=not _close(before, saved), restored=_close(after, saved),
               resumed=resumed)
    assert sorted(out["full"]) == sorted(out["t_full"])
    if rank == 0:  # cpu_offload: rank 0 holds the values, as torch's
        assert all(v.device.type == "cpu" and not isinstance(v, DTensor)
                   for v in out["full"].values())
        assert _close(out["full"], out["t_full"])
    assert {k: s for k, (_, s) in out["shapes"].items()} == out["t_shapes"]
    assert {name for name, _ in out["shapes"].values()} == {"RaggedDTensor"}
    assert out["changed"] and out["restored"], out
    assert out["resumed"][0] == out["resumed"][1]


def test_state_dicts_and_dcp_round_trip(pool):
    pool.run(state_dict_rank, scratch_dir())


def noop_move_rank(rank, world):
    """`.to(its device)` and `.float()` on an fp32 model sharded by fully_shard change nothing:
    the DTensor parameters stay the ones tied to their buffers (torch swaps a DTensor-subclass
    parameter for a new one even then, unless fully_shard's guard keeps it out), and the model
    trains as one never moved."""
    model = _ours(_make(0))
    before = list(model.parameters())
    model.to(torch.device("cpu"))
    model.float()
    after = list(model.parameters())
    kept = all(a is b and getattr(a, "_vescale", None) is not None for a, b in zip(before, after))
    moved, plain = _train(model, rank, world)[:3], _train(_ours(_make(0)), rank, world)[:3]
    assert kept
    assert moved[0] == plain[0] and moved[1] == plain[1] and _close(moved[2], plain[2])


def test_noop_moves_keep_the_dtensor_parameters(pool):
    pool.run(noop_move_rank)


def assign_rank(rank, world, kind):
    """`load_state_dict(sd, assign=True)` into a sharded model that has values (not meta):
    the parameters stay ours (the same objects, views of the shard), hold the loaded values,
    and train as a model loaded without assign does. `kind`: whole tensors, or DTensors of
    our layout (Accelerate's distribute_tensor then assign)."""
    from vescale_engine import fully_shard  # noqa: F401  (teaches torch's distribute_tensor)
    from torch.distributed.tensor import distribute_tensor
    source = _make(3).state_dict()
    model = _ours(_make(0))
    before = list(model.parameters())
    if kind == "dtensor":
        sd = {k: distribute_tensor(source[k], v.device_mesh, v.placements)
              for k, v in model.state_dict().items()}
    else:
        sd = {k: v.clone() for k, v in source.items()}
    model.load_state_dict(sd, assign=True)
    kept = all(a is b for a, b in zip(before, model.parameters()))
    plain = _ours(_make(0))
    plain.load_state_dict(source)
    assigned, loaded = _train(model, rank, world)[:3], _train(plain, rank, world)[:3]
    assert kept
    assert assigned[0] == loaded[0] and assigned[1] == loaded[1]
    assert _close(assigned[2], loaded[2])


@pytest.mark.parametrize("kind", ["full", "dtensor"])
def test_load_state_dict_assign_keeps_our_parameters(pool, kind):
    pool.run(assign_rank, kind)


def bad_assign_rank(rank, world):
    """A DTensor of another placement (torch's Shard(0)) assigned: refused naming the
    parameter, and the module holds our parameter again."""
    from torch.distributed.tensor import Shard, distribute_tensor
    model = _ours(_make(0))
    weight = model.a.weight
    other = distribute_tensor(torch.zeros(10, 6), weight.device_mesh, [Shard(0)])
    message = None
    try:
        model.a.load_state_dict({"weight": other}, strict=False, assign=True)
    except (ValueError, RuntimeError) as err:  # (torch's load_state_dict wraps ours: Runtime)
        message = str(err)
    kept = model.a.weight is weight
    assert message is not None and "Linear.weight" in message and "Shard" in message, message
    assert kept


def test_load_state_dict_assign_of_another_layout_raises(pool):
    pool.run(bad_assign_rank)


def test_torch_patch_is_installed_by_fully_shard_and_undone_by_unpatch():
    import torch.distributed._state_dict_utils as sd_utils
    import torch.distributed.tensor as tensor_api

    import vescale_engine
    from vescale_engine.integrations import installed
    vescale_engine.unpatch()
    torch_own = tensor_api.distribute_tensor
    assert not hasattr(torch_own, "__wrapped__")
    vescale_engine.fully_shard  # noqa: B018  (the lookup installs it)
    names = {"torch.distributed.tensor.distribute_tensor",
             "torch.distributed._state_dict_utils.distribute_tensor",
             "torch.distributed._state_dict_utils._distribute_tensors"}
    assert names <= set(installed())
    assert tensor_api.distribute_tensor.__wrapped__ is torch_own
    vescale_engine.unpatch()
    assert not names & set(installed())
    assert tensor_api.distribute_tensor is torch_own and sd_utils.distribute_tensor is torch_own
