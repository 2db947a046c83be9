"""vescale_engine/torch_compat.py: each difference between the supported torch releases is found
by its probe on the torch installed here, and the code that relies on it gets what this torch
needs (CI runs this at torch 2.11 and 2.15)."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_map_only

from vescale_engine import torch_compat

# The releases whose C++ DTensor dispatch ignores a subclass's __torch_dispatch__ (read from
# torch's source: 2.12 added the check in python_arg_parser.cpp's is_dtensor).
IGNORES_SUBCLASS_DISPATCH = ("2.11",)
# The releases whose CPU torch._scaled_mm takes per-tensor scales only (run on each).
ROWWISE_MISSING_ON_CPU = ("2.11",)


POOL_WORLD = 1


def _subclass(seen):
    class Recording(DTensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(str(func))
            args, kwargs = tree_map_only(Recording, lambda t: t._local_tensor,
                                         (args, kwargs or {}))
            return func(*args, **kwargs)
    return Recording


def dispatch_rank(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    plain = DTensor.from_local(torch.ones(3), mesh, [Replicate()])
    honoured = torch_compat._subclass_dispatch_honoured(mesh)
    before, after = [], []
    unrouted = _subclass(before)
    unrouted(plain._local_tensor, plain._spec, requires_grad=False).detach()
    seen = after
    routed = _subclass(seen)
    torch_compat.route_subclass_dispatch(routed, mesh)
    x = routed(plain._local_tensor, plain._spec, requires_grad=False)
    sums = (x + x, torch._foreach_mul([x], 2.0)[0], x.detach())
    return {"honoured": honoured, "unrouted_called": bool(before), "routed": seen,
            "values": [s.tolist() for s in sums]}


def test_a_dtensor_subclass_gets_its_own_dispatch_on_every_supported_torch(pool):
    (out,) = pool.run(dispatch_rank)
    old = torch.__version__.startswith(IGNORES_SUBCLASS_DISPATCH)
    assert out["honoured"] is not old  # the probe tells what this torch does
    assert out["unrouted_called"] is not old
    assert out["routed"] == ["aten.add.Tensor", "aten._foreach_mul.Scalar", "aten.detach.default"]
    assert out["values"] == [[2.0] * 3, [2.0] * 3, [1.0] * 3]


def flatten_rank(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    tensor = DTensor.from_local(torch.arange(4.0), mesh, [Replicate()]).requires_grad_()
    names, context = tensor.__tensor_flatten__()
    inner = {name: getattr(tensor, name) for name in names}
    local, got_mesh, placements, requires_grad = \
        torch_compat.unflatten_dtensor_parts(inner, context)
    out = (local is tensor._local_tensor, got_mesh == mesh, tuple(placements),
           requires_grad)
    assert out == (True, True, (Replicate(),), True)


def test_dtensor_flatten_context_is_read_on_this_torch(pool):
    pool.run(flatten_rank)


def test_fsdp2_gradient_dtype_probe_agrees_with_fsdp2_s_own_docs():
    """FSDP2 says in MixedPrecisionPolicy's docstring when reduce_dtype=None's meaning changed
    (2.15); the probe reads FSDP2's code instead. They must agree."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    documented = "versionchanged:: 2.15" in (MixedPrecisionPolicy.__doc__ or "")
    assert torch_compat.fsdp2_grads_in_reduce_dtype() is documented


def fp8_matmul_rank(rank, world):
    from vescale_engine import fully_shard
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    before = [type(p) for p in model.parameters()]
    try:
        fully_shard(model, quantized_weights=256, quantization_format="fp8_e4m3",
                    fp8_matmul=True, granularity="rows:128")
    except NotImplementedError as err:
        return {"refused": str(err), "untouched": before == [type(p) for p in model.parameters()]}
    out = model(torch.randn(4, 128))
    return {"refused": None, "finite": bool(torch.isfinite(out).all())}


def test_fp8_matmul_is_refused_in_one_line_where_torch_lacks_rowwise_scaled_mm(pool):
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only: fully_shard(fp8_matmul=True)
    says so before it touches the model; where the probe finds row-wise scales, it runs."""
    (out,) = pool.run(fp8_matmul_rank)
    missing = torch_compat.rowwise_scaled_mm_missing("cpu")
    assert (missing is not None) is torch.__version__.startswith(ROWWISE_MISSING_ON_CPU)
    if missing:
        assert out["refused"].startswith("fp8_matmul=True needs torch._scaled_mm with row-wise "
                                         f"scales on cpu, which torch {torch.__version__}")
        assert "\n" not in out["refused"] and out["untouched"]
    else:
        assert out["refused"] is None and out["finite"]
