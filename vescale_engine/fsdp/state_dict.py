"""State-dict utilities over sharded modules: full parameters for a while
(`gathered_parameters`), full and sharded state dicts, and the one per-DBuffer gather every
saver uses (`gathered_buffers`; `gather_to_rank0` for the HF saver and the 16-bit state dict,
which under TP/EP gathers one copy of every piece to rank 0 as boxes of the global tensors)."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from ..launch.collective_timeout import explain_timeout
from ..shard import collectives
from ..shard.ragged import box_decomposition, map_box
from .dtensor_params import local_index_maps, refuse_tp_ep, sharded_mesh_dims
from .guards import require_materialized
from .lookup import sharded_parameters, units_under
from .param import sharding_of

__all__ = ["gathered_parameters", "full_state_dict", "sharded_state_dict", "gather_full",
           "gather_selected", "GatheredBuffer", "gathered_buffers", "all_gather_master",
           "named_entries", "gather_to_rank0"]


@contextlib.contextmanager
def gathered_parameters(module: nn.Module, writeback: bool = False, *, rank0_only: bool = False,
                        cpu_offload: bool = False):
    """Full fp32 parameters in `module` for the duration (like DeepSpeed's GatheredParameters
    and FSDP1's summon_full_params). DBuffers are gathered one at a time: with `cpu_offload`
    each is copied to CPU (pinned memory when it is on CUDA) and freed before the next is
    gathered, so the device never holds more than one full buffer; without it the full
    parameters are views of the gathered buffers, on the device. `rank0_only`: only global
    rank 0 holds full parameters, the others keep their shards. With `writeback`, changes made
    inside are kept (every rank must make the same change)."""
    if writeback and rank0_only:
        raise ValueError("gathered_parameters: writeback=True needs the full parameters on every "
                         "rank; it cannot be combined with rank0_only=True")
    keep = not rank0_only or dist.get_rank() == 0
    full = gather_full(module, keep, "host" if cpu_offload else "view")
    faces = {p: nn.Parameter(value, requires_grad=p.requires_grad) for p, value in full.items()}
    for p, face in faces.items():
        p.register(face)
    try:
        yield module
    finally:
        for p, face in faces.items():
            if writeback:
                with torch.no_grad():
                    p.buffer.load_full_tensor(p.index, face)  # this rank's range of it
            if face.requires_grad != p.requires_grad:  # set inside: it stays set
                p.sharded.requires_grad_(face.requires_grad)
            p.register(p.sharded)


def full_state_dict(module: nn.Module, *, rank0_only: bool = False,
                    cpu_offload: bool = False) -> dict:
    """Every parameter's full value (fp32 master) plus the buffers, keyed as
    `module.state_dict()` (tied names share one tensor). DBuffers are gathered one at a time and
    their parameters copied out (to CPU with `cpu_offload`, pinned when the source is CUDA)
    before the next is gathered: the device holds the result plus at most one full buffer, or
    just one full buffer with `cpu_offload`. With `rank0_only` only global rank 0 gets the
    values; the other ranks take part in the gathers and get {}. Under tensor/expert
    parallelism the values are the global tensors (`_global_state_dict`)."""
    keep = not rank0_only or dist.get_rank() == 0
    if any(sharded_mesh_dims(p.dtensor_spec) for unit in units_under(module) for p in unit.params):
        return _global_state_dict(module, keep, rank0_only, cpu_offload)
    full = gather_full(module, keep, "host" if cpu_offload else "clone")
    if not keep:
        return {}
    registered = {p: nn.Parameter(value, requires_grad=False) for p, value in full.items()}
    for p, value in registered.items():  # only so that state_dict names them as the module does
        p.register(value)
    ours = {id(value) for value in registered.values()}
    try:
        sd = module.state_dict(keep_vars=True)
    finally:
        for p in full:
            p.register(p.sharded)
    out = {}
    for key, value in sd.items():
        if id(value) in ours:
            out[key] = value.detach()
        else:  # a module buffer: a copy, as for the parameters
            out[key] = _copy_out(value.detach(), "host" if cpu_offload else "clone")
            _finish_host_copies(value.device, "host" if cpu_offload else "clone")
    return out


def _global_state_dict(module, keep, rank0_only, cpu_offload) -> dict:
    """full_state_dict under tensor/expert parallelism: the GLOBAL tensors, gathered to rank 0
    one DBuffer at a time (`gather_to_rank0`), then, unless `rank0_only`, broadcast from rank 0
    one tensor at a time (its names, shape and dtype first, as one object)."""
    require_materialized(module, "gathering full parameters")
    device = next(b.device for unit in units_under(module) for b in unit.buffers)
    rank0 = dist.get_rank() == 0
    out, order = {}, []
    for names, _, value in gather_to_rank0(module):  # rank 0 only: host copies
        value = value if cpu_offload else value.to(device)
        order.append((names, tuple(value.shape), value.dtype))
        for name in names:
            out[name] = value
    if rank0_only:
        return out if keep else {}
    shared = [order]
    with explain_timeout("the broadcast of the state dict's names and shapes (full values)"):
        dist.broadcast_object_list(shared, src=0)
    for names, shape, dtype in shared[0]:
        value = out[names[0]].to(device) if rank0 else torch.empty(shape, dtype=dtype,
                                                                    device=device)
        with explain_timeout(f"the broadcast of {names[0]} (full values)"):
            dist.broadcast(value, src=0)
        value = value.cpu() if cpu_offload else value
        for name in names:
            out[name] = value
    return out


def gather_full(module, keep, mode) -> dict:
    """{ShardedParameter: full value} for every managed parameter under `module` (empty when
    not `keep`); `gather_selected` says how."""
    require_materialized(module, "gathering full parameters")
    return gather_selected([p for unit in units_under(module) for p in unit.params], keep, mode)


def gather_selected(params, keep=True, mode="view", compute_dtype=False) -> dict:
    """{ShardedParameter: full value} for `params` (empty when not `keep`). One DBuffer at a
    time, in the order `params` first name them: all-gather its master into a full buffer,
    copy the selected parameters out (`mode`: "view" keeps the buffer alive as their storage,
    "clone" copies on the device, "host" to CPU), and drop the buffer before gathering the
    next. `compute_dtype`: the values in the buffer's compute dtype (what forward computes
    with) instead of the master's."""
    out = {}
    for gathered in gathered_buffers(params):
        if keep:
            for p in gathered.members:  # no local keeps a view past the buffer's turn
                out[p] = _copy_out(gathered.value(p, compute_dtype), mode)
            _finish_host_copies(gathered.buffer.device, mode)
    return out


