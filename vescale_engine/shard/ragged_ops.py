"""What each aten operation does on RaggedShard DTensors (ragged_dtensor.py's dispatch).

A ragged DTensor's local tensor is a flat range of the row-major tensor, so an operation is
right on local tensors only when it pairs elements by flat position or reduces all of them:

- element-wise (`torch.Tag.pointwise` ops, their `_foreach_` forms, `_fused_adam(w)_`/
  `_fused_sgd_`/`_fused_adagrad_`, zero_/fill_/copy_, the `*_like` factories, dtype casts):
  run once on the local tensors when every DTensor operand at a position has the same global
  shape, mesh and RaggedPlacement; other tensors must be 0-d (a scalar broadcasts to every
  element; a 0-d DTensor is reduced to its value first). `copy_` also takes a plain tensor of
  the global shape (this rank's range of it is copied).
- reductions over every element (vector norms, `_foreach_norm`, `_foreach_max`, sum, mean,
  amax/amin, max/min, all/any):
  the local results are all-reduced over the mesh at once (a `_foreach_norm`: one all-reduce
  for the whole list) and returned as Replicate DTensors, so `.item()`, `full_tensor()` and
  torch's own DTensor ops after them (clip_grad_norm_'s stack and norm) see the global value.
  An empty local piece contributes the reduction's identity. Over some dims (vector norms,
  sum, mean, amax/amin): each local element is scattered into its place in the reduced
  tensor, which is all-reduced at once (a rank's range may cut rows), a Replicate DTensor.
- views that keep the flat order (view, _unsafe_view, detach, alias): the same local tensor,
  the new global shape; the flat ranges do not move.
- in-place random fills (normal_, uniform_, bernoulli_, ...: what nn.init draws with): the
  whole tensor is drawn on every rank and this rank's range kept, so `init_weights()` on a
  sharded model gives the values it gives an unsharded one from the same seed.

A tensor/expert-parallel parameter's RaggedDTensor lives on an N-D mesh, as under FSDP2: HSDP's
replicate dim (Replicate) if any, then the data-parallel shard group, whose RaggedPlacement lays
out the TP/EP-local tensor, then the parameter's own TP/EP mesh dims and placements (tp_maps.py
places the local tensor in the global one). Its reductions are all-reduced over the shard
group and the mesh dims that split the tensor (never over replicas); a view must keep the
global shape.

Everything else raises NotImplementedError naming the operation: shape-aware ops (matmul, t,
indexing, cat, max/min with indices), other random ops (dropout, randn_like: values
drawn per piece would differ from an unsharded tensor's), `out=` variants, ragged operands of
different layouts, and tensors of other shapes, which would otherwise compute on the wrong
elements without a word.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Replicate

from .ragged import RaggedShard
from .ragged_placement import RaggedPlacement
from .tp_maps import local_index_maps, local_of_global, shard_dim

__all__ = ["dispatch", "is_ragged", "layout_key", "layout_spec", "refuse", "local_layout",
           "local_range", "range_of_full", "replicate_spec", "inner_shape", "wrap_like"]

aten = torch.ops.aten

_FUSED = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
# Element-wise ops torch does not tag `pointwise` (zero_, fill_, copy_ are tagged `inplace`).
_UNTAGGED_ELEMENTWISE = {"zero", "fill", "copy"}
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
         aten.full_like.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.detach.default, aten.alias.default}
_NORMS = {aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
          aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype, aten._foreach_norm.Scalar}
_SUM_LIKE = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
_EXTREMES = {aten.amax.default: "max", aten.amin.default: "min", aten.max.default: "max",
             aten.min.default: "min"}
_LOGICAL = {aten.all.default: "min", aten.any.default: "max"}  # as 0/1 over the ranks
_FOREACH_MAX = aten._foreach_max.default
# In-place random fills (nn.init's draws): the values of the same call at full shape.
_RANDOM_FILLS = {aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float,
                 aten.exponential_.default, aten.random_.default, getattr(aten.random_, "from"),
                 aten.random_.to, aten.geometric_.default, aten.log_normal_.default,
                 aten.cauchy_.default}


def is_ragged(t) -> bool:
    return isinstance(t, DTensor) and ragged_dim(t._spec) is not None


def ragged_dim(spec) -> int | None:
    """The mesh dim of a spec's RaggedPlacement (None: a DTensor of another kind)."""
    for d, placement in enumerate(spec.placements):
        if isinstance(placement, RaggedPlacement):
            return d
    return None


