"""What differs between the torch releases veScale Engine supports (2.11 to 2.15) and that the
code meets: one entry per concern, each found by feature detection (never by reading the version
number), with the releases that differ named. The rest of the package asks here instead of
branching on torch itself, so a new release's difference has one home.

1. DTensor subclasses and torch's C++ DTensor dispatch (`route_subclass_dispatch`).
2. The native all-gather and reduce-scatter names (`all_gather_native`, `reduce_scatter_native`).
3. DTensor's `__tensor_flatten__` context (`unflatten_dtensor_parts`).
4. FSDP2's dtype for unsharded gradients (`fsdp2_grads_in_reduce_dtype`).
5. FP8 matmuls with row-wise scales (`rowwise_scaled_mm_missing`).
"""
from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

__all__ = ["route_subclass_dispatch", "all_gather_native", "reduce_scatter_native",
           "unflatten_dtensor_parts", "fsdp2_grads_in_reduce_dtype",
           "rowwise_scaled_mm_missing"]


# -- 1. DTensor subclasses --------------------------------------------------------------------
# torch dispatches plain DTensor ops in C++ (dispatchDTensorOp). From 2.12 that fast path is
# taken only for DTensor itself and subclasses that keep its __torch_dispatch__; in 2.11 it is
# taken for every subclass, so a subclass's own __torch_dispatch__ is never called and its ops
# come back as plain DTensors computed by DTensor's sharding rules (for RaggedDTensor: wrong
# values or a refusal). torch consults the rules registered with
# torch.library.register_torch_dispatch before that fast path in every release, so on 2.11 the
# subclass's __torch_dispatch__ is registered as the rule of every operator known then.

_ROUTED: dict = {}  # subclass -> the Library holding its rules (None: not needed here)
_ROUTING = threading.Lock()


def _subclass_dispatch_honoured(mesh) -> bool:
    """Whether torch calls a DTensor subclass's own __torch_dispatch__ (a probe on `mesh`)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    called = []

    class _Probe(DTensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            called.append(func)
            return args[0]

    local = torch.empty(0)
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim,
                       tensor_meta=TensorMeta(local.shape, local.stride(), local.dtype))
    _Probe(local, spec, requires_grad=False).detach()
    return bool(called)


def route_subclass_dispatch(cls, mesh) -> None:
    """Make torch call `cls.__torch_dispatch__` for every operator on `cls` instances (once per
    class; `mesh` is any mesh of this process, for the probe). Nothing to do from torch 2.12."""
    if cls in _ROUTED:
        return
    with _ROUTING:  # ranks as threads of one process reach here at once
        if cls not in _ROUTED:
            _route(cls, mesh)


def _route(cls, mesh) -> None:
    if _subclass_dispatch_honoured(mesh):
        _ROUTED[cls] = None
        return

    def rule(subclass, func, types, args, kwargs):
        return subclass.__torch_dispatch__(func, types, args, kwargs)

    libraries = {}
    for name in torch._C._dispatch_get_all_op_names():
        namespace = name.split("::", 1)[0]
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
        torch.library.register_torch_dispatch(name, cls, rule, lib=libraries[namespace])
    _ROUTED[cls] = libraries


# -- 2. native collectives ----------------------------------------------------------------------
# torch 2.13 added all_gather_single / reduce_scatter_single and prefers them; 2.11 and 2.12
# have only the *_tensor names (the same collectives).
all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- 3. DTensor.__tensor_flatten__ ----------------------------------------------------------------
def unflatten_dtensor_parts(inner_tensors: dict, flatten_spec) -> tuple:
    """(local tensor, mesh, placements, requires_grad) from what DTensor.__tensor_flatten__
    returned: from torch 2.12 the mesh is an inner object and the context is (placements,
    tensor meta, shard order, requires_grad); in 2.11 the context is (spec, requires_grad)."""
    local = inner_tensors["_local_tensor"]
    if "device_mesh" in inner_tensors:
        placements, _, _, requires_grad = flatten_spec
        return local, inner_tensors["device_mesh"], placements, requires_grad
    spec, requires_grad = flatten_spec
    return local, spec.mesh, spec.placements, requires_grad


# -- 4. FSDP2's unsharded gradient dtype ---------------------------------------------------------
@functools.cache
def fsdp2_grads_in_reduce_dtype() -> bool:
    """Whether this torch's FSDP2 keeps unsharded gradients in the reduce dtype. torch 2.15's
    keeps a gradient in the dtype autograd produced it in when that is wider than the compute
    dtype (rms_norm's weight gradient is fp32 for bf16 weights), reduces and accumulates in
    MixedPrecisionPolicy.reduce_dtype, and reads reduce_dtype=None as the parameter's own
    dtype (it was param_dtype). Up to 2.14 autograd rounds every unsharded gradient to the
    compute dtype as it accumulates it, and reduce_dtype=None means param_dtype."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    return hasattr(FSDPParam, "unsharded_grad_dtype")


# -- 5. FP8 matmuls with row-wise scales -----------------------------------------------------------
@functools.cache
def rowwise_scaled_mm_missing(device_type: str) -> str | None:
    """None when `torch._scaled_mm` takes row-wise scales on this device type (what
    fsdp/fp8_linear.py calls), else torch's refusal in one line. torch 2.11's CPU kernel takes
    only per-tensor scales; 2.12's and later take row-wise ones; on CUDA, GPUs with FP8 do."""
    device = torch.device(device_type)
    a = torch.zeros(16, 32, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        lines = str(err).strip().splitlines()
        return lines[0][:300] if lines else type(err).__name__
    return None