class GatheredBuffer:
    """One DBuffer's master all-gathered into a full tensor, valid while `gathered_buffers`
    yields it (afterwards only views taken from it keep that tensor alive)."""

    def __init__(self, buffer, members, full):
        self.buffer, self.members, self.full = buffer, members, full

    def value(self, p, compute_dtype=False):
        """Parameter `p`'s full-shape value: a view of the gathered tensor (a copy in the
        buffer's compute dtype with `compute_dtype`, when that differs)."""
        pl = self.buffer.layout.placements[p.index]
        value = self.full[pl.offset:pl.offset + pl.numel].view(p.shape)
        if compute_dtype and self.buffer.param_dtype != value.dtype:
            value = value.to(self.buffer.param_dtype)
        return value


def gathered_buffers(params):
    """Yield a GatheredBuffer per DBuffer of `params`, one at a time, in the order `params`
    first name them; each full tensor is dropped (unless a view of it was kept) before the
    next is made. Every rank must run it to the end (one collective per buffer)."""
    selected = {}
    for p in params:
        selected.setdefault(p.buffer, {})[p] = None
    refuse_tp_ep(params, "gathering full parameter values", "it would give each rank's "
                 "TP/EP-local tensor, not the global one")
    for buf, members in selected.items():
        full = torch.empty(buf.world_size * buf.shard_size, dtype=buf.master.dtype,
                           device=buf.device)  # (an offloaded master is in host memory)
        with explain_timeout(f"the all-gather of {buf.name}'s master shards (full values)"):
            all_gather_master(full, buf)
        gathered = GatheredBuffer(buf, list(members), full)
        del full
        try:
            yield gathered
        finally:
            gathered.full = None  # the caller's reference no longer holds the storage


def all_gather_master(full, buf):
    """The collective runs where the buffer's collectives run: a master offloaded to host
    memory (optim/offload.py) is copied to the device first."""
    source = buf.master if buf.master.device == full.device else buf.master.to(full.device)
    collectives.all_gather(full, source, buf.shard_group, async_op=False, native=buf.comm.native)


def named_entries(module) -> list:
    """[(names, tensor)] for every parameter and persistent buffer of `module`, as
    `state_dict` names them: a tied parameter once, with all its names. Managed parameters
    appear as their 1-D sharded piece (`tensor._vescale` is the ShardedParameter)."""
    groups = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            groups.setdefault(id(value), ([], value))[0].append(name)
    return list(groups.values())