_INNER_SHAPES: dict = {}


def inner_shape(spec) -> tuple:
    """The shape the RaggedPlacement lays out: the global shape on a 1-D mesh, this rank's
    TP/EP-local shape on an N-D one (made once per shape, placements and mesh)."""
    if len(spec.placements) == 1:
        return tuple(spec.shape)
    key = (tuple(spec.shape), spec.placements, spec.mesh)
    if key not in _INNER_SHAPES:
        _INNER_SHAPES[key] = tuple(
            n if index is None else len(index)
            for n, index in zip(spec.shape, local_index_maps(spec)))
    return _INNER_SHAPES[key]


def local_layout(t) -> RaggedShard:
    """The RaggedShard of a ragged DTensor's (TP/EP-local, on an N-D mesh) tensor; `t` may
    also be its spec."""
    spec = getattr(t, "_spec", t)
    return spec.placements[ragged_dim(spec)].layout(inner_shape(spec))


def local_range(t) -> tuple[int, int]:
    """[start, end) of this rank's piece in the (TP/EP-local) tensor flattened row-major."""
    spec = getattr(t, "_spec", t)
    return local_layout(spec).local_range(spec.mesh.get_local_rank(ragged_dim(spec)))


def range_of_full(t, full: torch.Tensor) -> torch.Tensor:
    """This rank's flat piece of `full`, a plain tensor of `t`'s (or the spec's) global shape."""
    spec = getattr(t, "_spec", t)
    start, end = local_range(spec)
    return local_of_global(full, spec if spec.mesh.ndim > 1 else None).reshape(-1)[start:end]


def _reduce_groups(t) -> list:
    """The process groups a reduction over every element goes over: the shard group and each
    mesh dim that splits the tensor (replicas hold the same elements and are not summed)."""
    mesh = t._spec.mesh
    if mesh.ndim == 1:
        return [mesh.get_group()]
    return [mesh.get_group(ragged_dim(t._spec))] + [
        mesh.get_group(d) for d, p in enumerate(t._spec.placements) if shard_dim(p) is not None]


def _all_reduce(tensor, t, op) -> None:
    for group in _reduce_groups(t):
        dist.all_reduce(tensor, op=op, group=group)


def replicate_spec(t, shape, dtype) -> DTensorSpec:
    """A Replicate spec on `t`'s mesh: what a reduction of `t` returns."""
    return layout_spec(t._spec.mesh, (Replicate(),) * t._spec.mesh.ndim, shape, dtype)


def refuse(func, t, why: str = "") -> NotImplementedError:
    placement = _shown(t._spec.placements) if is_ragged(t) else "RaggedPlacement"
    shape = list(t.shape) if isinstance(t, torch.Tensor) else "?"
    why = why or ("its local tensor is a flat range of the row-major tensor, so the op would "
                  "compute on the wrong elements")
    return NotImplementedError(
        f"{func} is not supported on a RaggedShard DTensor ({placement}, global shape {shape}): "
        f"{why}; use .full_tensor() for the whole tensor or .to_local() for this rank's flat "
        "piece")


def layout_spec(mesh, placements, shape, dtype) -> DTensorSpec:
    """The spec of a tensor of `shape` on `mesh` with `placements` (a tuple, or one placement
    of a 1-D mesh), row-major strides (the order the layout is defined in)."""
    placements = tuple(placements) if isinstance(placements, (tuple, list)) else (placements,)
    shape = torch.Size(shape)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return DTensorSpec(mesh, placements, TensorMeta(shape, tuple(reversed(strides)), dtype))