def gather_to_rank0(module, dtype=None):
    """Yield (names, source, value) for every parameter and persistent buffer of `module` on
    global rank 0: `names` as `state_dict` gives them (a tied parameter once, with all its
    names), `source` the module's tensor (a managed parameter's sharded piece), `value` its full
    tensor as a host copy, floating values cast to `dtype` (None keeps theirs). One DBuffer is
    gathered at a time and dropped before the next. Under tensor/expert parallelism `value` is
    the GLOBAL tensor: one copy of every piece of the TP/EP-local tensors goes to rank 0
    (replicas send nothing), placed there by the rank's TP/EP offsets (`_pieces_to_rank0`).
    The other ranks yield nothing, but every rank must run the generator to its end (one
    collective per DBuffer)."""
    rank0 = dist.get_rank() == 0

    def copied(value):
        value = value.detach()
        return value.to(device="cpu", dtype=_cast(value.dtype, dtype), copy=True)

    entries = named_entries(module)
    names_of = {id(t): names for names, t in entries}
    params = [p for unit in units_under(module) for p in unit.params]
    if any(sharded_mesh_dims(p.dtensor_spec) for p in params):
        for p, value in _pieces_to_rank0(params, dtype):
            names = names_of.get(id(p.sharded))
            if names is not None:
                yield names, p.sharded, value
    else:
        for gathered in gathered_buffers(params):
            if rank0:
                for p in gathered.members:
                    names = names_of.get(id(p.sharded))
                    if names is not None:
                        yield names, p.sharded, copied(gathered.value(p))
    if rank0:
        for names, tensor in entries:
            if sharding_of(tensor) is None:
                yield names, tensor, copied(tensor)


def _cast(have, dtype):
    return dtype if dtype is not None and have.is_floating_point else have


def _piece_record(p):
    """What rank 0 needs to place this rank's piece of `p`: (fqn, [begin, end) in the master
    shard, flat begin in the TP/EP-local tensor, coordinate on the TP/EP mesh or None)."""
    start, end = p.buffer.local_ranges[p.index]
    spec = p.dtensor_spec
    coordinate = spec.mesh.get_coordinate() if sharded_mesh_dims(spec) else None
    return p.fqn, start, end, p.flat_range[0], coordinate


def _pieces_to_rank0(params, dtype):
    """Yield (ShardedParameter, global host tensor) on rank 0, one DBuffer at a time: the ranks
    holding distinct pieces of the buffer send their master shard to rank 0 (point to point),
    which places each piece as boxes of the global tensor (`_place`). A rank whose pieces
    another, lower rank holds alike (an HSDP replica, a TP peer of a buffer of replicated
    tensors: the same ranges, the same TP/EP coordinate) sends nothing (`_senders`), so rank 0
    receives one replica's bytes, never the world's; a global tensor the boxes do not cover
    exactly is an error. Rank 0 holds one buffer's received shards plus its members' global
    tensors; the other ranks send their shard and hold nothing more."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buffers = {}
    for p in params:
        buffers.setdefault(p.buffer, []).append(p)
    mine = [(buf.shard_size, [_piece_record(p) for p in members])
            for buf, members in buffers.items()]
    records = [None] * world if rank == 0 else None
    with explain_timeout("the gather of every rank's buffer layout to rank 0 (full values)"):
        dist.gather_object(mine, records, dst=0)
    agreed = [None, None]  # (rank 0's problem, every buffer's sending ranks)
    if rank == 0:
        agreed = [_layout_problem(records, mine),
                  [_senders([r[i] for r in records]) for i in range(len(mine))]]
    dist.broadcast_object_list(agreed, src=0)
    if agreed[0] is not None:
        raise RuntimeError(agreed[0])
    for i, (buf, members) in enumerate(buffers.items()):
        senders = agreed[1][i]
        sizes = [records[r][i][0] for r in senders] if rank == 0 else None
        with explain_timeout(f"the sends of {buf.name}'s master shards to rank 0 (full "
                             "values)"):
            shards = _send_to_rank0(buf, senders, sizes)
        if rank == 0:
            pieces = [{rec[0]: rec for rec in records[r][i][1]} for r in senders]
            for p in members:
                yield p, _place(p, [(shards[k], pieces[k][p.fqn]) for k in range(len(senders))],
                                _cast(buf.master.dtype, dtype))
            del shards


def _senders(buffer_records) -> list:
    """The ranks whose shard of one buffer rank 0 needs: the first rank of each distinct
    (shard size, pieces) record, so replicas are received once. Rank 0 is always first."""
    seen, out = set(), []
    for r, (size, pieces) in enumerate(buffer_records):
        key = (size, tuple(map(str, pieces)))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _send_to_rank0(buf, senders, sizes):
    """Each sender's master shard of `buf` on rank 0 (host tensors, in `senders` order; None
    elsewhere): rank 0 posts one receive per other sender, each sender one send."""
    rank = dist.get_rank()
    source = buf.master if buf.master.device == buf.device else buf.master.to(buf.device)
    if rank != 0:
        if rank in senders:
            dist.send(source.contiguous(), dst=0)
        return None
    shards, waits = [], []
    for r, size in zip(senders, sizes):
        if r == 0:  # its own: read in place (the save changes nothing)
            shards.append(source.detach())
            continue
        shards.append(torch.empty(size, dtype=source.dtype, device=buf.device))
        waits.append(dist.irecv(shards[-1], src=r))
    for work in waits:
        work.wait()
    return [s.cpu() for s in shards]


def _place(p, pieces, dtype) -> torch.Tensor:
    """`p`'s global tensor from every rank's (shard, record): each piece is a flat range of
    that rank's TP/EP-local tensor (box_decomposition), mapped to boxes of the global tensor
    by the rank's index maps (map_box)."""
    spec = p.dtensor_spec
    shape = tuple(spec.shape) if spec is not None else tuple(p.shape)
    out = torch.empty(shape, dtype=dtype)
    placed, covered = set(), 0
    for shard, (_, start, end, flat_begin, coordinate) in pieces:
        if end == start:
            continue
        maps = local_index_maps(spec, coordinate) if coordinate is not None \
            else [None] * len(shape)
        local_shape = [len(m) if m is not None else n for m, n in zip(maps, shape)]
        at = start
        for offsets, sizes in box_decomposition(local_shape, flat_begin,
                                                flat_begin + end - start):
            local_box = shard[at:at + math.prod(sizes)].view(sizes)
            at += math.prod(sizes)
            for inner, part, global_offsets in map_box(offsets, sizes, maps):
                if (global_offsets, part) in placed:  # a replica's copy, already placed
                    continue
                placed.add((global_offsets, part))
                covered += math.prod(part)
                src = local_box
                for d, (o, n, lo) in enumerate(zip(inner, part, offsets)):
                    src = src.narrow(d, o - lo, n)
                out[tuple(slice(o, o + n) for o, n in zip(global_offsets, part))].copy_(src)
    if covered != out.numel():
        raise RuntimeError(f"gathering {p.fqn} to rank 0: its pieces cover {covered} of the "
                           f"{out.numel()} elements of its global shape {list(shape)}")
    return out


def _layout_problem(records, mine):
    """One line when the ranks' buffers do not line up (the same buffers, the same
    parameters in each), else None: the gathers pair buffer i of every rank."""
    for r, theirs in enumerate(records):
        if len(theirs) != len(mine):
            return (f"gathering full values to rank 0: rank {r} has {len(theirs)} buffers, "
                    f"rank 0 has {len(mine)}")
        for i, ((_, a), (_, b)) in enumerate(zip(theirs, mine)):
            if [x[0] for x in a] != [x[0] for x in b]:
                return (f"gathering full values to rank 0: buffer {i} of rank {r} holds other "
                        "parameters than rank 0's")
    return None


def _pinned_staging(device) -> bool:
    """Host copies from CUDA go through pinned memory, asynchronously (one wait per buffer)."""
    return torch.device(device).type == "cuda"


def _copy_out(value, mode):
    if mode == "view":
        return value
    if mode == "clone":
        return value.clone()
    pinned = _pinned_staging(value.device)
    out = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pinned)
    out.copy_(value, non_blocking=pinned)
    return out


def _finish_host_copies(device, mode):
    if mode == "host" and _pinned_staging(device):
        torch.cuda.current_stream(device).synchronize()


def sharded_state_dict(module: nn.Module) -> dict:
    """{fqn: (local 1-D piece of the fp32 master, its RaggedShard)} for every managed parameter:
    what each rank checkpoints, with no communication."""
    out = {}
    refuse_tp_ep([p for _, p in sharded_parameters(module)], "sharded_state_dict",
                 "its RaggedShard would describe the TP/EP-local tensor as the global one")
    for fqn, p in sharded_parameters(module):
        out[fqn] = (p.local(), p.layout)
    return out