def wrap_like(cls, local, like) -> DTensor:
    """`local` as a ragged DTensor with the global shape, mesh and placement of `like`."""
    spec = layout_spec(like._spec.mesh, like._spec.placements, like.shape, local.dtype)
    return cls(local, spec, requires_grad=False)


def _bind(func, args, kwargs) -> dict:
    """Argument name -> value, defaults filled in (the schema's order)."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def dispatch(cls, func, args, kwargs):
    packet = func.overloadpacket.__name__
    if func is aten.is_same_size.default:
        return args[0].shape == args[1].shape
    if func in _VIEWS:
        return _view(cls, func, args, kwargs)
    if func in _NORMS:
        return _norm(func, args, kwargs)
    if func in _SUM_LIKE or func in _EXTREMES or func in _LOGICAL:
        return _reduce(func, args, kwargs)
    if func is _FOREACH_MAX:
        return _foreach_max(func, args[0])
    if func is aten.copy_.default and is_ragged(args[0]) and not is_ragged(args[1]) and \
            isinstance(args[1], torch.Tensor) and args[1].dim() > 0:
        return _copy_from_full(func, *args[:2])
    if func is aten._to_copy.default:
        _same_device(func, args[0], kwargs.get("device"))
    if func in _LIKE:
        _same_device(func, args[0], kwargs.get("device"))
    if torch.Tag.nondeterministic_seeded in func.tags:
        if func in _RANDOM_FILLS and is_ragged(args[0]):
            return _fill_at_full_shape(func, args, kwargs)
        raise refuse(func, _first_ragged(args, kwargs), "random values drawn per piece would not "
                     "be those of an unsharded tensor")
    if _elementwise(func, packet):
        return _run_elementwise(cls, func, args, kwargs)
    raise refuse(func, _first_ragged(args, kwargs))


def _first_ragged(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        for t in (value if isinstance(value, (list, tuple)) else [value]):
            if is_ragged(t):
                return t
    return None


def _elementwise(func, packet: str) -> bool:
    """Whether `func` pairs elements by position. A foreach op is judged by its element op,
    any of whose overloads may carry the tag (`_foreach_max` would pass by `max.other`: it is
    a reduction, handled before this; `_run_elementwise` also checks the result shapes)."""
    if func in _LIKE or func is aten._to_copy.default or packet in _FUSED:
        return True
    if packet.startswith("_foreach_"):
        base = packet[len("_foreach_"):].rstrip("_")
        element = getattr(aten, base, None)
        return base in _UNTAGGED_ELEMENTWISE or element is not None and any(
            torch.Tag.pointwise in getattr(element, name).tags for name in element.overloads())
    return torch.Tag.pointwise in func.tags or packet.rstrip("_") in _UNTAGGED_ELEMENTWISE


def _same_device(func, t, device):
    if device is not None and torch.device(device) != t.device:
        raise refuse(func, t, f"moving it to {device} would leave its mesh on {t.device.type}")


def layout_key(t):
    """What two ragged tensors share when their local pieces pair element by element."""
    return (t._spec.placements, tuple(t.shape), t._spec.mesh)


def _run_elementwise(cls, func, args, kwargs):
    """One call of `func` on the local tensors (lists stay lists: one foreach kernel)."""
    names = [a.name for a in func._schema.arguments]
    writes = [a.name for a in func._schema.arguments
              if a.alias_info is not None and a.alias_info.is_write]
    first = _first_ragged(args, kwargs)
    if "out" in writes or any(name.startswith("out") for name in kwargs):
        raise refuse(func, first, "out= variants are not supported")
    layouts, single = _operand_layouts(func, args, kwargs, first)

    def ragged_at(position) -> bool:
        if single is not None:
            return True
        return bool(layouts) if position is None else position in layouts

    def unwrap(name, value):
        if _is_tensor_list(value):
            return [_local_operand(func, first, ragged_at(i), name, t)
                    for i, t in enumerate(value)]
        return _local_operand(func, first, ragged_at(None), name, value)

    listed = _is_tensor_list(args[0])
    if writes and not listed and not is_ragged(args[0]):
        raise refuse(func, first, "it writes into a tensor that is not the RaggedShard DTensor")
    out = func(*[unwrap(n, v) for n, v in zip(names, args)],
               **{n: unwrap(n, v) for n, v in kwargs.items()})
    if writes and not listed:
        return args[0]  # in place: the same tensor object, as torch returns
    if not func._schema.returns:
        return None
    return _wrap_results(cls, func, out, args, kwargs, first if single is not None else None,
                         listed)


def _operand_layouts(func, args, kwargs, first):
    """The ragged layout at each position of the tensor lists, and of the single (non-list)
    operands, which pair with every position: ({position: layout}, single layout or None);
    operands of different layouts are refused."""
    layouts, single = {}, None
    for value in list(args) + list(kwargs.values()):
        for position, t in (enumerate(value) if _is_tensor_list(value) else [(None, value)]):
            if not is_ragged(t):
                continue
            key = layout_key(t)
            seen = single if position is None else layouts.get(position)
            if seen is not None and seen != key:
                raise refuse(func, t, "its operands have different layouts "
                             f"({_describe(seen)} and {_describe(key)})")
            if position is None:
                single = key
            else:
                layouts[position] = key
    if single is not None and any(key != single for key in layouts.values()):
        raise refuse(func, first, "its operands have different layouts")
    return layouts, single


def _local_operand(func, first, ragged_here: bool, name, t):
    """The local tensor of a ragged operand; 0-d tensors as they are (a DTensor reduced to its
    value); anything else next to a ragged tensor is refused."""
    if is_ragged(t):
        return t._local_tensor
    if not isinstance(t, torch.Tensor):
        return t
    if not ragged_here:
        if isinstance(t, DTensor):
            raise refuse(func, first, "it mixes RaggedShard DTensors with other DTensors")
        return t
    if t.dim() == 0:
        return t.full_tensor() if isinstance(t, DTensor) else t
    if name == "scalars" and not isinstance(t, DTensor):
        return t  # a foreach op's one scalar per list entry
    kind = "DTensor" if isinstance(t, DTensor) else "plain tensor"
    raise refuse(func, first, f"it has a {kind} operand of shape {list(t.shape)}: only 0-d "
                 "tensors mix with a RaggedShard DTensor")


def _wrap_results(cls, func, out, args, kwargs, single_like, listed):
    """The local results as RaggedShard DTensors of their operands' layouts (`single_like`:
    the ragged single operand every result takes the layout of, if any)."""
    examples = {}
    for value in list(args) + list(kwargs.values()):
        if _is_tensor_list(value):
            for i, t in enumerate(value):
                if is_ragged(t):
                    examples.setdefault(i, t)
    first = _first_ragged(args, kwargs)

    def wrap(o, position):
        like = first if single_like is not None or position is None else examples.get(position)
        if not isinstance(o, torch.Tensor) or like is None:
            return o
        if o.shape != like._local_tensor.shape:  # not element-wise after all: never wrap it
            raise refuse(func, like, f"its local result has shape {list(o.shape)}, not the "
                         f"piece's {list(like._local_tensor.shape)}")
        return wrap_like(cls, o, like)
    if listed and isinstance(out, (list, tuple)):
        return type(out)(wrap(o, i) for i, o in enumerate(out))
    if isinstance(out, tuple):
        return tuple(wrap(o, None) for o in out)
    return wrap(out, None)


def _is_tensor_list(value) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in value)


def _describe(key) -> str:
    placements, shape, _ = key
    return f"{_shown(placements)} of shape {list(shape)}"


def _shown(placements) -> str:
    """One placement as itself, several as a list."""
    return str(placements[0]) if len(placements) == 1 else str(list(placements))


def _view(cls, func, args, kwargs):
    """Views that keep the row-major order: the local piece is the same flat range."""
    t = args[0]
    if func in (aten.detach.default, aten.alias.default):
        return wrap_like(cls, t._local_tensor, t)
    shape = list(args[1])
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = t.numel() // known if known else 0
    if math.prod(shape) != t.numel():
        raise refuse(func, t, f"shape {list(args[1])} does not have {t.numel()} elements")
    if t._spec.mesh.ndim > 1 and list(shape) != list(t.shape):
        raise refuse(func, t, "a view of a tensor/expert-parallel RaggedShard DTensor must "
                     "keep its shape (its TP/EP placements name dims of that shape)")
    local = t._local_tensor.view(-1)  # a view object of its own, as a view op returns
    return cls(local, layout_spec(t._spec.mesh, t._spec.placements, shape, local.dtype),
               requires_grad=False)


def _some_dims(t, dim):
    """The dims a reduction keeps reducing over, when not all of them (else None)."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0) or t.dim() == 0:
        return None
    dims = sorted({d % t.dim() for d in ([dim] if isinstance(dim, int) else dim)})
    return None if dims == list(range(t.dim())) else dims


def _reduce_some_dims(func, args, kwargs, t, dims, values, how, finish=None):
    """A reduction over some dims (a row norm, a column sum) as a Replicate DTensor: each
    local element's `values` go to their place in the reduced tensor (scatter_reduce; a
    rank's flat range need not hold whole rows), the partial results are all-reduced over
    the mesh at once and `finish` (a p-norm's root, a mean's divide) applies. The result's
    dtype and shape are the op's own on meta."""
    shape = list(t.shape)
    start, end = local_range(t)
    rest = torch.arange(start, end, device=values.device)
    coords = []
    for size in reversed(local_layout(t).shape):  # each element's row-major index, back to
        coords.append(rest % size)                # coordinates in the (TP/EP-local) tensor
        rest = rest // size
    coords.reverse()
    if t._spec.mesh.ndim > 1:  # and on to the global tensor's
        coords = [c if index is None else torch.tensor(index, device=c.device)[c]
                  for c, index in zip(coords, local_index_maps(t._spec))]
    kept = [d for d in range(len(shape)) if d not in dims]
    index = torch.zeros_like(coords[0]) if coords else rest
    for d in kept:
        index = index * shape[d] + coords[d]
    out = torch.full((math.prod(shape[d] for d in kept),),
                     0 if how == "sum" else _identity(how, values.dtype),
                     dtype=values.dtype, device=values.device)
    out.scatter_reduce_(0, index, values.reshape(-1),
                        {"sum": "sum", "max": "amax", "min": "amin"}[how])
    out = out.to(t._spec.mesh.device_type)  # (a piece in host memory on a device mesh: offload)
    _all_reduce(out, t, _REDUCE_OPS[how])
    if finish is not None:
        out = finish(out)
    meta = func(*[_on_meta(a) for a in args], **{k: _on_meta(v) for k, v in kwargs.items()})
    out = out.to(meta.dtype).reshape(meta.shape)
    return DTensor(out, replicate_spec(t, meta.shape, out.dtype), requires_grad=False)


def _on_meta(value):
    return torch.empty(value.shape, dtype=value.dtype, device="meta") \
        if isinstance(value, torch.Tensor) else value


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _over_mesh(values, tensors, how: str, p: float | None = None, keepdim=False, dtype=None):
    """Each rank's local results of one reduction (0-d, one per ragged tensor) reduced over
    their meshes now, one all-reduce per mesh and dtype, as Replicate DTensors. Not torch's
    lazy Partial: torch 2.13's `.item()` on a Partial DTensor returns the local value, so
    `grad.norm().item()` would silently be this rank's norm. A p-norm goes as x^p, summed,
    then ^(1/p) (in fp32 for 16-bit values, so x^p stays finite and exact enough)."""
    out = list(values)
    groups: dict = {}
    for i, (value, t) in enumerate(zip(values, tensors)):
        reduced_dims = tuple(shard_dim(p) is not None for p in t._spec.placements)
        groups.setdefault((t._spec.mesh, reduced_dims, value.dtype), []).append(i)
    for (mesh, _, value_dtype), indices in groups.items():
        flat = torch.stack([values[i] for i in indices])
        if p is not None:
            flat = flat.to(torch.float32 if value_dtype.itemsize < 4 else value_dtype).pow(p)
        if flat.device.type != mesh.device_type:
            # Pieces in host memory on a device mesh (an offloaded master): the all-reduce runs
            # where the group's backend does, and the result stays there, as a DTensor's would.
            flat = flat.to(mesh.device_type)
        _all_reduce(flat, tensors[indices[0]], _REDUCE_OPS[how])
        if p is not None:
            flat = flat.pow(1.0 / p).to(value_dtype)
        for j, i in enumerate(indices):
            out[i] = flat[j]
    results = []
    for value, t in zip(out, tensors):
        shape = (1,) * t.dim() if keepdim else ()
        value = value.reshape(shape) if dtype is None else value.reshape(shape).to(dtype)
        results.append(DTensor(value, replicate_spec(t, shape, value.dtype),
                               requires_grad=False))
    return results


def _norm_reduction(func, t, ord) -> tuple[str, float | None]:
    """How local norms combine: (all-reduce op, p for the x^p sum or None)."""
    ord = float(ord)
    if math.isinf(ord):
        return ("max", None) if ord > 0 else ("min", None)
    if ord == 0:
        return "sum", None  # a count of non-zeros
    if ord < 0:
        raise refuse(func, t, f"a norm of order {ord} < 0 does not combine over pieces")
    return "sum", ord


def _local_norm(t, ord, dtype):
    local = t._local_tensor
    if local.numel() == 0 and math.isinf(float(ord)):  # torch has no identity for these
        value = 0.0 if float(ord) > 0 else math.inf
        return torch.full((), value, dtype=dtype or local.dtype, device=local.device)
    return torch.linalg.vector_norm(local, ord, dtype=dtype)


def _norm(func, args, kwargs):
    bound = _bind(func, args, kwargs)
    ord = bound.get("ord", bound.get("p"))  # linalg_vector_norm's name, then aten.norm's
    ord, dtype = 2 if ord is None else ord, bound.get("dtype")
    if func is not aten._foreach_norm.Scalar:
        t = bound["self"]
        how, p = _norm_reduction(func, t, ord)
        dims = _some_dims(t, bound.get("dim"))
        if dims is not None:
            return _norm_some_dims(func, args, kwargs, t, dims, ord, how, p, dtype)
        return _over_mesh([_local_norm(t, ord, dtype)], [t], how, p,
                          bound.get("keepdim", False))[0]
    tensors = bound["self"]
    results = [None] * len(tensors)
    ragged = [i for i, t in enumerate(tensors) if is_ragged(t)]
    for i, t in enumerate(tensors):
        if i not in ragged:
            if isinstance(t, DTensor):
                raise refuse(func, None, "it mixes RaggedShard DTensors with other DTensors")
            results[i] = torch.linalg.vector_norm(t, ord, dtype=dtype)
    if ragged:  # one all-reduce for every ragged tensor of the list
        how, p = _norm_reduction(func, tensors[ragged[0]], ord)
        reduced = _over_mesh([_local_norm(tensors[i], ord, dtype) for i in ragged],
                             [tensors[i] for i in ragged], how, p)
        for i, value in zip(ragged, reduced):
            results[i] = value
    return results


def _norm_some_dims(func, args, kwargs, t, dims, ord, how, p, dtype):
    """A vector norm over some dims: |x|^p summed (in fp32 for 16-bit values, as over the
    mesh), |x| for the max and min norms, the non-zeros for ord 0."""
    local = t._local_tensor if dtype is None else t._local_tensor.to(dtype)
    magnitude = local.abs()
    if p is not None:
        wide = torch.float32 if magnitude.dtype.itemsize < 4 else magnitude.dtype
        return _reduce_some_dims(func, args, kwargs, t, dims, magnitude.to(wide).pow(p), "sum",
                                 lambda out: out.pow(1.0 / p))
    if how == "sum":  # ord 0
        magnitude = (magnitude != 0).to(magnitude.dtype)
    return _reduce_some_dims(func, args, kwargs, t, dims, magnitude, how)


def _reduce(func, args, kwargs):
    bound = _bind(func, args, kwargs)
    t = bound["self"]
    if not is_ragged(t):
        raise refuse(func, _first_ragged(args, kwargs))
    local, keepdim = t._local_tensor, bound.get("keepdim", False)
    dims = _some_dims(t, bound.get("dim"))
    if dims is not None:  # sum, mean, amax, amin over some dims
        if func in _SUM_LIKE:
            count = math.prod(t.shape[d] for d in dims)
            values = local.to(bound.get("dtype") or (local.dtype if local.is_floating_point()
                                                     else torch.int64))
            finish = (lambda out: out / count) if func is aten.mean.dim else None
            return _reduce_some_dims(func, args, kwargs, t, dims, values, "sum", finish)
        return _reduce_some_dims(func, args, kwargs, t, dims, local, _EXTREMES[func])
    if func in _SUM_LIKE:
        value = local.sum(dtype=bound.get("dtype"))
        if func in (aten.mean.default, aten.mean.dim):
            value = value / t.numel()  # each rank's share of the global mean
        return _over_mesh([value], [t], "sum", keepdim=keepdim)[0]
    if func in _LOGICAL:  # an empty piece gives all()'s True and any()'s False: the identities
        value = (local.all() if func is aten.all.default else local.any()).to(torch.int32)
        return _over_mesh([value], [t], _LOGICAL[func], dtype=torch.bool)[0]
    how = _EXTREMES[func]
    return _over_mesh([_extreme(local, how)], [t], how, keepdim=keepdim)[0]


def _extreme(local, how: str):
    """This piece's max or min; the reduction's identity for an empty piece."""
    if local.numel() == 0:
        return torch.full((), _identity(how, local.dtype), dtype=local.dtype,
                          device=local.device)
    return local.amax() if how == "max" else local.amin()


def _foreach_max(func, tensors):
    ragged = [t for t in tensors if is_ragged(t)]
    if any(isinstance(t, DTensor) and not is_ragged(t) for t in tensors):
        raise refuse(func, None, "it mixes RaggedShard DTensors with other DTensors")
    reduced = iter(_over_mesh([_extreme(t._local_tensor, "max") for t in ragged], ragged, "max"))
    return [next(reduced) if is_ragged(t) else t.amax() for t in tensors]


def _identity(how: str, dtype):
    if dtype == torch.bool:
        return how == "min"
    if dtype.is_floating_point:
        return -math.inf if how == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if how == "max" else info.max


def _fill_at_full_shape(func, args, kwargs):
    """`t.normal_(...)` and the other in-place random fills: the whole tensor is drawn on every
    rank (the generators agree, as every rank of an init runs the same calls) and this rank's
    range of it kept, so the values are those of the same call on an unsharded tensor and the
    generator moves as far. Costs a temporary full tensor per call: for initialization."""
    dst = args[0]
    if any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in list(args[1:]) +
           list(kwargs.values())):
        raise refuse(func, dst, "a tensor of parameters for each element is not supported")
    full = torch.empty(dst.shape, dtype=dst.dtype, device=dst._local_tensor.device)
    func(full, *args[1:], **kwargs)
    return _copy_from_full(func, dst, full)


def _copy_from_full(func, dst, src):
    """`dst.copy_(full)`: this rank's flat range of a plain tensor of the global shape."""
    if isinstance(src, DTensor) or tuple(src.shape) != tuple(dst.shape):
        raise refuse(func, dst, f"the source is a {type(src).__name__} of shape "
                     f"{list(src.shape)}; copy_ takes a RaggedShard DTensor of the same layout, "
                     "a 0-d tensor or a plain tensor of the global shape")
    dst._local_tensor.copy_(range_of_full(dst, src))
    return dst
